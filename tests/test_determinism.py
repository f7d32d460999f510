"""A row's text may depend only on (model, parameters, seed, row): not on the rows batched with it, since
a resumed job batches rows differently. The sampler guarantees its part (a row's random draws are
a function of seed, row and position); these tests pin the model's part, one kernel at a time."""
from __future__ import annotations

import pytest
import torch

from batchjob.engine.model_runner import ModelRunner
from batchjob.engine.scheduler import Step
from batchjob.engine.sequence import SamplingParams, Sequence
from batchjob.kernels import paged_attention

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 16


def first_row_attention(dtype: torch.dtype, others: list[int]) -> torch.Tensor:
    """Prefill attention output of a 10-token row, batched with prompts of the `others` lengths."""
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only these two
    runner.block_size, runner.sliding_window = BLOCK, None
    seqs, next_block = [], 0
    for n in [10, *others]:
        seq = Sequence(len(seqs), list(range(n)), SamplingParams())
        seq.block_table = list(range(next_block, next_block + -(-n // BLOCK)))
        next_block += len(seq.block_table)
        seqs.append(seq)
    _, _, meta, _ = runner.prepare(Step(seqs=seqs, num_new=[s.num_tokens for s in seqs]))
    total = sum(s.num_tokens for s in seqs)
    q_row = torch.randn(10, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    q = torch.cat([q_row, torch.randn(total - 10, HEADS, DIM, generator=torch.Generator().manual_seed(1))]).to(dtype)
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(64, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)  # the row's block 0 is the same every time
    v_cache = torch.randn(64, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    return paged_attention(q, k_cache, v_cache, meta, DIM ** -0.5)[:10]


@pytest.mark.xfail(strict=False, reason=(
    "known, reported: the prefill attention pads every row of a step to the step's longest query and "
    "context, and torch's CPU SDPA kernel blocks its reductions by the padded sizes, so a row's output "
    "moves by an ulp with its batch-mates (bfloat16: visible in text, ~1% of sampled rows after a "
    "resume; float32: not seen to change a token). Unpadded per-row attention is batch-invariant."))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_rows_prefill_attention_does_not_depend_on_its_batch_mates(dtype):
    alone = first_row_attention(dtype, [])
    for others in ([40], [40, 300], [3, 3, 3]):
        assert torch.equal(first_row_attention(dtype, others), alone), others
