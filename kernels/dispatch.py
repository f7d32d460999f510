"""The one place that chooses the kernels a model runs with: `--kernels auto|torch|native|triton`.

- torch: the references (kernels/reference/attention.py and friends), on any device; on the CPU with attention
  one row at a time, so that a row's result does not depend on its batch there too.
- native: the compiled CPU kernels (kernels/native/csrc/, built at first use by kernels/native/build.py).
- triton: the Triton kernels (kernels/triton/ops.py), on CUDA, or on the CPU under TRITON_INTERPRET=1.
- auto: native on CPUs where it builds (any CPU with a C++ compiler: AVX-512, AVX2 or generic C++), else torch with
  one log line saying why; on CUDA triton when
  its start-up check against the references passes on this GPU (kernels/triton/check.py), else torch
  with one log line saying why.
"""
from __future__ import annotations


import torch

from batchjob.kernels.interface import KernelSet
from batchjob.kernels.native.build import BuildError
from batchjob.notices import notice
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.modes import KernelChoice, KvCacheDtype

CHOICES = tuple(KernelChoice)


class KernelError(RuntimeError):
    """The kernels asked for cannot run here; the message names the flag and what to do."""


def select_kernels(choice: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, gqa: int,
                   block_size: int = 16, log=notice, kv_cache_dtype: str = "auto",
                   softcap: float | None = None) -> KernelSet:
    """The kernel set for a model and KV block size; raises KernelError when an explicit choice cannot run here.
    Elementwise ops the chosen backend lacks run the torch reference, said in one log line. `softcap`: the
    model's attention logit soft-cap (Gemma 2), which Triton's start-up check then covers."""
    log = _once(log)
    kernels = _select(choice, device, dtype, head_dim, gqa, block_size, log, kv_cache_dtype, softcap)
    borrowed = kernels.reference_ops()
    if borrowed:
        log(f"{kernels.name} kernels: {', '.join(borrowed)} from the torch references (no {kernels.name} kernel yet)")
    return kernels


_said: set[tuple[object, str]] = set()  # (log, notice) said in this process


def _once(log):
    """`log`, saying each notice once per process (a fallback is said for the first model, not for every model,
    draft model and job that follows)."""
    def say(message: str) -> None:
        if (log, message) not in _said:
            _said.add((log, message))
            log(message)
    return say


def _select(choice: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, gqa: int, block_size: int,
            log, kv_cache_dtype: str, softcap: float | None) -> KernelSet:
    device = torch.device(device)
    if choice not in CHOICES:
        raise KernelError(f"kernels: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == KernelChoice.TORCH:
        return TorchKernels(per_row=device.type == "cpu")
    # a quantized cache: the references, the native kernels (every path) and the Triton ones read int8 and
    # int4; Triton's int4 store needs head_dim / 2 a power of two (its ranges)
    half = head_dim // 2
    if kv_cache_dtype == KvCacheDtype.INT4 and choice == KernelChoice.TRITON and half & (half - 1):
        raise KernelError(f"kernels: 'triton' does not read a int4 KV cache with head_dim {head_dim} yet (the torch "
                          "references and native do); use --kernels auto or torch, or --kv-cache-dtype int8")
    if choice == KernelChoice.TRITON or (choice == KernelChoice.AUTO and device.type == "cuda"):
        from batchjob.kernels.triton import ops as triton_ops

        why = triton_ops.available(device)
        if why is None:
            try:
                if kv_cache_dtype == KvCacheDtype.INT4 and half & (half - 1):
                    raise ValueError(f"the Triton int4 KV store needs head_dim / 2 a power of two, not {half}")
                kern = triton_ops.TritonKernels(head_dim, gqa, dtype, block_size)
                if choice == KernelChoice.AUTO:  # on trust only after agreeing with the references on this GPU
                    from batchjob.kernels.triton.check import check

                    why = check(kern, device, softcap=softcap)
                if why is None:
                    return kern
            except Exception as e:  # noqa: BLE001 - a kernel that cannot compile here: say why, run the references
                if choice == KernelChoice.TRITON and not isinstance(e, ValueError):
                    raise
                why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if choice == KernelChoice.TRITON:
            raise KernelError(f"kernels: 'triton' cannot run here: {why}; use --kernels auto or torch")
        log(f"Triton kernels unavailable ({why}); using the torch reference kernels")
        return TorchKernels()
    if choice == KernelChoice.AUTO and device.type != "cpu":
        return TorchKernels()
    if device.type != "cpu":
        raise KernelError(f"kernels: 'native' runs on the CPU, not on {device.type}; use --kernels auto or torch")
    from batchjob.kernels.native.ops import NativeKernels

    try:
        return NativeKernels(head_dim, gqa, dtype, block_size, log=log, kv_cache_dtype=kv_cache_dtype)
    except BuildError as e:
        if choice == KernelChoice.NATIVE:
            raise KernelError(f"kernels: 'native' cannot run here: {e}; use --kernels auto or torch") from None
        log(f"native kernels unavailable ({e}); using the torch reference kernels (several times slower)")
        return TorchKernels(per_row=True)
