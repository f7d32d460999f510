"""A compressed-tensors checkpoint (the `quantization_config` llm-compressor writes): which schemes load, and its
quantized weights -> kernels/quantization.py QuantizedWeight (int8 codes and scales kept as stored: no
re-quantization; W8A8 fp8 ones too where the loader is told the device computes fp8, `fp8_codes`),
kernels/linear_quant.py Int4Weight (W4A16 `pack-quantized` codes, scales and zero points kept as stored) or the
compute dtype (fp8 elsewhere and the other weight-only schemes, dequantized at load). Any other scheme is refused in
one line that names it.

Read from the format as compressed-tensors writes it (`quant_method` "compressed-tensors", `format`
int-quantized | float-quantized | naive-quantized | pack-quantized, or mixed-precision with a `format` per group,
`config_groups` of `targets` + `weights` + `input_activations` QuantizationArgs, `ignore`). A quantized linear `X`
of the first three stores `X.weight` (int8 or float8_e4m3fn codes), `X.weight_scale` ([out, 1] per channel, [1] or
a scalar per tensor) and, with static activations, `X.input_scale`. Symmetric int8 codes span [-128, 127] there
(scale = amax / 127.5): kept as they are.

pack-quantized (compressed-tensors' PackedQuantizationCompressor, pack_to_int32): `X.weight_packed` int32
[out, ceil(in * bits / 32)], the signed codes q in [-2**(bits-1), 2**(bits-1)) stored as u = q + 2**(bits-1), input
column j in bits [bits * (j % (32 / bits)), +bits) of word j / (32 / bits) (for 4 bits: 8 per word, the first in the
low nibble); `X.weight_shape` [out, in]; `X.weight_scale` [out, in / group_size] (strategy group) or [out, 1]
(channel), in the model's dtype; asymmetric: `X.weight_zero_point`, signed z in the codes' range packed the same
way but along the output dim (int32 [ceil(out * bits / 32), groups]). The value is scale * (q - z), which
compressed-tensors computes in the scale's dtype; Int4Weight keeps u, the scales in fp32 and, asymmetric,
mins = -scale * (z + 8), so its fp32 value scale * u + mins is exact where the scale is bf16 or fp16.
"""
from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass

import torch

from batchjob.kernels.linear_quant import Int4Weight
from batchjob.kernels.quantization import QuantizedWeight
from batchjob.models.weights import ModelLoadError

log = logging.getLogger(__name__)

PACKED = "pack-quantized"  # sub-byte int codes packed into int32 words (W4A16, W8A16)
FORMATS = ("int-quantized", "float-quantized", "naive-quantized", PACKED)
MIXED = "mixed-precision"  # the top-level format of a config whose groups name their own
CODE_DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}
SUPPORTED = ("supported: W8A8 int8 (symmetric 8-bit int weights per channel or per tensor, activations per token "
             "or per tensor), int8 weight-only, fp8 e4m3 weights per channel or per tensor, W4A16 pack-quantized "
             "(4-bit int weights in groups or per channel, symmetric or with zero points), W8A16 pack-quantized")
_SIDECARS = ("weight_scale", "input_scale", "weight_zero_point", "input_zero_point", "weight_g_idx", "weight_packed",
             "weight_shape")


@dataclass(frozen=True, slots=True)
class _Group:
    targets: tuple[str, ...]
    weight_type: str  # int | float
    activations: str  # "dynamic per-token" | "static per-tensor" | ... | "none" (weight-only)
    fmt: str = "int-quantized"
    bits: int = 8
    group_size: int = 0  # pack-quantized: weights per scale along the input dim (0: one per output channel)
    symmetric: bool = True

    @property
    def runs_int8(self) -> bool:
        """W8A8 int8: Int8Linear on the codes. Weight-only ones are dequantized at load."""
        return self.weight_type == "int" and self.activations != "none"

    @property
    def runs_fp8(self) -> bool:
        """W8A8 fp8: Fp8Linear on the codes where the device computes fp8, else dequantized at load. fp8
        weight-only (W8A16) is dequantized at load everywhere (no weight-only kernel is written)."""
        return self.weight_type == "float" and self.activations != "none"

    @property
    def runs_int4(self) -> bool:
        """W4A16: Int4Weight on the stored codes (kernels/quantization.py int4_linear)."""
        return self.fmt == PACKED and self.bits == 4

    @property
    def words(self) -> str:
        if self.fmt != PACKED:
            return f"{'int8' if self.weight_type == 'int' else 'fp8'} weights, {self.activations} activations"
        per = f"in groups of {self.group_size}" if self.group_size else "per channel"
        zero = "" if self.symmetric else " with zero points"
        return f"int{self.bits} weights {per}{zero}, weight-only (W{self.bits}A16)"


@dataclass(frozen=True, slots=True)
class CompressedTensors:
    """A folder's compressed-tensors scheme, checked before any weight is read."""
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]
    source: str
    fp8_codes: bool = False  # the device computes fp8 (kernels/quantization.py keeps_fp8_codes): W8A8 fp8 kept

    @property
    def quantization(self) -> str:
        """LoadedModel.quantization: "int8" where some group runs W8A8 int8 (fp8 and int4 groups beside it are
        dequantized), else "int4" where some group is W4A16, else "fp8" where some group runs W8A8 fp8 and
        `fp8_codes`, else "dequantized"."""
        if any(g.runs_int8 for g in self.groups):
            return "int8"
        if any(g.runs_int4 for g in self.groups):
            return "int4"
        return "fp8" if self.fp8_codes and any(g.runs_fp8 for g in self.groups) else "dequantized"

    @property
    def scheme(self) -> str:
        return "compressed-tensors " + "; ".join(dict.fromkeys(g.words for g in self.groups))

    def keeps(self, t: torch.Tensor, name: str) -> bool:
        """Whether the loader keeps this tensor as stored (codes and their scales) instead of casting it."""
        return t.dtype in (torch.int8, torch.int32, torch.float8_e4m3fn) or name.rsplit(".", 1)[-1] in _SIDECARS

    def weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The folder's tensors (codes and scales as stored, the rest in `dtype`) -> HF-named weights: W8A8
        linears of the kind the model runs (`quantization`) as QuantizedWeight, W4A16 ones as Int4Weight where it
        runs int4, the others dequantized to `dtype`."""
        out, dequantized, static = {}, {}, 0
        runs = self.quantization
        for name in [n for n in weights if n.endswith(".weight_scale")]:
            module = name.removesuffix(".weight_scale")
            group = self._group_of(module)
            if group.fmt == PACKED:
                w = _unpacked(weights, module, weights.pop(name), group, self.source)
                if isinstance(w, Int4Weight) and runs == "int4":
                    out[module + ".weight"] = w
                else:
                    out[module + ".weight"] = w.dequantized(dtype) if isinstance(w, Int4Weight) else w.to(dtype)
                    dequantized.update([_why_dequantized(group, runs)])
                continue
            codes = weights.pop(module + ".weight")
            scale = weights.pop(name).float()
            codes = _codes(codes, group.weight_type, module, self.source)
            if scale.numel() == 1:
                scale = scale.reshape(1).expand(codes.shape[0]).contiguous()  # a tensor scale, broadcast to channels
            elif scale.numel() == codes.shape[0]:
                scale = scale.reshape(-1)
            else:
                raise ModelLoadError(f"{self.source}: {name} has shape {tuple(scale.shape)}; a per-channel or "
                                     f"per-tensor scale of {module}.weight {tuple(codes.shape)} has {codes.shape[0]} or 1")
            input_scale = weights.pop(module + ".input_scale", None)
            qw = QuantizedWeight(codes, scale, self.scheme)
            if (group.runs_int8 and runs == "int8") or (group.runs_fp8 and runs == "fp8"):
                out[module + ".weight"] = qw
                static += input_scale is not None
            else:  # its input scale, if any, has nothing to scale: the matmul runs in the compute dtype
                out[module + ".weight"] = qw.dequantized(dtype)
                dequantized.update([_why_dequantized(group, runs)])
        stray = [n for n in weights if n.rsplit(".", 1)[-1] in _SIDECARS]
        if stray:
            raise ModelLoadError(f"{self.source}: {stray[0]} belongs to no quantized weight (no weight_scale beside it)")
        if static:
            log.warning("%s: %d static per-tensor activation scales (input_scale) are not used: activations are "
                        "quantized per token at run time (dynamic), as --quantization %s does", self.source, static, runs)
        if dequantized:
            log.warning("%s: %s weights are dequantized to %s at load (%s): those matmuls run in the compute dtype",
                        self.source, " and ".join(sorted(dequantized)), str(dtype).removeprefix("torch."),
                        "; ".join(dict.fromkeys(dequantized[k] for k in sorted(dequantized))))
        return weights | out

    def _group_of(self, module: str) -> _Group:
        if any(_matches(t, module) for t in self.ignore):
            raise ModelLoadError(f"{self.source}: {module} is in the quantization_config's ignore list but has a "
                                 "weight_scale")
        for g in self.groups:
            if any(_matches(t, module) for t in g.targets):
                return g
        raise ModelLoadError(f"{self.source}: {module} has a weight_scale but no config group targets it")


def _why_dequantized(group: _Group, runs: str) -> tuple[str, str]:
    """(the weights' kind, why they are dequantized at load), for the load's one log line."""
    if group.runs_int4:
        return "int4", "the checkpoint runs int8, and its int4 groups in the compute dtype"
    if group.fmt == PACKED:
        return f"int{group.bits} weight-only (pack-quantized)", f"no int{group.bits} weight-only compute is written"
    if group.activations == "none":
        return f"{'int8' if group.weight_type == 'int' else 'fp8'} weight-only", "no weight-only compute is written"
    if runs == "int8":
        return "fp8", "the checkpoint runs int8, and its fp8 groups in the compute dtype"
    return "fp8", ("fp8 compute runs on a CUDA GPU with compute capability >= 8.9 only, and not under "
                   "--quantization none")


def compressed_tensors(config: dict, source: str, fp8_codes: bool = False) -> CompressedTensors | None:
    """The scheme of a config.json's `quantization_config` (None: a float checkpoint); raises ModelLoadError, one
    line naming the scheme, for what this engine does not run. `fp8_codes`: W8A8 fp8 weights keep their codes
    (the device computes fp8, kernels/quantization.py keeps_fp8_codes), else they are dequantized at load."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(f"{source}: quantization_config quant_method {method!r} is not supported; supported: "
                             f"'compressed-tensors' ({SUPPORTED.removeprefix('supported: ')})")
    fmt = qc.get("format")
    if fmt not in FORMATS and fmt != MIXED:
        raise ModelLoadError(f"{source}: compressed-tensors format {fmt!r} is not supported (formats: "
                             f"{', '.join(FORMATS)}); {SUPPORTED}")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(f"{source}: compressed-tensors sparsity format {sparsity['format']!r} is not supported; "
                             f"{SUPPORTED}")
    if qc.get("kv_cache_scheme"):
        raise ModelLoadError(f"{source}: compressed-tensors kv_cache_scheme (static KV cache scales) is not supported; "
                             "use --kv-cache-dtype int8 on a checkpoint without it")
    groups = tuple(_group(name, g, g.get("format") or fmt, source)  # a group's own format wins (mixed-precision)
                   for name, g in (qc.get("config_groups") or {}).items())
    if not groups:
        raise ModelLoadError(f"{source}: compressed-tensors quantization_config has no config_groups")
    return CompressedTensors(groups, tuple(qc.get("ignore") or ()), source, fp8_codes)


def _group(name: str, g: dict, fmt: str, source: str) -> _Group:
    w, a = g.get("weights"), g.get("input_activations")
    if fmt not in FORMATS:
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: format {fmt!r} is not supported (formats: "
                             f"{', '.join(FORMATS)}); {SUPPORTED}")
    if g.get("output_activations"):
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: output activation quantization is not "
                             f"supported; {SUPPORTED}")
    if not w:
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: activation-only quantization is not "
                             f"supported; {SUPPORTED}")
    if fmt == PACKED:
        return _packed_group(name, w, a, g, source)
    wtype = w.get("type", "int")
    ok = (w.get("num_bits") == 8 and wtype in CODE_DTYPES and w.get("symmetric", True)
          and w.get("strategy", "tensor") in ("channel", "tensor") and not w.get("dynamic")
          and w.get("group_size") is None and not w.get("block_structure") and not w.get("actorder"))
    if not ok:
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: weights {_args(w)} are not supported; {SUPPORTED}")
    if a is None:
        acts = "none"
    else:
        ok = (a.get("num_bits") == 8 and a.get("type", "int") == wtype and a.get("symmetric", True)
              and a.get("strategy") in ("token", "tensor") and a.get("group_size") is None)
        if not ok:
            raise ModelLoadError(f"{source}: compressed-tensors group {name}: activations {_args(a)} (weights "
                                 f"{_args(w)}) are not supported; {SUPPORTED}")
        acts = f"{'dynamic' if a.get('dynamic') else 'static'} per-{a['strategy']}"
    return _Group(tuple(g.get("targets") or ()), wtype, acts, fmt)


def _packed_group(name: str, w: dict, a: dict | None, g: dict, source: str) -> _Group:
    """pack-quantized: 4- or 8-bit int weights in groups (group_size) or per channel, symmetric or with zero points,
    weight-only. Activation order (`actorder`) is checked per layer: its g_idx must be the identity."""
    strategy, size = w.get("strategy"), w.get("group_size")
    if strategy is None:  # QuantizationArgs infers it: a positive group_size is group, -1 channel
        strategy = "channel" if size == -1 else "group" if size else "tensor"
    ok = (w.get("num_bits") in (4, 8) and w.get("type", "int") == "int" and not w.get("dynamic")
          and not w.get("block_structure")
          and ((strategy == "group" and isinstance(size, int) and size > 0) or strategy == "channel"))
    if not ok:
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: weights {_args(w)} (pack-quantized) are not "
                             f"supported; {SUPPORTED}")
    if a is not None:
        raise ModelLoadError(f"{source}: compressed-tensors group {name}: activations {_args(a)} with pack-quantized "
                             f"weights {_args(w)} are not supported (weight-only only); {SUPPORTED}")
    return _Group(tuple(g.get("targets") or ()), "int", "none", PACKED, w["num_bits"],
                  size if strategy == "group" else 0, bool(w.get("symmetric", True)))


def _unpacked(weights: dict[str, torch.Tensor], module: str, scale: torch.Tensor, group: _Group,
              source: str) -> Int4Weight | torch.Tensor:
    """A pack-quantized linear's tensors, taken out of `weights` -> an Int4Weight (4 bits: codes, scales and zero
    points as stored) or its fp32 values (8 bits: dequantized at load, as compressed-tensors' decompress computes
    them, in fp32)."""
    bits = group.bits
    packed = weights.pop(module + ".weight_packed", None)
    shape = weights.pop(module + ".weight_shape", None)
    if packed is None or shape is None:
        missing = "weight_packed" if packed is None else "weight_shape"
        raise ModelLoadError(f"{source}: {module} has a weight_scale but no {missing} (its config group is "
                             f"{PACKED})")
    n, k = (int(v) for v in shape.reshape(-1).tolist())
    words = -(-k * bits // 32)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, words):
        raise ModelLoadError(f"{source}: {module}.weight_packed is {str(packed.dtype).removeprefix('torch.')} "
                             f"{tuple(packed.shape)}; {PACKED} int{bits} weights of shape ({n}, {k}) are int32 "
                             f"({n}, {words})")
    size = group.group_size or k
    if k % size:
        raise ModelLoadError(f"{source}: {module}: {k} inputs are not a multiple of the group size {size}")
    groups = k // size
    if scale.numel() != n * groups:
        per = f"in groups of {size}" if group.group_size else "per channel"
        raise ModelLoadError(f"{source}: {module}.weight_scale has shape {tuple(scale.shape)}; a weight ({n}, {k}) "
                             f"{per} has ({n}, {groups})")
    scales = scale.float().reshape(n, groups)
    g_idx = weights.pop(module + ".weight_g_idx", None)
    if g_idx is not None and not torch.equal(g_idx.reshape(-1).long(), torch.arange(k) // size):
        raise ModelLoadError(f"{source}: {module}.weight_g_idx puts input columns in groups out of order (activation "
                             f"order, actorder 'group'); not supported: the int{bits} kernels take each group as "
                             f"{size} adjacent inputs (re-export with actorder 'weight' or none)")
    u = _unpack(packed, bits, k)  # q + 2**(bits-1)
    zu = None  # z + 2**(bits-1), [n, groups]
    if not group.symmetric:
        zp = weights.pop(module + ".weight_zero_point", None)
        if zp is not None and zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n * bits // 32), groups):
            zu = _unpack(zp.t().contiguous(), bits, n).t().int()
        elif zp is not None and zp.dtype == torch.int8 and zp.numel() == n * groups:  # written unpacked
            zu = zp.reshape(n, groups).int() + (1 << (bits - 1))
        else:
            got = "none" if zp is None else f"{str(zp.dtype).removeprefix('torch.')} {tuple(zp.shape)}"
            raise ModelLoadError(f"{source}: {module}.weight_zero_point is {got}; an asymmetric {PACKED} int{bits} "
                                 f"weight ({n}, {k}) has int32 ({-(-n * bits // 32)}, {groups}) (packed along the "
                                 "outputs)")
    if bits == 4:
        return Int4Weight(u.contiguous(), scales, size, None if zu is None else -(scales * zu))
    d = scales.repeat_interleave(size, dim=1)
    offset = (1 << (bits - 1)) if zu is None else zu.repeat_interleave(size, dim=1)
    return (u.int() - offset).float() * d


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [rows, w] -> their unsigned fields [rows, count] (uint8): field j in bits [bits * (j % per),
    +bits) of word j / per (per = 32 / bits), as compressed-tensors' pack_to_int32 puts them."""
    rows = packed.shape[0]
    if sys.byteorder == "little" and bits in (4, 8):  # whole bytes, least significant first: split them, no int32 copy
        b = packed.contiguous().view(torch.uint8)
        fields = b if bits == 8 else torch.stack((b & 0xF, b >> 4), dim=-1)
        return fields.reshape(rows, -1)[:, :count]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(rows, -1)[:, :count].to(torch.uint8)


def _args(q: dict) -> str:
    """QuantizationArgs in words: "int4 group (group_size 128) asymmetric"."""
    words = [f"{q.get('type', 'int')}{q.get('num_bits')}", str(q.get("strategy"))]
    if q.get("group_size"):
        words.append(f"(group_size {q['group_size']})")
    if q.get("block_structure"):
        words.append(f"(block {q['block_structure']})")
    if not q.get("symmetric", True):
        words.append("asymmetric")
    if q.get("dynamic") and q.get("dynamic") is not True:
        words.append(f"dynamic={q['dynamic']}")
    return " ".join(words)


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rule: "re:<pattern>" matches the module's name; a class name ("Linear") every
    linear (all quantized tensors here are linear weights); a plain name the module or its last components."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


def _codes(codes: torch.Tensor, wtype: str, module: str, source: str) -> torch.Tensor:
    want = CODE_DTYPES[wtype]
    if codes.dtype == want:
        return codes
    # naive-quantized may store integer codes in a float dtype
    if (wtype == "int" and codes.is_floating_point() and torch.equal(codes, codes.round())
            and -128 <= codes.min() and codes.max() <= 127):
        return codes.to(torch.int8)
    raise ModelLoadError(f"{source}: {module}.weight is {str(codes.dtype).removeprefix('torch.')}; its config group "
                         f"stores {str(want).removeprefix('torch.')} codes")
