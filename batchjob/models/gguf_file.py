"""A GGUF model file (llama.cpp's format): metadata -> config and tokenizer, tensors to HF names and layout: matrices
in the block formats the native kernels compute (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) kept in their blocks, repacked
for the kernel (kernels/linear_quant.py PackedWeight: computed as stored, the file's bytes in memory); the rest
dequantized one by one (for an int8 build, Q8_0 matrices kept as their int8 codes and block scales instead). Which
family, and how its GGUF names and values map back, the family says (models/families/: Family.gguf_names,
gguf_tensor); nothing here names a family."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch

from batchjob.kernels.linear_quant import PackedWeight
from batchjob.notices import notice
from batchjob.kernels import GGUF_BLOCK, GGUF_FORMATS, native_quant_blocks
from batchjob.kernels.quantization import QuantizedWeight
from batchjob.models.config import ModelConfig
from batchjob.models.family import Family
from batchjob.models.registry import FLOAT_MATMULS, config_from_gguf, family_of, weight_shapes
from batchjob.models.tokenizer import Tokenizer
from batchjob.models.identity import gguf_identity, open_gguf
from batchjob.models.weights import LoadedModel, ModelLoadError, checked_weights

# What llama.cpp writes for dense weights and gguf's dequantize reads (tests/models/test_gguf_quants.py): the
# floats, the 32-weight block types, the 256-weight K-quants, and IQ4_NL, which llama.cpp puts in Q2_K/Q3_K files
# where a row is not a multiple of 256. Not the other i-quants (IQ4_XS, IQ3_S, ...), the ternary or FP4 types.
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL",
              "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
Q8_0_BLOCK = 32  # weights per Q8_0 block (one fp16 scale each)
_CHUNK_ELEMENTS = 1 << 22  # dequantize this many weights at a time (16 MB of float32), so a tensor never costs 2 copies


def gguf_config(path: Path, reader: gguf.GGUFReader) -> tuple[dict, ModelConfig]:
    """The file's metadata (the GGUF.* header fields left out) and the model config it describes."""
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, config_from_gguf(meta, [t.name for t in reader.tensors], source=str(path))


def load_gguf(path: Path, dtype: torch.dtype, int8_codes: bool = False, blocks: bool = False) -> LoadedModel:
    """`blocks` (a CPU model with --quantization auto): matrices in a block format the native kernels compute stay in
    their blocks, repacked (PackedWeight; the embeddings too, not the MoE routers), each tensor's file pages let go
    once packed so that loading peaks near one copy; where the kernels cannot be built, said once, everything is
    dequantized. `int8_codes` (a model built with --quantization int8): Q8_0 matrices stay int8 codes with their fp16
    scale per 32 weights (QuantizedWeight, group 32; build_model re-quantizes them per output channel from their
    exact values, docs/guide/quantization.md); otherwise every tensor is dequantized to `dtype` here."""
    reader = open_gguf(path)
    meta, config = gguf_config(path, reader)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e

    for t in reader.tensors:  # refuse before spending time dequantizing
        if t.tensor_type.name not in _GGUF_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}; supported GGUF types: {', '.join(_GGUF_TYPES)}"
            )
    family = family_of(config)
    names = _NameMap(family, config, meta["general.architecture"], path)
    native = native_quant_blocks() if blocks else None
    expected = weight_shapes(config)
    weights = {}
    unpacked: Counter[str] = Counter()  # matrices left in the compute dtype (a block format the kernels lack), by type
    unpacked_bytes = 0
    for t in reader.tensors:
        hf_names = names.hf_names(t)  # before dequantizing: an unexpected tensor costs nothing
        if stray := [n for n in hf_names if n not in expected]:
            raise ModelLoadError(f"{path}: GGUF tensor {t.name} ({stray[0]}) is not part of the model its metadata "
                                 f"describes ({config.architecture}, {config.num_layers} layers)")
        vector = len(t.shape) == 1  # norms and biases: fixed in float32, then cast (Gemma stores 1 + w)
        if native is not None and not vector and _packable(t, hf_names):
            parts = list(t.data) if len(hf_names) > 1 else [t.data]  # numpy views of the mapped rows
            for name, raw in zip(hf_names, parts, strict=True):
                if family.gguf_tensor is not None:  # a row permutation (llama's Q/K): the rows' blocks move whole
                    raw = family.gguf_tensor(config, name, raw)
                weights[name] = PackedWeight([native.pack_gguf(raw, int(t.tensor_type), int(t.shape[0]))])
            _release_pages(reader, t)
            continue
        if native is not None and not vector and not any(n.endswith(FLOAT_MATMULS) for n in hf_names):
            unpacked[t.tensor_type.name] += 1
            unpacked_bytes += int(t.n_elements) * dtype.itemsize
        if int8_codes and not vector and t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            codes, scales = q8_0_codes(t)
            pairs = zip(codes.unbind(0), scales.unbind(0)) if len(hf_names) > 1 else [(codes, scales)]
            parts = [QuantizedWeight(c, s, "GGUF Q8_0", Q8_0_BLOCK) for c, s in pairs]
        else:
            tensor = dequantized(t, torch.float32 if vector else dtype)
            parts = tensor.unbind(0) if len(hf_names) > 1 else [tensor]  # experts stacked on the first dim
        for name, part in zip(hf_names, parts, strict=True):
            if family.gguf_tensor is not None and isinstance(part, QuantizedWeight):  # Q/K rows: codes and scales alike
                part = QuantizedWeight(family.gguf_tensor(config, name, part.codes),
                                       family.gguf_tensor(config, name, part.scales), part.scheme, part.group)
            elif family.gguf_tensor is not None:
                part = family.gguf_tensor(config, name, part)
            weights[name] = part if isinstance(part, QuantizedWeight) else part.to(dtype)
    weights = checked_weights(config, weights, source=str(path))
    if unpacked:  # said once, at load: what these tensors cost (the kernels compute Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K)
        kinds = ", ".join(f"{kind} ({n})" for kind, n in unpacked.most_common())
        notice(f"{path.name}: {sum(unpacked.values())} matrices stored as {kinds} are not computed as stored: "
               f"dequantized at load to {str(dtype).removeprefix('torch.')}, {unpacked_bytes / (1 << 30):.2f} GiB")

    identity = gguf_identity(path, reader, config.architecture)
    return LoadedModel(config, weights, tokenizer, identity, name=path.stem)


def _packable(t: gguf.ReaderTensor, hf_names: list[str]) -> bool:
    """Whether a matrix is computed as stored: a block format the kernels compute, whole blocks per row (always so in
    a file llama.cpp wrote), and not a router (routers run in the compute dtype)."""
    kind = int(t.tensor_type)
    return (kind in GGUF_FORMATS and int(t.shape[0]) % GGUF_BLOCK[kind] == 0
            and not any(n.endswith(FLOAT_MATMULS) for n in hf_names))


@functools.cache
def _madvise():
    """libc's madvise, or None (not Linux/glibc: the pages then go when the reader does)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _release_pages(reader: gguf.GGUFReader, t: gguf.ReaderTensor) -> None:
    """Lets the process's resident memory drop a packed tensor's file pages (MADV_DONTNEED on the read-only mapping:
    they stay in the page cache): the mapping would otherwise keep the whole file resident beside the packed copy
    until the reader is gone, a second copy of the weights at the load's peak."""
    madvise = _madvise()
    if madvise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base, page = reader.data.ctypes.data, mmap.PAGESIZE  # the mapping starts at the file's first byte, page-aligned
    start = (t.data_offset + page - 1) // page * page  # whole pages of this tensor only (neighbours may share one)
    end = (t.data_offset + t.n_bytes) // page * page
    if end > start:
        madvise(base + start, end - start, mmap.MADV_DONTNEED)  # advice: a failure leaves the pages to the reader


class _NameMap:
    """GGUF tensor names -> HF names, by the family's table ("blk.{bid}.attn_q" -> "model.layers.{bid}.self_attn.q_proj")."""

    def __init__(self, family: Family, config: ModelConfig, gguf_arch: str, source: Path):
        self.table = family.gguf_names(config) if family.gguf_names is not None else {}
        self.config, self.gguf_arch, self.source = config, gguf_arch, source

    def hf_names(self, t: gguf.ReaderTensor) -> list[str]:
        """The HF name(s) of tensor `t`: one per expert for a stacked *_exps tensor, else one."""
        block, base, kind = None, t.name, ""
        if m := re.fullmatch(r"(.+)\.(weight|bias)", t.name):
            base, kind = m[1], "." + m[2]
        if m := re.fullmatch(r"blk\.(\d+)\.(.+)", base):
            block, base = int(m[1]), "blk.{bid}." + m[2]
        target = self.table.get(base)
        if target is None:
            known = sorted({k.removeprefix("blk.{bid}.") for k in self.table})
            raise ModelLoadError(f"{self.source}: unexpected GGUF tensor {t.name!r} for a {self.gguf_arch!r} model "
                                 f"(read as {self.config.architecture}); the tensors it can hold: {', '.join(known)}")
        if "{xid}" not in target:
            return [target.format(bid=block) + kind]
        experts = int(t.shape[-1])  # GGUF lists dimensions innermost first: experts last
        return [target.format(bid=block, xid=x) + kind for x in range(experts)]


def dequantized(t: gguf.ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a `dtype` tensor in HF layout (rows = out features), through gguf's own dequantize.

    Row chunks go straight into the result, so loading holds the weights once in `dtype` plus one chunk:
    gguf's dequantize of a whole tensor would hold it twice in float32.
    """
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    rows = t.data.reshape(-1, t.data.shape[-1])  # F32/F16: elements; the others: each row's bytes
    out = torch.empty((rows.shape[0], shape[-1]), dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // shape[-1])
    for start in range(0, rows.shape[0], step):
        chunk = gguf.quants.dequantize(rows[start:start + step], t.tensor_type)  # float32
        if not chunk.flags.writeable:  # F32 comes back as a view of the read-only mapping
            chunk = chunk.copy()
        out[start:start + step] = torch.from_numpy(chunk)
    return out.reshape(shape)


def q8_0_codes(t: gguf.ReaderTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's (int8 codes [..., rows, K], fp32 scales [..., rows, K / 32]) in HF layout: each block of 32
    weights is an fp16 scale d then 32 int8 codes q, its values d * q (in fp32, as gguf's dequantize)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    blocks = t.data.reshape(-1, 2 + Q8_0_BLOCK)
    scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32))
    codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
    return codes.reshape(shape), scales.reshape(*shape[:-1], shape[-1] // Q8_0_BLOCK)
