"""The compiled CPU kernels (kernels/native/csrc/), loaded through ctypes: a plain C ABI, so a build takes
seconds (no torch headers to parse) and a call costs ~10 us.

`NativeKernels(head_dim, gqa, dtype, block_size)` compiles the sources specialised to the model's
head_dim and GQA group at first use, for the CPU's instruction set (kernels/native/build.py: AVX-512, AVX2 or
generic C++), and raises BuildError when that cannot work here (a dtype, head_dim or block size without a
kernel, no C++ compiler); the caller then falls back to the torch references. fp32 and bf16 run on every path
(bf16 dot products in hardware with AVX512-BF16, widened to fp32 elsewhere). With `kv_cache_dtype` int8 or int4 it also builds
paged_attention_quant.cpp and kv_quant_store.cpp, on every path too (integer dot products with VNNI where the CPU
has it, an exact emulation elsewhere: kernels/native/csrc/vec_int.h), whose caches are `PackedKV` pairs in their
layouts (kernels/native/csrc/kv_quant_layout.h).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from batchjob.kernels.interface import AttentionMetadata, KernelSet
from batchjob.kernels.native.build import ISA_NAMES, BuildError, build_all, cpu_isa
from batchjob.kernels.reference.kv_quant import group4

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class PackedKV:
    """One layer's int8/int4 K (or V) cache in paged_attention_quant.cpp's layout: `codes` uint8/int8
    [blocks, kv_heads, ...], `scales` fp16 [blocks, kv_heads, groups, block_size]. Block-major, like every
    paged tensor: swap and prefix caching move whole blocks of both."""
    codes: torch.Tensor
    scales: torch.Tensor
    bits: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales


class NativeKernels(KernelSet):
    name = "native"

    def __init__(self, head_dim: int, gqa: int, dtype: torch.dtype, block_size: int, log=None,
                 kv_cache_dtype: str = "auto"):
        if dtype not in supported_dtypes():
            raise BuildError(f"no native kernel for {str(dtype).removeprefix('torch.')} (fp32 and bf16)")
        if head_dim % 16 or head_dim > 256:
            raise BuildError(f"no native kernel for head_dim {head_dim} (multiples of 16 up to 256)")
        if block_size % 16:
            raise BuildError(f"no native kernel for block_size {block_size} (multiples of 16)")
        self.isa = cpu_isa()  # the instruction-set path built (BuildError for a forced one this CPU lacks)
        specs = [("paged_attention.cpp", {"HEAD_DIM": head_dim, "GQA": gqa}), ("fused.cpp", {})]
        if kv_cache_dtype != "auto":
            if group4(head_dim) % 16:
                raise BuildError(f"no native kernel for int4 groups of {group4(head_dim)} (multiples of 16)")
            shape = {"HEAD_DIM": head_dim, "GQA": gqa, "GROUP": group4(head_dim)}
            specs += [("paged_attention_quant.cpp", shape), ("kv_quant_store.cpp", shape)]
        lib, fused, *quant = (_load(path) for path in build_all(specs, log=log))
        self._attention = _fn(lib.bj_paged_attention, [_P, _I64, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _F, _I, _I, _P])
        self._store_kv = _fn(lib.bj_store_kv, [_P, _I64, _P, _I64, _P, _P, _P, _I, _I, _I, _I, _I])
        self._add_rms_norm = _fn(fused.bj_add_rms_norm, [_P, _I64, _P, _P, _P, _I, _I, _F, _I, _I])
        self._rotary = _fn(fused.bj_rotary, [_P, _I64, _I, _I, _I, _P, _P, _P, _I, _I])
        self._silu_mul = _fn(fused.bj_silu_mul, [_P, _P, _I, _I, _I, _I])
        self._gelu_tanh_mul = _fn(fused.bj_gelu_tanh_mul, [_P, _P, _I, _I, _I, _I])
        self._softcap = _fn(fused.bj_softcap, [_P, _P, _I64, _F, _I, _I])
        self._argmax = _fn(fused.bj_argmax_rows, [_P, _I, _I, _P, _I, _I])
        if quant:
            attention, store = quant
            self._attention_quant = _fn(attention.bj_paged_attention_quant, [_P, _I64, _P, _P, _P, _P, _P, _P, _I, _P, _P,
                                                                             _I, _I, _I, _I, _I, _F, _F, _I, _I, _I, _P])
            self._store_quant = _fn(store.bj_store_kv_quant, [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I])
            self._load_quant = _fn(store.bj_load_kv_quant, [_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P])
        self.head_dim, self.gqa, self.dtype = head_dim, gqa, dtype
        self.dtype_code = _DTYPE_CODES[dtype]

    @property
    def label(self) -> str:
        return f"native {ISA_NAMES[self.isa]}"

    def kv_cache_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        """K and V cache shapes in the kernel's layout (kernels/native/csrc/paged_attention.cpp, "Layouts"):
        a 16-key tile of one KV head is a run of 64-byte loads, with no transposing at attention time."""
        if self.dtype == torch.bfloat16:
            return (num_blocks, num_kv_heads, head_dim // 2, block_size, 2), (num_blocks, num_kv_heads, block_size // 2, head_dim, 2)
        return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)

    def quantized_kv_caches(self, bits: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                            alloc) -> tuple[PackedKV, PackedKV]:
        """A layer's int8/int4 K and V caches in paged_attention_quant.cpp's layouts; `alloc(shape, dtype)`."""
        groups = 1 if bits == 8 else head_dim // group4(head_dim)
        scales = (num_blocks, num_kv_heads, groups, block_size)
        if bits == 8:
            k = alloc((num_blocks, num_kv_heads, head_dim // 4, block_size, 4), torch.uint8)
            v = alloc((num_blocks, num_kv_heads, block_size // 2, head_dim, 2), torch.int8)
        else:
            k = alloc((num_blocks, num_kv_heads, head_dim // 8, block_size, 4), torch.uint8)
            v = alloc((num_blocks, num_kv_heads, block_size // 4, head_dim, 2), torch.uint8)
        return PackedKV(k, alloc(scales, torch.float16), bits), PackedKV(v, alloc(scales, torch.float16), bits)

    def load_kv(self, k_cache: PackedKV, v_cache: PackedKV, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized K and V of `slots` as fp32 [n, kv_heads, D] (the inverse of store_kv, for tests)."""
        slots = slots.to(torch.int64).contiguous()
        hkv = k_cache.codes.shape[1]
        k = torch.empty((len(slots), hkv, self.head_dim))
        v = torch.empty_like(k)
        _check(self._load_quant(k_cache.codes.data_ptr(), v_cache.codes.data_ptr(), k_cache.scales.data_ptr(),
                                v_cache.scales.data_ptr(), slots.data_ptr(), len(slots), hkv, k_cache.scales.shape[3],
                                k_cache.bits, k.data_ptr(), v.data_ptr()), "KV load")
        return k, v

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] (rows may be strided) into their slots of the caches."""
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        if isinstance(k_cache, PackedKV):
            _check(self._store_quant(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.codes.data_ptr(),
                                     v_cache.codes.data_ptr(), k_cache.scales.data_ptr(), v_cache.scales.data_ptr(),
                                     slot_mapping.data_ptr(), k.shape[0], k.shape[1], k_cache.scales.shape[3],
                                     k_cache.bits, self.dtype_code, torch.get_num_threads()), "quantizing KV store")
            return
        _check(self._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                              slot_mapping.data_ptr(), k.shape[0], k.shape[1], k_cache.shape[3], self.dtype_code,
                              torch.get_num_threads()), "KV store")

    # elementwise ops (kernels/native/csrc/fused.cpp); the references are TorchKernels' methods of the same name

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        _check(self._add_rms_norm(None, 0, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                  x.shape[-1], eps, self.dtype_code, torch.get_num_threads()), "RMSNorm")
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then RMSNorm of it; x [T, n] (rows may be strided), residual [T, n] dense."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty_like(residual)
        _check(self._add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                  residual.shape[0], residual.shape[-1], eps, self.dtype_code, torch.get_num_threads()),
               "add + RMSNorm")
        return out

    def prepare_rotary(self, rope, positions: torch.Tensor):
        return rope.cos, rope.sin, positions.contiguous()

    def rotary(self, q: torch.Tensor, k: torch.Tensor, prepared) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated in place (they may be views of the fused QKV output)."""
        cos, sin, positions = prepared
        threads = torch.get_num_threads()
        for x in (q, k):
            if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
                raise RuntimeError("native rotary needs [T, H, D] with dense heads")
            _check(self._rotary(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], cos.data_ptr(),
                                sin.data_ptr(), positions.data_ptr(), self.dtype_code, threads), "rotary")
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated(self._silu_mul, gate_up, "SiLU * up")

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated(self._gelu_tanh_mul, gate_up, "GELU (tanh) * up")

    def _gated(self, fn, gate_up: torch.Tensor, what: str) -> torch.Tensor:
        """act(gate) * up of a fused [..., 2n] gate/up projection, in the model's dtype."""
        gate_up = gate_up.contiguous()
        n = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype)
        _check(fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n, self.dtype_code,
                  torch.get_num_threads()), what)
        return out

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """tanh(x / cap) * cap as a new tensor of x's dtype (fp32 or bf16 logits; others: the reference)."""
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or x.device.type != "cpu" or not cap > 0:
            return super().softcap(x, cap)
        x = x.contiguous()
        out = torch.empty_like(x)
        _check(self._softcap(x.data_ptr(), out.data_ptr(), x.numel(), cap, code, torch.get_num_threads()), "soft-cap")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(-1)` of [rows, vocab] logits (fp32 or bf16), the same indices (see fused.cpp)."""
        code = _DTYPE_CODES.get(logits.dtype)
        if code is None or logits.device.type != "cpu" or logits.dim() != 2:
            return logits.argmax(dim=-1)
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.long)
        _check(self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), code,
                            torch.get_num_threads()), "argmax")
        return out

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Same contract as attention.paged_attention_torch."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attention soft-cap must be > 0, not {softcap}")
        cap = softcap or 0.0
        t, h, d = q.shape
        q = _rows_contiguous(q)
        out = torch.empty((t, h, d), dtype=q.dtype)
        bt = meta.block_tables
        ends = None if meta.key_ends is None else meta.key_ends.data_ptr()  # int32 [tokens]
        if isinstance(k_cache, PackedKV):
            _check(self._attention_quant(
                q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.codes.data_ptr(), v_cache.codes.data_ptr(),
                k_cache.scales.data_ptr(), v_cache.scales.data_ptr(), bt.data_ptr(), bt.shape[1],
                meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), meta.seq_lens.shape[0], h,
                k_cache.codes.shape[1], k_cache.scales.shape[3], window or 0, scale, cap, k_cache.bits, self.dtype_code,
                torch.get_num_threads(), ends), "paged attention over a quantized cache")
            return out
        _check(self._attention(
            q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            bt.data_ptr(), bt.shape[1], meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(),
            meta.seq_lens.shape[0], h, k_cache.shape[1], k_cache.shape[3], window or 0, scale, cap, self.dtype_code,
            torch.get_num_threads(), ends), "paged attention")
        return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] whose rows may be strided (a split of a fused projection) but each row is dense."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2] else x.contiguous()



def _load(path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}") from None


def _fn(fn, argtypes):
    fn.restype = _I
    fn.argtypes = argtypes
    return fn


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} refused its arguments (code {rc})")
