"""async_scheduling (on by default on CUDA): the engine schedules and launches step N+1 while step N runs,
with placeholders for the tokens N is still sampling, then collects N. Here on the CPU: the same rows,
tokens and finish reasons as the synchronous engine, under preemption, with every kind of sampling."""
from __future__ import annotations

import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sample.row_keys import row_key
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from tests.builders import prompts


def _run(model, async_scheduling: bool, num_blocks: int, ps, params):
    engine = Engine(model, [7], EngineConfig(num_blocks=num_blocks, block_size=8, async_scheduling=async_scheduling,
                                              scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    seqs = [Sequence(i, p, params[i % len(params)], rng_key=row_key(3, i)) for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    order, steps, preempted, overlapped = [], 0, 0, 0
    while engine.has_work:
        order.extend(s.seq_id for s in engine.step())
        steps += 1
        preempted += engine.last_stats.num_preempted if engine.last_stats else 0
        overlapped += engine.last_stats is not None and engine._pending is not None  # collected one, launched the next
    assert sorted(order) == list(range(len(ps)))  # every row finished exactly once
    assert (overlapped > steps // 2) if async_scheduling else overlapped == 0
    assert all(s.num_placeholders == 0 for s in seqs)
    return seqs, steps, preempted


def test_async_scheduling_gives_the_synchronous_engines_rows_under_preemption(tiny_model):  # noqa: F811
    params = [SamplingParams(max_tokens=30),
              SamplingParams(max_tokens=28, temperature=0.9, top_p=0.8, logprobs=2),
              SamplingParams(max_tokens=26, temperature=1.1, top_k=20, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_tokens=29, min_tokens=4, logprobs=0)]
    ps = prompts(16, seed=5, lo=20, hi=60)
    sync, sync_steps, sync_pre = _run(tiny_model, False, 30, ps, params)
    both, async_steps, async_pre = _run(tiny_model, True, 30, ps, params)
    assert sync_pre > 0 and async_pre > 0  # the pool is small enough to preempt in both
    for a, b in zip(sync, both):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        # the batches differ (async scheduling admits a step later and wastes a token per finished row):
        # the torch reference kernels' sums move by an ulp with the batch; the tokens do not
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x[0] == y[0] and abs(x[1] - y[1]) < 1e-4 and [t for t, _ in x[2]] == [t for t, _ in y[2]]
    assert async_steps >= sync_steps  # the last call only collects


def test_async_scheduling_hands_finished_rows_back_one_call_later(tiny_model):  # noqa: F811
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=64, block_size=8, async_scheduling=True))
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=1), rng_key=row_key(0, 0))
    engine.add(seq)
    assert engine.step() == [] and engine.has_work and seq.num_placeholders == 1  # launched, not back
    assert engine.last_stats is None and engine.last_step is None
    assert engine.step() == [seq] and not engine.has_work and seq.finish_reason == "length"
    assert engine.last_stats.num_sampled == 1 and engine.last_step.seqs == [seq]
    assert Engine(tiny_model, [], EngineConfig(num_blocks=8)).async_scheduling is (tiny_model.device.type == "cuda")
    torch.testing.assert_close(torch.tensor(seq.num_output), torch.tensor(1))


def test_a_job_with_async_scheduling_gives_the_synchronous_jobs_rows_across_a_resume(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from batchjob.cli.main import main
    from batchjob.io.parts import read_results
    from tests.builders import write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} " + "word " * (i % 7)} for i in range(40)])
    model = tiny_model_dir("llama", max_positions=1024)

    def run(out, *flags):
        result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(out),
                                           "--max-tokens", "12", "--temperature", "0.8", "--dtype", "float32",
                                           "--max-num-seqs", "8", "--part-rows", "5", "--no-progress", *flags])
        assert result.exit_code == 0, result.output

    run(tmp_path / "sync", "--async-scheduling", "off")
    run(tmp_path / "async", "--async-scheduling", "on", "--limit", "13")
    run(tmp_path / "async", "--async-scheduling", "on")  # the rest, after a stop
    cols = ["row_index", "generated_text", "finish_reason", "completion_tokens"]
    a, b = (read_results(tmp_path / name).sort_by("row_index").select(cols).to_pylist() for name in ("sync", "async"))
    assert len(a) == 40 and a == b
