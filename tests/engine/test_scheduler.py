"""Pure scheduler behaviour: no model, a small block pool, a fake clock."""
from __future__ import annotations

import itertools

from batchjob.engine.core.block_pool import BlockPool
from batchjob.engine.core.scheduler import Lane, Scheduler, SchedulerConfig
from batchjob.engine.params import RefusalCode, SamplingParams
from batchjob.engine.core.sequence import Sequence, SeqStatus


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


_ids = itertools.count()


def row(prompt_len: int, max_tokens: int = 4, lane: str = "default") -> Sequence:
    return Sequence(next(_ids), [7] * prompt_len, SamplingParams(max_tokens=max_tokens), lane=lane)


def make(num_blocks=64, block_size=4, clock=None, host_blocks=0, caching=False, **cfg) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, enable_caching=caching)
    host = BlockPool(host_blocks, block_size) if host_blocks else None
    return Scheduler(SchedulerConfig(**cfg), pool, host, clock=clock or Clock())


def run_step(s: Scheduler, token: int = 1):
    """One iteration as the engine does it, with a fake model that always emits `token`."""
    step = s.schedule()
    s.advance(step)
    s.publish(step)
    done = []
    for seq in step.seqs:
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(token)
            if seq.num_output >= seq.params.max_tokens:
                s.finish(seq, "length")
                done.append(seq)
    return step, done


def test_decode_tokens_come_first_and_prompts_get_the_rest():
    s = make(max_num_batched_tokens=10)
    running = [row(3, max_tokens=50) for _ in range(4)]
    for r in running:
        s.add(r)
    run_step(s)  # 4 prompts of 3 tokens = 12 > 10: three admitted whole, the 4th chunked
    run_step(s)
    long = row(40)
    s.add(long)
    step, _ = run_step(s)
    new = dict(zip((q.seq_id for q in step.seqs), step.num_new))
    assert all(new[r.seq_id] == 1 for r in running)  # every running row decoded
    assert new[long.seq_id] == 10 - 4  # the prompt got what was left


def test_chunked_prefill_spans_steps_and_interleaves_with_decodes():
    s = make(max_num_batched_tokens=16, num_blocks=128)
    short = row(2, max_tokens=20)
    s.add(short)
    run_step(s)
    long = row(50)
    s.add(long)
    chunks = []
    while long.num_computed < long.num_prompt:
        step, _ = run_step(s)
        new = dict(zip((q.seq_id for q in step.seqs), step.num_new))
        assert new[short.seq_id] == 1  # the running row never stalls behind the long prompt
        chunks.append(new[long.seq_id])
    assert chunks == [15, 15, 15, 5]
    s2 = make(max_num_batched_tokens=64, prefill_chunk=8, num_blocks=128)
    r = row(30)
    s2.add(r)
    sizes = [run_step(s2)[0].num_new[0] for _ in range(4)]
    assert sizes == [8, 8, 8, 6]


def test_strict_priority_admits_higher_lane_first():
    lanes = [Lane("bulk", 0), Lane("interactive", 10)]
    s = make(max_num_seqs=2, lanes=lanes)
    for _ in range(4):
        s.add(row(4, lane="bulk"))
    for _ in range(4):
        s.add(row(4, lane="interactive"))
    admitted = []
    while s.has_work:
        step, _ = run_step(s)
        admitted += [q.lane for q in step.seqs if q.num_computed == q.num_prompt and q.num_output == 1]
    assert admitted[:4] == ["interactive"] * 4 and admitted[4:] == ["bulk"] * 4


def test_weighted_fair_share_within_a_priority():
    lanes = [Lane("a", 0, weight=3), Lane("b", 0, weight=1)]
    clock = Clock()
    s = make(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=256, lanes=lanes, clock=clock, max_wait=1e9)
    tokens = {"a": 0, "b": 0}
    for i in range(2000):
        for lane in ("a", "b"):
            while len(s.waiting[lane]) < 8:  # both lanes always have work
                s.add(row(8, max_tokens=8, lane=lane))
        step, _ = run_step(s)
        for q, n in zip(step.seqs, step.num_new):
            tokens[q.lane] += n
        clock.t += 0.01
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert abs(share - 0.75) <= 0.05, share


def test_aging_bounds_the_wait_of_a_low_lane():
    lanes = [Lane("low", 0), Lane("high", 10)]
    clock = Clock()
    s = make(max_num_seqs=2, lanes=lanes, clock=clock, max_wait=5.0, num_blocks=256)
    low = row(4, lane="low")
    s.add(low)
    waits = []
    for i in range(400):
        while len(s.waiting["high"]) < 4:  # a constant stream of higher-priority rows
            s.add(row(4, max_tokens=3, lane="high"))
        run_step(s)
        clock.t += 0.25
        if low.first_scheduled_at is not None:
            waits.append(low.first_scheduled_at - low.enqueued_at)
            break
    # max_wait, plus at most the time for a running row to finish and free its slot (4 steps here)
    assert waits and waits[0] <= 5.0 + 4 * 0.25
    # without aging (a huge max_wait), the same load starves the low row for the whole run
    clock2 = Clock()
    s2 = make(max_num_seqs=2, lanes=lanes, clock=clock2, max_wait=1e9, num_blocks=256)
    low2 = row(4, lane="low")
    s2.add(low2)
    for i in range(400):
        while len(s2.waiting["high"]) < 4:
            s2.add(row(4, max_tokens=3, lane="high"))
        run_step(s2)
        clock2.t += 0.25
    assert low2.first_scheduled_at is None


def test_waiting_high_priority_row_preempts_running_low_row():
    lanes = [Lane("low", 0), Lane("high", 10)]
    s = make(num_blocks=8, block_size=4, lanes=lanes, watermark_blocks=0)
    lows = [row(6, max_tokens=100, lane="low") for _ in range(4)]  # 2 blocks each: the pool is full
    for r in lows:
        s.add(r)
    run_step(s)
    assert all(r.status is SeqStatus.RUNNING for r in lows)
    high = row(6, lane="high")
    s.add(high)
    step, _ = run_step(s)
    assert high.status is SeqStatus.RUNNING and high in step.seqs
    assert step.preempted and all(p.lane == "low" for p in step.preempted)
    assert step.preempted[0] is lows[-1]  # the youngest of the lowest priority goes first
    assert lows[-1].status is SeqStatus.WAITING and lows[-1].num_computed == 0  # recompute mode


def test_preempting_a_row_scheduled_in_the_same_step_refunds_its_tokens():
    lanes = [Lane("low", 0), Lane("high", 10)]
    s = make(num_blocks=6, block_size=4, lanes=lanes, max_num_batched_tokens=10)
    low = row(16, max_tokens=50, lane="low")
    s.add(low)
    run_step(s)  # the first 10 prompt tokens: 3 blocks
    high = row(8, lane="high")
    s.add(high)
    step = s.schedule()
    # the running loop gave low its last 6 prompt tokens (a 4th block, 2 left); high needs 3 + the
    # watermark, so admission preempts low, and low's 6 tokens go back to the budget: high gets 8, not 4
    assert step.preempted == [low] and step.seqs == [high]
    assert step.num_new == [8] and step.num_tokens == 8


def test_preempting_an_image_row_scheduled_in_the_same_step_refunds_its_encoder_rows():
    """The refund above covers the encoder budget too: the low row's chunk that would encode its image leaves the
    step, so the high row admitted in its place encodes its own image in this step instead of stopping before it."""
    from batchjob.engine.params import ImageSlot

    lanes = [Lane("low", 0), Lane("high", 10)]
    s = make(num_blocks=8, block_size=4, lanes=lanes, max_num_batched_tokens=16, max_num_encoder_tokens=8)
    low = row(26, max_tokens=50, lane="low")
    low.images = (ImageSlot(16, 8, "low", None),)
    s.add(low)
    run_step(s)  # its text before the image: 16 tokens, 4 blocks
    high = row(12, lane="high")
    high.images = (ImageSlot(2, 8, "high", None),)
    s.add(high)
    step = s.schedule()
    # the running loop gave low its last 10 tokens, its image among them (7 blocks, 1 left, the whole encoder
    # budget); high needs 3 blocks and more, so admission preempts low, and low's tokens and encoder rows go back
    assert step.preempted == [low] and step.seqs == [high]
    assert step.num_new == [12] and step.encoder_tokens == 8 and step.encoder_budget == 0


def test_scheduler_and_engine_leave_the_callers_config_alone():
    cfg = SchedulerConfig(max_model_len=1000)
    s = Scheduler(cfg, BlockPool(8, 4), context_len=512)
    assert cfg.max_model_len == 1000 and s.max_model_len == (8 - cfg.watermark_blocks) * 4
    assert Scheduler(cfg, BlockPool(1024, 4), context_len=512).max_model_len == 512
    assert Scheduler(cfg, BlockPool(1024, 4)).max_model_len == 1000


def test_memory_pressure_preempts_youngest_and_swap_moves_blocks():
    s = make(num_blocks=6, block_size=4, watermark_blocks=0, preemption="swap", host_blocks=16)
    a, b = row(7, max_tokens=12), row(7, max_tokens=12)  # 19 tokens = 5 blocks each; 6 in the pool
    s.add(a)
    s.add(b)
    run_step(s)  # 2 blocks each, 2 free
    swapped = None
    for _ in range(20):
        step, _ = run_step(s)
        if step.swap_out:
            swapped = step
            break
    assert swapped is not None and swapped.preempted == [b]
    assert b.status is SeqStatus.SWAPPED and len(swapped.swap_out) == len(b.block_table)
    computed = b.num_computed
    while s.has_work:
        step, _ = run_step(s)
        if step.swap_in:
            assert b.status is SeqStatus.RUNNING and b.num_computed >= computed  # nothing recomputed
    assert a.num_output == 12 and b.num_output == 12


def test_admission_reserve_never_preempts_optimistic_does():
    def run(policy):
        s = make(num_blocks=20, block_size=4, admission=policy, watermark_blocks=1)
        rows = [row(4, max_tokens=24) for _ in range(6)]  # each needs 7 blocks in the end
        for r in rows:
            s.add(r)
        preempted, peak = 0, 0
        while s.has_work:
            step, _ = run_step(s)
            preempted += len(step.preempted)
            peak = max(peak, len(s.running))
        assert all(r.num_output == 24 for r in rows)
        return preempted, peak

    reserve_preempted, reserve_peak = run("reserve")
    optimistic_preempted, optimistic_peak = run("optimistic")
    assert reserve_preempted == 0 and reserve_peak <= 2
    assert optimistic_peak > reserve_peak and optimistic_preempted > 0


def test_never_fitting_row_is_a_row_error_and_does_not_block_the_queue():
    s = make(num_blocks=8, block_size=4, max_model_len=100)
    kv, capped, empty = s.never_fits(row(40)), make(max_model_len=100).never_fits(row(100)), s.never_fits(row(0))
    assert "KV cache" in kv.message and "max_model_len" in capped.message and "empty" in empty.message
    assert kv.code == capped.code == RefusalCode.CONTEXT_LENGTH_EXCEEDED and empty.code == RefusalCode.INVALID_REQUEST
    # under reserve, a row whose prompt + max_tokens exceeds the pool reserves all of it (and ends with
    # "length" when the pool is full) rather than being refused
    reserve = make(num_blocks=8, block_size=4, admission="reserve")
    assert reserve.never_fits(row(8, max_tokens=100)) is None
    assert s.never_fits(row(8)) is None


def test_prefix_cache_reuses_shared_prompt_blocks():
    s = make(num_blocks=64, block_size=4, caching=True)
    shared = [5, 6, 7, 8] * 4  # 16 tokens = 4 full blocks
    first = Sequence(next(_ids), shared + [1, 2], SamplingParams(max_tokens=2))
    s.add(first)
    while s.has_work:
        run_step(s)
    second = Sequence(next(_ids), shared + [3], SamplingParams(max_tokens=2))
    s.add(second)
    step, _ = run_step(s)
    assert second.prefix_hit_tokens == 16 and step.prefix_hit_tokens == 16
    assert step.num_new == [1]  # only the uncached tail was computed
    # the whole prompt cached: the last token is still computed (it must produce logits)
    third = Sequence(next(_ids), shared, SamplingParams(max_tokens=2))
    s.add(third)
    step, _ = run_step(s)
    assert third.prefix_hit_tokens == 12 and step.num_new[-1] == 4


def test_static_batching_waits_for_the_whole_batch():
    s = make(static_batch=2, max_num_batched_tokens=1 << 20)
    rows = [row(4, max_tokens=m) for m in (1, 5, 1, 1)]
    for r in rows:
        s.add(r)
    compositions = []
    while s.has_work:
        step, _ = run_step(s)
        compositions.append(sorted(q.seq_id for q in step.seqs))
    first_batch = sorted(r.seq_id for r in rows[:2])
    assert compositions[:5] == [first_batch] + [[rows[1].seq_id]] * 4  # row 0's slot stays empty
    assert compositions[5] == sorted(r.seq_id for r in rows[2:])


def test_a_step_encodes_images_within_its_encoder_budget_and_cached_ones_cost_nothing():
    """vLLM's encoder budget: 40 placeholder rows a step. Rows of one 24-row image each: a step starts one fresh
    image (two would be 48), a row whose image does not fit computes its text up to it; an image larger than the
    budget (64) goes first in a step of its own; a digest seen before (the worker's cache holds it) costs nothing,
    so the rows asking about it run beside a fresh one."""
    from batchjob.engine.params import ImageSlot

    def image_row(digest: str, length: int = 24) -> Sequence:
        seq = row(4 + length + 4, max_tokens=2)
        seq.images = (ImageSlot(4, length, digest, None),)
        return seq

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_encoder_tokens=40), BlockPool(256, 4),
                  encoder_cache_tokens=1000)
    rows = [image_row("a"), image_row("b"), image_row("big", 64), image_row("a"), image_row("c"), image_row("a")]
    for seq in rows:
        s.add(seq)
    encoded, first = [], {}
    for i in range(40):
        step, _ = run_step(s)
        if not step.seqs and not s.has_work:
            break
        encoded.append(step.encoder_tokens)
        for seq, n in zip(step.seqs, step.num_new):
            if seq.num_computed - n <= 4 < seq.num_computed:  # this step read its image
                first.setdefault(seq.seq_id, i)
    assert not s.has_work and all(seq.status is SeqStatus.FINISHED for seq in rows)
    assert max(encoded) == 64 and sorted(encoded, reverse=True)[1] <= 40  # the big image alone, the rest within 40
    assert sum(encoded) == 24 * 3 + 64  # a, b and c once each, big once; the rows asking about "a" again: cached
    ids = [seq.seq_id for seq in rows]
    assert first[ids[0]] == 0 and first[ids[1]] == 1 and first[ids[2]] == 2  # one fresh image a step
    assert first[ids[3]] == 0 and first[ids[5]] <= first[ids[4]]  # "a" again: no wait for the encoder
    assert s.encoder.cached("a") and s.encoder.cached("big")
