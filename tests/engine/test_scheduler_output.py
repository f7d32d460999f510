"""The engine hands its executor plain SchedulerOutputs and the worker keeps its own rows (issue 33): each step
sends only what changed, and the worker's copy of every scheduled row equals the engine's, through decodes,
chunked prefill, preemption (recompute and swap) and the blocks speculative decoding gives back."""
from __future__ import annotations

import dataclasses

import pytest

from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.core.scheduler_output import SchedulerOutput
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sample.row_keys import row_key
from batchjob.engine.spec_decode.config import SpeculativeConfig
from batchjob.models.config import ModelConfig
from tests.builders import VOCAB, prompts, random_llama

PLAIN = (int, bool, str, float, type(None))


def _plain(value) -> bool:
    """Plain data only: numbers, tuples, frozensets and the row's (frozen) SamplingParams; no engine object."""
    if isinstance(value, PLAIN) or isinstance(value, SamplingParams):
        return True
    if isinstance(value, (tuple, frozenset, list)):  # NewRow and RowUpdate are NamedTuples; the columns lists
        return all(_plain(v) for v in value)
    return False


def _sent(out: SchedulerOutput) -> SchedulerOutput:
    """The output as it was when sent: its rows' lists are the engine's own (the worker copies them as it applies
    them), so the record keeps copies."""
    return dataclasses.replace(out, new_rows=[n._replace(token_ids=tuple(n.token_ids), block_table=tuple(n.block_table))
                                              for n in out.new_rows],
                               updates=[u._replace(new_token_ids=tuple(u.new_token_ids), new_blocks=tuple(u.new_blocks))
                                        for u in out.updates])


def run_watched(engine: Engine, seqs: list[Sequence]) -> list[SchedulerOutput]:
    """Run the rows to the end, checking after each step's launch that the worker's rows are the engine's."""
    by_id = {s.seq_id: s for s in seqs}
    outs: list[SchedulerOutput] = []
    run = engine.runner.run

    def watched(out, in_flight=None):
        assert all(_plain(getattr(out, f)) for f in ("seq_ids", "num_computed", "num_new", "num_sampled", "new_rows",
                                                     "updates", "preempted_ids"))
        assert all(_plain(d) for d in out.drafts.values())
        tokens = run(out) if in_flight is None else run(out, in_flight)
        for seq_id, done in zip(out.seq_ids, out.num_computed):
            row, seq = engine.runner.batch.row(seq_id), by_id[seq_id]
            assert row.token_ids == seq.token_ids and row.block_table == seq.block_table, f"row {seq_id}"
            assert done == seq.num_computed  # sent before the scheduler counts the step as computed
        outs.append(_sent(out))
        return tokens

    engine.runner.run = watched
    for s in seqs:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    assert len(engine.runner.batch) == 0 and len(engine.view) == 0  # every finished row released on both sides
    return outs


def _rows(ps, params) -> list[Sequence]:
    return [Sequence(i, p, params, rng_key=row_key(4, i)) for i, p in enumerate(ps)]


def test_each_step_sends_the_new_tokens_once_and_the_worker_keeps_the_rest(tiny_model):
    ps = prompts(10, seed=21, lo=5, hi=70)
    seqs = _rows(ps, SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True))
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=8,
                                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))  # chunked prompts
    outs = run_watched(engine, seqs)
    sent = sum(len(n.token_ids) for o in outs for n in o.new_rows) + \
        sum(len(u.new_token_ids) for o in outs for u in o.updates)
    # every token once (prompt at admission, each output token the step after it is sampled) but each row's last
    assert sent == sum(len(s.token_ids) - 1 for s in seqs)
    assert sum(len(o.new_rows) for o in outs) == len(seqs)
    blocks = sum(len(n.block_table) for o in outs for n in o.new_rows) + \
        sum(len(u.new_blocks) for o in outs for u in o.updates)
    assert all(u.kept_blocks >= 0 for o in outs for u in o.updates) and not any(o.preempted_ids for o in outs)
    # nothing preempted: each block a row ever held sent once
    assert blocks == sum(-(-(len(s.token_ids) - 1) // 8) for s in seqs)
    decodes = [o for o in outs if all(n == 1 for n in o.num_new)]
    assert decodes and all(len(u.new_token_ids) == 1 for o in decodes[1:] for u in o.updates)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_row_is_sent_its_new_table_and_keeps_its_text(tiny_model, mode):
    ps = prompts(12, seed=8, lo=20, hi=90)
    params = SamplingParams(max_tokens=24, temperature=0.8)
    ref_seqs = _rows(ps, params)
    run_watched(Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=8)), ref_seqs)
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=40, block_size=8, num_host_blocks=200 if mode == "swap" else 0,
                                                 scheduler=SchedulerConfig(preemption=mode)))
    seqs = _rows(ps, params)
    outs = run_watched(engine, seqs)
    preempted = {i for o in outs for i in o.preempted_ids}
    assert preempted and [s.output_ids for s in seqs] == [s.output_ids for s in ref_seqs]
    resumed = [u for o in outs for u in o.updates if u.seq_id in preempted and u.kept_blocks == 0 and u.new_blocks]
    assert len(resumed) >= len(preempted)


def test_blocks_given_back_after_rejected_proposals_reach_the_worker(tiny_model):
    """A poor draft model: most proposals are rejected and the blocks that held only them go back to the pool
    (BlockPool.shrink gives the row a new table): the worker keeps the prefix it shares and gets the rest."""
    torch_draft = random_llama(ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                           max_position_embeddings=1024))
    spec = SpeculativeConfig("draft", num_tokens=6, draft_model="in memory")
    ps = prompts(6, seed=5, lo=6, hi=30)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = _rows(ps, params)
    run_watched(Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=4)), plain)
    seqs = _rows(ps, params)
    outs = run_watched(Engine(tiny_model, [], EngineConfig(num_blocks=512, block_size=4, speculative=spec),
                              draft_model=torch_draft), seqs)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    held: dict[int, int] = {}  # the worker's table length per row
    shrunk = 0
    for o in outs:
        for n in o.new_rows:
            held[n.seq_id] = len(n.block_table)
        for u in o.updates:
            shrunk += u.kept_blocks < held[u.seq_id]
            held[u.seq_id] = u.kept_blocks + len(u.new_blocks)
    assert shrunk > 0
