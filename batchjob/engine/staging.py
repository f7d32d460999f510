"""Step inputs on their way to the device. On CUDA each input goes through a pinned host buffer kept
from step to step (grown by doubling, never shrunk) and is copied with non_blocking=True, so the copies
overlap and no pageable-memory round trip blocks the host. Reuse is safe because every step ends by
reading its sampled tokens back, which waits for the step's copies and kernels. On the CPU the tensors
are used as they are."""
from __future__ import annotations

import torch

MIN_CAPACITY = 256  # elements: small steps share one buffer size instead of regrowing step by step


class StagingBuffers:
    def __init__(self, device: torch.device, pin: bool | None = None) -> None:
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self.buffers: dict[str, torch.Tensor] = {}

    def to_device(self, name: str, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        flat = host.reshape(-1)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != host.dtype or buf.numel() < flat.numel():
            grown = 2 * buf.numel() if buf is not None and buf.dtype == host.dtype else 0
            buf = torch.empty(max(flat.numel(), grown, MIN_CAPACITY), dtype=host.dtype, pin_memory=self.pin)
            self.buffers[name] = buf
        staged = buf[: flat.numel()]
        staged.copy_(flat)
        return staged.view(host.shape).to(self.device, non_blocking=self.pin)
