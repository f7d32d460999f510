"""async_output: the engine launches step N and hands back step N-1's finished rows, so the caller's work
overlaps the device (on by default on CUDA). Here on the CPU: the same rows, tokens, logprobs and finish
reasons as the synchronous engine, under preemption, with every kind of sampling."""
from __future__ import annotations

import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.row_keys import row_key
from batchjob.engine.scheduler import SchedulerConfig
from batchjob.engine.sequence import SamplingParams, Sequence
from tests.test_engine import prompts, tiny_model  # noqa: F401


def _run(model, async_output: bool, num_blocks: int, ps, params):
    engine = Engine(model, [7], EngineConfig(num_blocks=num_blocks, block_size=8, async_output=async_output,
                                              scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    seqs = [Sequence(i, p, params[i % len(params)], rng_key=row_key(3, i)) for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    order, steps, preempted = [], 0, 0
    while engine.has_work:
        order.extend(s.seq_id for s in engine.step())
        steps += 1
        preempted += engine.last_stats.num_preempted if engine.last_stats else 0
    assert sorted(order) == list(range(len(ps)))  # every row finished exactly once
    return seqs, steps, preempted


def test_async_output_gives_the_synchronous_engines_rows_under_preemption(tiny_model):  # noqa: F811
    params = [SamplingParams(max_tokens=30),
              SamplingParams(max_tokens=28, temperature=0.9, top_p=0.8, logprobs=2),
              SamplingParams(max_tokens=26, temperature=1.1, top_k=20, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_tokens=29, min_tokens=4, logprobs=0)]
    ps = prompts(16, seed=5, lo=20, hi=60)
    sync, sync_steps, sync_pre = _run(tiny_model, False, 30, ps, params)
    both, async_steps, async_pre = _run(tiny_model, True, 30, ps, params)
    assert sync_pre > 0 and async_pre > 0  # the pool is small enough to preempt in both
    for a, b in zip(sync, both):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.logprobs == b.logprobs
    assert async_steps == sync_steps + 1  # the last call only collects


def test_async_output_hands_finished_rows_back_one_call_later(tiny_model):  # noqa: F811
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=64, block_size=8, async_output=True))
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=1), rng_key=row_key(0, 0))
    engine.add(seq)
    assert engine.step() == [] and engine.has_work and seq.num_output == 0  # launched, not applied
    assert engine.last_stats is None and engine.last_step is None
    assert engine.step() == [seq] and not engine.has_work and seq.finish_reason == "length"
    assert engine.last_stats.num_sampled == 1 and engine.last_step.seqs == [seq]
    assert Engine(tiny_model, [], EngineConfig(num_blocks=8)).async_output is (tiny_model.device.type == "cuda")
    torch.testing.assert_close(torch.tensor(seq.num_output), torch.tensor(1))
