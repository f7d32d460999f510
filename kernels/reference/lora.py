"""LoRA deltas per token (issue 37): each token adds `(x A^T) B^T` of its own adapter slot (-1: none) to a projection's
output. The torch reference (`lora_shrink`, `lora_expand`: per token, fp32 sums, the shrunk rows rounded to the
compute dtype between) is the oracle of the Triton kernels (kernels/triton/lora.py); `lora_stacked` is the CPU path:
one shrink through every slot's A and one expand through every slot's B (each token's other slots zeroed between),
with the row-count-invariant matmuls of kernels/linear.py, so a row's delta does not depend on its step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.kernels.linear import Linear


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One projection's adapters: A [slots, R, in] and B [slots, out, R] (the scale folded in; zero where a slot has
    fewer ranks or targets fewer output columns), and the same stacked for the CPU path: [slots * R, in] and
    [out, slots * R] as Linear matmuls."""
    a: torch.Tensor
    b: torch.Tensor
    a_stacked: Linear
    b_stacked: Linear

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor) -> LoraWeights:
        s, r, k = a.shape
        return cls(a.contiguous(), b.contiguous(), Linear(a.reshape(s * r, k).contiguous()),
                   Linear(b.permute(1, 0, 2).reshape(b.shape[1], s * r).contiguous()))

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def memory(self) -> int:
        """Bytes held: A and B, and their stacked matmuls."""
        held = sum(t.numel() * t.element_size() for t in (self.a, self.b))
        return held + sum(sum(m.memory().values()) for m in (self.a_stacked, self.b_stacked))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, in] -> [T, R]: x A[slot]^T per token in fp32, rounded to x's dtype; zero for slot -1."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    on = slots >= 0
    if bool(on.any()):
        h[on] = torch.einsum("tk,trk->tr", x[on].float(), a[slots[on].long()].float())
    return h.to(x.dtype)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y + h B[slot]^T per token (fp32 sums, then y's dtype); y as it is for slot -1."""
    out = y.to(torch.float32, copy=True)  # never y itself (fp32's .float() is y)
    on = slots >= 0
    if bool(on.any()):
        out[on] += torch.einsum("tr,tnr->tn", h[on].float(), b[slots[on].long()].float())
    return out.to(y.dtype)


def lora_stacked(x: torch.Tensor, y: torch.Tensor, w: LoraWeights, keep: torch.Tensor) -> torch.Tensor:
    """The CPU path: `keep` [T, slots] one-hot of each token's slot (zero rows for -1)."""
    h = w.a_stacked(x).view(x.shape[0], keep.shape[1], w.rank) * keep[:, :, None]
    return y + w.b_stacked(h.view(x.shape[0], -1))
