"""A GGUF model file (llama.cpp's format): metadata -> config and tokenizer, tensors dequantized to HF names
and layout (Q/K rows un-permuted for llama)."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from batchjob.models.registry import config_from_gguf
from batchjob.models.tokenizer import Tokenizer
from batchjob.models.weights import LoadedModel, ModelLoadError, checked_weights, sha256_file

# What llama.cpp writes for dense weights and gguf's dequantize reads (tests/models/test_gguf_quants.py): the
# floats, the 32-weight block types, the 256-weight K-quants, and IQ4_NL, which llama.cpp puts in Q2_K/Q3_K files
# where a row is not a multiple of 256. Not the other i-quants (IQ4_XS, IQ3_S, ...), the ternary or FP4 types.
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL",
              "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
_CHUNK_ELEMENTS = 1 << 22  # dequantize this many weights at a time (16 MB of float32), so a tensor never costs 2 copies

# GGUF per-block tensor name -> HF name under model.layers.{i}.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    try:
        reader = _FastGGUFReader(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - the reader fails in many ways on a short file (IndexError, reshape)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)") from None
        raise ModelLoadError(f"{path}: the GGUF file is truncated or damaged: its header or a tensor runs past the "
                             f"end of the file ({path.stat().st_size:,} bytes; {type(e).__name__}: {e}); copy or "
                             f"download it again") from None
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors.keys(), source=str(path))
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e

    for t in reader.tensors:  # refuse before spending time dequantizing
        if t.tensor_type.name not in _GGUF_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}; supported GGUF types: {', '.join(_GGUF_TYPES)}"
            )
    weights = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        tensor = dequantized(t, dtype)
        if meta["general.architecture"] == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_heads if t.name.split(".")[-2] == "attn_q" else config.num_kv_heads
            tensor = unpermute_rotary(tensor, heads)
        weights[name] = tensor
    weights = checked_weights(config, weights, source=str(path))

    identity = {
        "format": "gguf",
        "path": str(path),
        "architecture": config.architecture,
        "files": [{"name": path.name, "size": path.stat().st_size}],
        # header + metadata + tensor table: names, types, shapes, offsets, tokenizer and template
        "gguf_header_sha256": sha256_file(path, limit=int(reader.data_offset)),
    }
    return LoadedModel(config, weights, tokenizer, identity, name=path.stem)


def _hf_name(gguf_name: str, source: Path) -> str:
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name):
        block, part, kind = m.groups()
        if part in _GGUF_BLOCK_NAMES:
            return f"model.layers.{block}.{_GGUF_BLOCK_NAMES[part]}.{kind}"
    elif m := re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name):
        if m[1] in _GGUF_TOP_NAMES:
            return f"{_GGUF_TOP_NAMES[m[1]]}.{m[2]}"
    raise ModelLoadError(f"{source}: unexpected GGUF tensor {gguf_name!r} (not a llama/qwen2/qwen3 dense model?)")


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


def unpermute_rotary(w: np.ndarray | torch.Tensor, heads: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (HF's half-split rotary -> interleaved).

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...); HF wants both halves
    contiguous. Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # a contiguous copy


class _FastGGUFReader(gguf.GGUFReader):
    # GGUFReader slices its np.memmap once per metadata string (~100k for a vocabulary), and memmap
    # slicing is slow; a plain ndarray view of the same mapping opens SmolLM2 in 0.9 s instead of 3.7 s.
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)
