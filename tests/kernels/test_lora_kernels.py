"""The CPU path of LoRA deltas (kernels/reference/lora.py lora_stacked: one stacked shrink and expand over every slot,
each token's other slots zeroed) against the per-token reference, and its row-count invariance: a token's delta is
bitwise the same alone as in any batch (bf16 and fp32). The Triton kernels' case: tests/kernels/triton_cases.py."""
from __future__ import annotations

import pytest
import torch

from batchjob.kernels.reference.lora import LoraWeights, lora_expand, lora_shrink, lora_stacked


def case(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 64, generator=g).to(dtype)
    w = LoraWeights.of((torch.randn(4, 16, 64, generator=g) * 0.2).to(dtype), (torch.randn(4, 96, 16, generator=g) * 0.2).to(dtype))
    y = torch.randn(11, 96, generator=g).to(dtype)
    slots = torch.tensor([0, -1, 3, 1, 1, -1, 0, 2, 2, 3, 0], dtype=torch.int32)
    keep = (torch.nn.functional.one_hot(slots.long().clamp(min=0), 4) * (slots >= 0)[:, None]).to(dtype)
    return x, w, y, slots, keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_the_stacked_cpu_path_equals_the_reference_and_is_row_count_invariant(dtype):
    x, w, y, slots, keep = case(dtype)
    got = lora_stacked(x, y, w, keep)
    want = lora_expand(y, lora_shrink(x, w.a, slots), w.b, slots)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert (got.float() - want.float()).abs().max().item() < tol
    assert torch.equal(got[slots == -1], y[slots == -1])  # no adapter: the base output as it was
    for i in range(len(x)):  # each token alone: bitwise its batched result
        assert torch.equal(lora_stacked(x[i:i + 1], y[i:i + 1], w, keep[i:i + 1]), got[i:i + 1])
