"""Engine behaviour on the real model code (tiny random Llama built in memory)."""
from __future__ import annotations

import random

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.core.scheduler import Lane, SchedulerConfig
from batchjob.engine.params import RefusalCode, SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.sample.row_keys import row_key
from batchjob.engine.worker.input_batch import rows_of, step_inputs
from tests.builders import make_engine, prompts

def run(engine: Engine, ps, params, seed=0, first_index=0):
    seqs = [Sequence(first_index + i, p, params[i] if isinstance(params, list) else params, rng_key=row_key(seed, first_index + i))
            for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    return seqs


def test_greedy_same_alone_batched_and_static(tiny_model):
    ps = prompts(64, seed=1)
    lengths = [random.Random(i).randint(1, 40) for i in range(64)]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    batched = run(make_engine(tiny_model, max_num_batched_tokens=512), ps, params)
    static = run(make_engine(tiny_model, static_batch=16, max_num_batched_tokens=1 << 20), ps, params)
    for i in (0, 7, 31, 63):
        alone = run(make_engine(tiny_model), [ps[i]], [params[i]], first_index=i)[0]
        assert alone.output_ids == batched[i].output_ids == static[i].output_ids
    assert [s.output_ids for s in batched] == [s.output_ids for s in static]
    assert [s.num_output for s in batched] == lengths


def test_sampled_same_alone_and_batched(tiny_model):
    ps = prompts(24, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.8)
    batched = run(make_engine(tiny_model), ps, params, seed=1234)
    for i in (0, 5, 23):
        alone = run(make_engine(tiny_model), [ps[i]], params, seed=1234, first_index=i)[0]
        assert alone.output_ids == batched[i].output_ids
    other_seed = run(make_engine(tiny_model), ps, params, seed=99)
    assert [s.output_ids for s in other_seed] != [s.output_ids for s in batched]
    greedy = run(make_engine(tiny_model), ps, SamplingParams(max_tokens=20))
    assert [s.output_ids for s in greedy] != [s.output_ids for s in batched]


def test_waiting_rows_through_the_engine_and_the_callers_config_left_alone(tiny_model):
    sched = SchedulerConfig(max_num_seqs=2, max_model_len=5000, lanes=[Lane("bulk", 0), Lane("urgent", 1)])
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=8, scheduler=sched))
    assert sched.max_model_len == 5000 and engine.max_model_len == 1024  # capped at the model's context
    for i, lane in enumerate(["bulk"] * 3 + ["urgent"] * 2):
        engine.add(Sequence(i, [1, 2, 3], SamplingParams(max_tokens=4), lane=lane, rng_key=i))
    assert engine.num_waiting() == 5 and engine.num_waiting("bulk") == 3 and engine.num_waiting("urgent") == 2
    engine.step()  # the two urgent rows take both slots
    assert engine.num_waiting() == 3 and engine.num_waiting("urgent") == 0
    dropped = engine.drop_waiting()
    assert sorted(s.seq_id for s in dropped) == [0, 1, 2] and engine.num_waiting() == 0
    while engine.has_work:
        engine.step()


def test_finished_rows_free_blocks_and_new_rows_join_same_step(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=4, max_num_batched_tokens=256)
    ps = prompts(10, seed=3, lo=5, hi=20)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=2 + 3 * (i % 4)), rng_key=i) for i, p in enumerate(ps)]
    for s in seqs:
        engine.add(s)
    compositions, refilled = [], 0
    while engine.has_work:
        before_used = engine.pool.num_used
        finished = engine.step()
        step = engine.last_step
        ids = {s.seq_id for s in step.seqs}
        compositions.append(ids)
        for s in finished:
            assert s.block_table == []  # blocks went back to the pool
        if finished and not engine.num_waiting() and not engine.scheduler.running:
            assert engine.pool.num_used == 0
        # a step that finished rows and had waiting rows admits new ones in the next schedule():
        if len(compositions) >= 2 and compositions[-2] - ids and ids - compositions[-2]:
            refilled += 1  # some rows left and others joined between consecutive steps
        assert len(step.seqs) <= 4
    assert refilled >= 2
    assert len({frozenset(c) for c in compositions}) > 3  # batch composition changes step by step
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.num_blocks


def test_slot_refilled_in_the_step_a_row_finishes(tiny_model):
    # max_num_seqs=2: when row 0 finishes at step k, row 2 must be in step k+1 together with row 1 (no idle slot)
    engine = make_engine(tiny_model, max_num_seqs=2, max_num_batched_tokens=256)
    ps = prompts(3, seed=4, lo=4, hi=6)
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=10), SamplingParams(max_tokens=3)]
    seqs = [Sequence(i, p, params[i]) for i, p in enumerate(ps)]
    for s in seqs:
        engine.add(s)
    steps = []
    while engine.has_work:
        finished = engine.step()
        steps.append(([s.seq_id for s in engine.last_step.seqs], [s.seq_id for s in finished]))
    finish_step = next(i for i, (_, fin) in enumerate(steps) if 0 in fin)
    assert sorted(steps[finish_step + 1][0]) == [1, 2]
    assert all(len(ids) == 2 for ids, _ in steps[: finish_step + 2])


def test_one_forward_mixes_prompt_and_decode_tokens(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=8, max_num_batched_tokens=64)
    ps = prompts(6, seed=5, lo=30, hi=40)
    for i, p in enumerate(ps):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=30)))
    mixed = 0
    calls = []
    real_forward = tiny_model.forward

    def spy(step):
        calls.append((step.meta.num_decodes, step.num_tokens))
        return real_forward(step)

    tiny_model.forward = spy
    try:
        while engine.has_work:
            engine.step()
            st = engine.last_stats
            if st.num_decode and st.num_prefill_tokens:
                mixed += 1
    finally:
        del tiny_model.forward
    assert mixed >= 1
    assert len(calls) == len(set(range(len(calls))))  # one forward per step
    assert any(0 < d < t - 1 for d, t in calls)  # decodes and prompt tokens in one forward


def test_chunked_prefill_and_preemption_keep_greedy_output(tiny_model):
    ps = prompts(12, seed=6, lo=20, hi=100)
    params = SamplingParams(max_tokens=24)
    ref = [s.output_ids for s in run(make_engine(tiny_model), ps, params)]
    chunked = run(make_engine(tiny_model, prefill_chunk=8, max_num_batched_tokens=40), ps, params)
    assert [s.output_ids for s in chunked] == ref
    small = make_engine(tiny_model, num_blocks=40, block_size=8)  # 320 tokens: forces preemption
    preempted = 0
    real_step = small.step

    def counting_step():
        nonlocal preempted
        out = real_step()
        preempted += len(small.last_step.preempted)
        return out

    small.step = counting_step
    tight = run(small, ps, params)
    assert preempted > 0
    assert [s.output_ids for s in tight] == ref


def test_row_that_cannot_fit_is_refused(tiny_model):
    engine = make_engine(tiny_model, num_blocks=4, block_size=8)
    kv, empty = engine.add(Sequence(0, list(range(40)), SamplingParams())), engine.add(Sequence(1, [], SamplingParams()))
    context = make_engine(tiny_model).add(Sequence(2, [1] * 1024, SamplingParams()))
    assert "KV cache" in kv.message and "empty" in empty.message and "context" in context.message
    # the kind is data, whichever limit says it (OpenAI's codes: io/openai_batch.py reads them, not the words)
    assert kv.code == context.code == RefusalCode.CONTEXT_LENGTH_EXCEEDED and empty.code == RefusalCode.INVALID_REQUEST


def _outputs(engine, ps, params):
    return [s.output_ids for s in run(engine, ps, params)]


def test_greedy_identical_across_prefill_chunk_sizes(tiny_model):
    ps = prompts(10, seed=7, lo=40, hi=150)
    params = SamplingParams(max_tokens=12)
    unlimited = _outputs(make_engine(tiny_model, max_num_batched_tokens=4096), ps, params)
    for chunk in (8, 64):
        assert _outputs(make_engine(tiny_model, prefill_chunk=chunk, max_num_batched_tokens=256), ps, params) == unlimited


def _count_preemptions(engine):
    seen = {"preempted": 0, "swapped_out": 0, "swapped_in": 0}
    real_step = engine.step

    def step():
        out = real_step()
        st = engine.last_step
        seen["preempted"] += len(st.preempted)
        seen["swapped_out"] += len(st.swap_out)
        seen["swapped_in"] += len(st.swap_in)
        return out

    engine.step = step
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_greedy_and_sampled_output(tiny_model, mode):
    ps = prompts(12, seed=8, lo=20, hi=90)
    for params in (SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8)):
        ref = _outputs(make_engine(tiny_model), ps, params)
        engine = Engine(tiny_model, [], EngineConfig(num_blocks=40, block_size=8, num_host_blocks=200 if mode == "swap" else 0,
                                                     scheduler=SchedulerConfig(preemption=mode)))
        seen = _count_preemptions(engine)
        assert _outputs(engine, ps, params) == ref
        assert seen["preempted"] > 0
        if mode == "swap":
            assert seen["swapped_out"] > 0 and seen["swapped_in"] > 0
        else:
            assert seen["swapped_out"] == 0


def test_prefix_caching_on_and_off_give_the_same_greedy_output(tiny_model):
    shared = prompts(1, seed=9, lo=100, hi=100)[0]
    ps = [shared + tail for tail in prompts(16, seed=10, lo=1, hi=20)]
    params = SamplingParams(max_tokens=10)

    def go(caching):
        engine = Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=8, enable_prefix_caching=caching,
                                                     scheduler=SchedulerConfig(max_num_seqs=4)))
        hits = queries = 0
        seqs = [Sequence(i, p, params) for i, p in enumerate(ps)]
        for s in seqs:
            engine.add(s)
        while engine.has_work:
            engine.step()
            hits += engine.last_stats.prefix_hit_tokens
            queries += engine.last_stats.prefix_query_tokens
        return [s.output_ids for s in seqs], hits / queries

    cached, hit_rate = go(True)
    uncached, no_hits = go(False)
    assert cached == uncached
    assert hit_rate > 0.5 and no_hits == 0


def test_torch_reference_attends_decodes_in_groups_of_similar_length(tiny_model):
    from batchjob.kernels.reference.attention import _TorchPlan, length_groups

    assert length_groups(15) == [(0, 15)]
    assert length_groups(64) == [(0, 16), (16, 32), (32, 48), (48, 64)]  # contiguous, covering every row once
    engine = make_engine(tiny_model)
    for i, p in enumerate(prompts(40, seed=3)):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=3), rng_key=row_key(0, i)))
    engine.step()  # the prompts
    meta = step_inputs(rows_of(engine.scheduler.schedule()), engine.runner.block_size, False).meta
    nd = meta.num_decodes  # decodes come first, one query token each
    assert nd >= 32 and meta.query_start_loc[:nd + 1].tolist() == list(range(nd + 1))
    plan = _TorchPlan(meta, engine.runner.block_size, None, torch.device("cpu"))
    widths = [slots.shape[1] for _, slots, _ in plan.decode_groups]
    assert len(widths) == 2 and widths[0] < widths[1]  # the short half is padded only to its own longest row
