"""Step inputs on their way to the device. On CUDA each input goes through a pinned host buffer kept
from step to step (grown by doubling, never shrunk) and is copied with non_blocking=True, so the copies
overlap and no pageable-memory copy (which would wait for the stream, that is for the step in flight)
blocks the host. Steps alternate between two sets of buffers (`next_step`): with one step in flight
(async scheduling), a set is written again only after the step that last read it has been collected,
which waited for its copies and kernels. On the CPU the tensors are used as they are."""
from __future__ import annotations

import torch

MIN_CAPACITY = 256  # elements: small steps share one buffer size instead of regrowing step by step


class StagingBuffers:
    def __init__(self, device: torch.device, pin: bool | None = None) -> None:
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.generation = 0

    def next_step(self) -> None:
        self.generation ^= 1

    def to_device(self, name: str, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host
        flat = host.reshape(-1)
        name = (self.generation, name)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != host.dtype or buf.numel() < flat.numel():
            grown = 2 * buf.numel() if buf is not None and buf.dtype == host.dtype else 0
            buf = torch.empty(max(flat.numel(), grown, MIN_CAPACITY), dtype=host.dtype, pin_memory=self.pin)
            self.buffers[name] = buf
        staged = buf[: flat.numel()]
        staged.copy_(flat)
        return staged.view(host.shape).to(self.device, non_blocking=self.pin)
