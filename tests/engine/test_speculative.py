"""Speculative decoding by prompt lookup: the same tokens as without it, greedy and sampled, in any
batch, under preemption; proposals counted in the budget and the blocks; rows that cannot use it do not."""
from __future__ import annotations

import random

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sample.row_keys import row_key
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.spec_decode.config import SpeculativeConfig, SpeculativeError
from batchjob.engine.spec_decode.ngram import NgramProposer
from batchjob.models.config import ModelConfig
from batchjob.models.causal_lm import CausalLM
from tests.builders import VOCAB, random_llama


@pytest.fixture(scope="module")
def echo_model() -> CausalLM:
    """A tiny random Llama with tied embeddings and small layer weights: its next token is often its
    current one, so its text falls into loops that lookups predict (52 of 95 proposals kept here), and
    sometimes not (the other 43 are rejected)."""
    return random_llama(ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                                    tie_word_embeddings=True))


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, as a text to rewrite or extract from does: lookups find matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        out.append((phrase * rng.randint(2, 6))[: rng.randint(8, 60)])
    return out


def run(model, ps, params, spec: SpeculativeConfig | None, num_blocks=512, **sched):
    engine = Engine(model, [3], EngineConfig(num_blocks=num_blocks, block_size=16, speculative=spec,
                                             scheduler=SchedulerConfig(**sched)))
    seqs = [Sequence(i, p, params[i % len(params)], rng_key=row_key(9, i)) for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    steps = proposed = accepted = preempted = 0
    while engine.has_work:
        engine.step()
        st = engine.last_stats
        steps += 1
        proposed += st.num_proposed
        accepted += st.num_accepted
        preempted += st.num_preempted
    return seqs, dict(steps=steps, proposed=proposed, accepted=accepted, preempted=preempted)


PARAMS = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9),
          SamplingParams(max_tokens=37, temperature=1.2, top_k=8), SamplingParams(max_tokens=30, stop_token_ids=(11,))]


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_speculation_gives_the_same_tokens_greedy_and_sampled(echo_model, k):
    ps = repetitive_prompts(12, seed=1)
    ref, ref_stats = run(echo_model, ps, PARAMS, None, max_num_seqs=6)
    spec, stats = run(echo_model, ps, PARAMS, SpeculativeConfig("ngram", num_tokens=k), max_num_seqs=6)
    for a, b in zip(ref, spec):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason, a.seq_id
    assert stats["proposed"] > 0 and 0 < stats["accepted"] < stats["proposed"]  # kept and rejected ones
    assert stats["steps"] < ref_stats["steps"]  # accepted tokens save forwards
    assert ref_stats["proposed"] == 0


def test_speculation_under_preemption_and_a_tight_token_budget_keeps_the_tokens(echo_model):
    ps = repetitive_prompts(10, seed=1)
    ref, _ = run(echo_model, ps, PARAMS, None, max_num_seqs=8)
    spec, stats = run(echo_model, ps, PARAMS, SpeculativeConfig("ngram", num_tokens=6), num_blocks=14,
                      max_num_seqs=8, max_num_batched_tokens=24)
    assert stats["preempted"] > 0 and stats["accepted"] > 0
    assert [s.output_ids for s in spec] == [s.output_ids for s in ref]


def test_rows_with_penalties_logprobs_or_unmet_min_tokens_do_not_propose():
    prop = NgramProposer(SpeculativeConfig("ngram", num_tokens=3))
    toks = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = Sequence(0, list(toks), SamplingParams(max_tokens=50))
    pen = Sequence(1, list(toks), SamplingParams(max_tokens=50, repetition_penalty=1.2))
    lp = Sequence(2, list(toks), SamplingParams(max_tokens=50, logprobs=1))
    mt = Sequence(3, list(toks), SamplingParams(max_tokens=50, min_tokens=5))
    short = Sequence(4, list(toks), SamplingParams(max_tokens=2))  # one token left after this one: nothing to guess
    rows = [plain, pen, lp, mt, short]
    for s in rows:
        s.num_computed = s.num_tokens - 1
    prop.propose(rows, max_model_len=1000)
    assert plain.draft == [3, 4, 1]  # "1 2" last seen at 8..9: what followed it
    assert pen.draft is lp.draft is mt.draft is None and short.draft == [3]
    prop.propose(rows, max_model_len=11)  # the context ends one token after this one
    assert plain.draft == [3]


def test_a_row_whose_proposals_fail_backs_off_and_a_large_batch_does_not_propose():
    cfg = SpeculativeConfig("ngram", num_tokens=4, max_rows=2)
    prop = NgramProposer(cfg)
    seq = Sequence(0, [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=100))
    seq.num_computed = seq.num_tokens - 1
    prop.propose([seq], 1000)
    assert seq.draft
    for _ in range(4):
        prop.observe(seq, 4, 0)
    prop.propose([seq], 1000)
    assert seq.draft is None and prop.state(seq).skip == 3  # 4 steps without proposals, this one included
    others = [Sequence(i, [1, 2, 1, 2], SamplingParams(max_tokens=9)) for i in range(3)]
    for s in others:
        s.num_computed = s.num_tokens - 1
    prop.propose(others, 1000)
    assert all(s.draft is None for s in others)


def test_unknown_methods_and_a_missing_draft_model_are_clear_errors(tiny_model):  # noqa: F811
    with pytest.raises(SpeculativeError, match="'draft' needs a draft model: --draft-model PATH"):
        Engine(tiny_model, [], EngineConfig(num_blocks=8, speculative=SpeculativeConfig("draft")))
    with pytest.raises(SpeculativeError, match="'eagle' is not one of"):
        SpeculativeConfig("eagle").check()
    with pytest.raises(SpeculativeError, match="num_speculative_tokens: must be in 1..16"):
        SpeculativeConfig("ngram", num_tokens=0).check()


def test_a_rewriting_job_on_smollm2_keeps_its_text_across_a_resume_and_accepts_most_proposals(tmp_path, smollm2_gguf_path):
    """jobs/speculative.toml on the embedded model (bf16, the default kernels), 32 tokens a row: the same text as
    without speculation, also when the job stops after 3 rows and a rerun finishes it; most proposals are kept (at
    32 tokens 82% of them, 2.7 tokens a row per forward, on the AVX2 Zen 3)."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from batchjob.cli.main import main
    from batchjob.io.parts import read_results

    job = Path(__file__).resolve().parents[2] / "jobs" / "speculative.toml"

    def run_job(out, *flags):
        result = CliRunner().invoke(main, ["run", str(job), "--output", str(out), "--max-tokens", "32", "--no-progress", *flags])
        assert result.exit_code == 0, result.output
        return json.loads((out / "stats.jsonl").read_text().splitlines()[-1])

    plain = tmp_path / "plain"
    run_job(plain, "--speculative", "none")
    spec = tmp_path / "spec"
    run_job(spec, "--limit", "3")
    stats = run_job(spec)  # the rest of the rows
    assert stats["speculative_proposed"] > 0 and stats["acceptance_rate"] > 0.5 and stats["tokens_per_row_forward"] > 1.5
    texts = [read_results(out).sort_by("row_index").column("generated_text").to_pylist() for out in (plain, spec)]
    assert len(texts[0]) == 8 and texts[0] == texts[1]


def run_draft(target, draft, ps, params, k=4, num_blocks=512, **sched):
    engine = Engine(target, [3], EngineConfig(num_blocks=num_blocks, block_size=16, speculative=SpeculativeConfig(
        "draft", num_tokens=k, draft_model="in memory"), scheduler=SchedulerConfig(**sched)), draft_model=draft)
    seqs = [Sequence(i, p, params[i % len(params)], rng_key=row_key(9, i)) for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    return seqs, engine.proposer


def test_a_draft_model_gives_the_targets_tokens_and_the_target_as_its_own_draft_is_always_right(echo_model, tiny_model):  # noqa: F811
    ps = repetitive_prompts(10, seed=3)
    ref, _ = run(echo_model, ps, PARAMS, None, max_num_seqs=6)
    same, prop = run_draft(echo_model, echo_model, ps, PARAMS, max_num_seqs=6)
    assert [s.output_ids for s in same] == [s.output_ids for s in ref]
    assert prop.proposed > 100 and prop.accepted >= 0.95 * prop.proposed  # its own draft: (almost) every proposal kept
    other, prop = run_draft(echo_model, tiny_model, ps, PARAMS, max_num_seqs=6)  # a poor draft: the same text
    assert [s.output_ids for s in other] == [s.output_ids for s in ref] and prop.accepted < 0.5 * prop.proposed


def test_a_draft_model_under_preemption_keeps_the_tokens(echo_model):
    """Short prompts growing long: rows are preempted (recomputed) while drafting, and the draft's cache
    restarts with them."""
    ps = [p[:12] for p in repetitive_prompts(10, seed=1)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=60, temperature=0.8, ignore_eos=True)]
    ref, _ = run(echo_model, ps, params, None, max_num_seqs=8)
    got, prop = run_draft(echo_model, echo_model, ps, params, k=6, num_blocks=10, max_num_seqs=8, max_num_batched_tokens=24)
    assert [s.output_ids for s in got] == [s.output_ids for s in ref] and prop.accepted > 0.9 * prop.proposed
    assert sum(s.num_preemptions for s in got) > 0


def test_a_job_with_a_draft_model_keeps_its_text_and_a_draft_of_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    import json

    from click.testing import CliRunner

    from batchjob.cli.main import main
    from batchjob.io.parts import read_results
    from tests.builders import write_jsonl

    model = str(tiny_model_dir("llama", max_positions=1024))
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "one two three " * (1 + i % 3)} for i in range(12)])

    def run_job(out, *flags):
        return CliRunner().invoke(main, ["run", "--model", model, "--input", str(src), "--output", str(tmp_path / out),
                                         "--max-tokens", "16", "--dtype", "float32", "--no-progress", *flags])

    assert run_job("plain").exit_code == 0
    own = run_job("draft", "--speculative", "draft", "--draft-model", model)  # the target as its own draft
    assert own.exit_code == 0, own.output
    stats = json.loads((tmp_path / "draft" / "stats.jsonl").read_text().splitlines()[-1])
    assert stats["speculative_proposed"] > 0 and stats["acceptance_rate"] > 0.9
    texts = [read_results(tmp_path / out).sort_by("row_index").column("generated_text").to_pylist() for out in ("plain", "draft")]
    assert texts[0] == texts[1]
    other = run_job("bad", "--speculative", "draft", "--draft-model", "smollm2")
    assert other.exit_code == 1 and "a draft model must share the target's tokenizer" in other.output
    missing = run_job("none", "--speculative", "draft")
    assert missing.exit_code == 2 and "--draft-model PATH" in missing.output


def test_blocks_taken_by_rejected_proposals_go_back_to_the_pool(tiny_model):  # noqa: F811
    """A poor proposer (a random draft): after each verification a row holds only the blocks its tokens need."""
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=64, block_size=16, speculative=SpeculativeConfig(
        "draft", num_tokens=16, draft_model="in memory")), draft_model=copy_model(tiny_model))
    seq = Sequence(0, list(range(1, 15)), SamplingParams(max_tokens=40), rng_key=row_key(0, 0))
    engine.add(seq)
    held = []
    while engine.has_work:
        engine.step()
        if seq.block_table:
            held.append(len(seq.block_table) - engine.pool.blocks_for(seq.num_tokens))
    assert engine.proposer.proposed > engine.proposer.accepted and held and max(held) == 0


def copy_model(model):
    """Another model object on the same weights whose proposals the target mostly rejects: its layers
    reversed."""
    import copy

    other = copy.copy(model)
    other.layers = list(reversed(model.layers))
    return other


def small_vocab_model(seed: int, vocab: int = 16) -> CausalLM:
    return random_llama(ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64),
                        seed=seed, std=0.5, embed_std=0.5)


def test_speculative_sampling_follows_the_target_distribution_on_a_small_vocabulary():
    """4,000 rows of one prompt, temperature 1, the second token verified against another model's
    proposal: its frequencies against the target's own marginal p(t2) = sum over t1 of p(t1) p(t2 | t1)
    (a chi-square test), and the proposals were mostly rejected, so verification did the work."""
    target, draft = small_vocab_model(1), small_vocab_model(2)
    prompt = [1, 2, 3]
    params = SamplingParams(max_tokens=3, temperature=1.0)  # the second token is the first one verified
    engine = Engine(target, [], EngineConfig(num_blocks=4096, block_size=16, speculative=SpeculativeConfig(
        "draft", num_tokens=1, max_rows=1 << 20, draft_model="in memory"), scheduler=SchedulerConfig(max_num_seqs=128)),
        draft_model=draft)
    seqs = [Sequence(i, list(prompt), params, rng_key=row_key(5, i)) for i in range(4000)]
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
    assert engine.proposer.proposed > 3000 and engine.proposer.accepted < 0.9 * engine.proposer.proposed
    with torch.no_grad():
        first = torch.softmax(_next_logits(target, prompt), -1)
        second = torch.stack([torch.softmax(_next_logits(target, prompt + [t]), -1) for t in range(16)])
    expected = (first[:, None] * second).sum(0) * len(seqs)
    counts = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=16).double()
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)  # ~4 sigma of a chi-square with dof degrees


def _next_logits(model, ids):
    engine = Engine(model, [], EngineConfig(num_blocks=8, block_size=16))
    seq = Sequence(0, list(ids), SamplingParams(max_tokens=1, logprobs=16), rng_key=0)
    engine.add(seq)
    while engine.has_work:
        engine.step()
    lp = torch.full((16,), float("-inf"))
    for tok, value in seq.logprobs[0][2]:
        lp[tok] = value
    return lp
