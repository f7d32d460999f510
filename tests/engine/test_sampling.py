"""Sampling parameters against references: penalties against transformers' logits processors and vLLM's
formula, top-k/top-p/min-p masks against a direct implementation, logprobs against transformers'
logits, min_tokens, stop strings, seeds and n > 1 completions."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.engine.core.detokenizer import IncrementalDetokenizer
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sample.row_keys import sequence_key
from batchjob.engine.sample.sampler import NUCLEUS_WINDOW, sampleable
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.io.parts import read_results
from batchjob.models.registry import build_model
from batchjob.models.loader import load_model
from batchjob.job.rows.prompt_builder import RowError, row_sampling


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(our model, transformers' model, tokenizer, folder) of the tiny Llama."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama", max_positions=1024)
    loaded = load_model(str(path), dtype=torch.float32)
    ours = build_model(loaded.config, dict(loaded.weights), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, ref, loaded.tokenizer, path


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_of(model, eos=(), **sched) -> Engine:
    sched.setdefault("max_num_batched_tokens", 128)
    return Engine(model, list(eos), EngineConfig(num_blocks=512, block_size=8, scheduler=SchedulerConfig(**sched)))


def run_rows(engine: Engine, ps, params, seed=0, detok=None) -> list[Sequence]:
    plist = params if isinstance(params, list) else [params] * len(ps)
    seqs = [Sequence(i, list(p), plist[i], rng_key=sequence_key(plist[i], seed, i),
                     detokenizer=detok(p, plist[i]) if detok else None) for i, p in enumerate(ps)]
    for s in seqs:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    return seqs


def vllm_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, pres: float, freq: float) -> torch.Tensor:
    """vLLM's apply_penalties for one row, written out densely."""
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float() if output else torch.zeros(vocab)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    if output:
        seen[output] = True
    rp = torch.where(seen, torch.tensor(rep), torch.tensor(1.0))
    logits = torch.where(logits > 0, logits / rp, logits * rp)
    return logits - freq * counts - pres * (counts > 0).float()


# ---- penalties ----------------------------------------------------------------------------------------


def test_greedy_with_repetition_penalty_matches_transformers_generate(tiny):
    ours, ref, _, _ = tiny
    ps = prompts(6, ours.config.vocab_size, seed=1)
    got = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8))
    plain = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [s.output_ids for s in got] != [s.output_ids for s in plain]  # the penalty changes something
    for p, s in zip(ps, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0, eos_token_id=None)
        assert s.output_ids == out[0, len(p):].tolist()


def test_greedy_with_all_penalties_matches_hf_processor_plus_vllm_formula(tiny):
    from transformers import RepetitionPenaltyLogitsProcessor

    ours, ref, _, _ = tiny
    ps = prompts(4, ours.config.vocab_size, seed=2)
    rep, pres, freq = 1.3, 0.6, 0.4
    got = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=rep,
                                                       presence_penalty=pres, frequency_penalty=freq))
    hf_rep = RepetitionPenaltyLogitsProcessor(rep)
    for p, s in zip(ps, got):
        ids = list(p)
        for _ in range(20):
            with torch.no_grad():
                logits = ref(torch.tensor([ids])).logits[0, -1].float()
            out = ids[len(p):]
            # repetition over prompt + output as transformers does it, then vLLM's output-only penalties
            x = hf_rep(torch.tensor([ids]), logits[None].clone())[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[-1]).float() if out else torch.zeros_like(x)
            x = x - freq * counts - pres * (counts > 0).float()
            torch.testing.assert_close(x, vllm_penalties(logits, p, out, rep, pres, freq))
            ids.append(int(x.argmax()))
        assert s.output_ids == ids[len(p):]


def test_penalties_and_logprobs_keep_a_row_the_same_alone_and_batched(tiny):
    ours, _, _, _ = tiny
    ps = prompts(12, ours.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logprobs=2)
    engine = engine_of(ours, max_num_seqs=4)  # rows come and go: the worker keeps penalty counts per row
    batched = run_rows(engine, ps, params, seed=11)
    assert len(engine.runner.batch) == 0  # released as each row finished
    for i in (0, 5, 11):
        alone = Sequence(0, ps[i], params, rng_key=sequence_key(params, 11, i))
        engine = engine_of(ours)
        engine.add(alone)
        while engine.has_work:
            engine.step()
        assert alone.output_ids == batched[i].output_ids
        # logits differ in the last bits between batch shapes (matmul blocking); logprobs agree to float precision
        for (t1, lp1, top1), (t2, lp2, top2) in zip(alone.logprobs, batched[i].logprobs, strict=True):
            assert t1 == t2 and lp1 == pytest.approx(lp2, abs=1e-5) and [t for t, _ in top1] == [t for t, _ in top2]
    # tiny prefill chunks and preemption do not change it either
    small = Engine(ours, [], EngineConfig(num_blocks=24, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=16, preemption="recompute")))
    again = run_rows(small, ps, params, seed=11)
    assert [s.output_ids for s in again] == [s.output_ids for s in batched]


# ---- top-k / top-p / min-p ---------------------------------------------------------------------------


def direct_mask(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens that stay sampleable, by the definitions (vLLM's order: min_p, top-k, top-p)."""
    import math

    vocab = len(row)
    keep = set(range(vocab))
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    probs = [math.exp(x - m) / z for x in row]
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    if 0 < top_k < vocab:
        kth = sorted((row[i] for i in keep), reverse=True)[min(top_k, len(keep)) - 1]
        keep = {i for i in keep if row[i] >= kth}
    if top_p < 1:
        mass = sum(probs[i] for i in keep)
        before, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -row[i]):
            if before >= top_p:
                break
            kept.add(i)
            before += probs[i] / mass
        keep = kept
    return keep


@pytest.mark.parametrize("seed", range(3))
def test_top_k_top_p_min_p_masks_match_a_direct_implementation(seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(10, 3000, generator=g) * 3
    rows[8:] *= 0.02  # nearly flat: the nucleus is wider than the sampler's window and needs the whole vocabulary
    top_k = [0, 5, 40, 0, 1, 2999, 20, 3000, 0, 0]
    top_p = [1.0, 1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.7, 0.9, 0.5]
    min_p = [0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.2, 0.01, 0.0, 0.0]
    kept = sampleable(rows.clone(), top_k, top_p, min_p)
    for i in range(len(rows)):
        assert kept[i] == direct_mask(rows[i].double().tolist(), top_k[i], top_p[i], min_p[i]), i
    assert len(kept[8]) > NUCLEUS_WINDOW and len(kept[9]) > NUCLEUS_WINDOW // 2


def test_sampled_tokens_stay_inside_the_mask(tiny):
    ours, _, _, _ = tiny
    ps = prompts(16, ours.config.vocab_size, seed=4)
    got = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=12, temperature=1.5, top_k=3, logprobs=3), seed=5)
    for s in got:
        for tok, _, top in s.logprobs:  # raw logprobs: top-3 of the unpenalized logits
            assert tok in [t for t, _ in top]



def test_allowed_token_ids_match_transformers_and_reach_every_entry_point(tiny, tmp_path):
    # greedy: transformers' generate restricted by prefix_allowed_tokens_fn; sampled: every token inside the set
    ours, ref, tok, path = tiny
    ps = prompts(5, ours.config.vocab_size, seed=6)
    allowed = sorted(random.Random(7).sample(range(3, ours.config.vocab_size), 9))
    got = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=tuple(allowed)))
    for p, s in zip(ps, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                               eos_token_id=None, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
        assert s.output_ids == out[0, len(p):].tolist()
    hot = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=10, temperature=1.3, allowed_token_ids=tuple(allowed)), seed=2)
    assert all(t in allowed for s in hot for t in s.output_ids)
    # the job option (a flag), a row's own column, and the API's keyword
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": [5, 6, 7]}) + "\n" + json.dumps({"prompt": [5, 6, 7], "allowed_token_ids": [9]}) + "\n")
    done = CliRunner().invoke(main, ["run", "--model", str(path), "--input", str(src), "--output", str(tmp_path / "out"),
                                     "--max-tokens", "4", "--ignore-eos", "--allowed-token-ids", ",".join(map(str, allowed)),
                                     "--no-progress", "--kernels", "torch"])
    assert done.exit_code == 0, done.output
    rows = read_results(tmp_path / "out").to_pylist()
    alone = run_rows(engine_of(ours), [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=tuple(allowed)))
    assert [r["generated_text"] for r in rows] == [tok.decode(alone[0].output_ids), tok.decode([9] * 4)]
    from batchjob import api
    result = api.generate([[5, 6, 7]], model=str(path), max_tokens=4, ignore_eos=True, allowed_token_ids=[9, 11], kernels="torch")
    assert set(result[0].token_ids) <= {9, 11}


# ---- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_reference_logits(tiny):
    ours, ref, _, _ = tiny
    ps = prompts(3, ours.config.vocab_size, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.8, logprobs=4, repetition_penalty=1.3, ignore_eos=True)
    got = run_rows(engine_of(ours), ps, params, seed=2)
    for p, s in zip(ps, got):
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([p + s.output_ids])).logits[0].float(), dim=-1)
        assert len(s.logprobs) == s.num_output == 10
        for t, (tok, chosen, top) in enumerate(s.logprobs):
            row = lp[len(p) - 1 + t]
            assert tok == s.output_ids[t]
            assert chosen == pytest.approx(row[tok].item(), abs=1e-4)
            values, ids = row.topk(4)
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    zero = run_rows(engine_of(ours), ps[:1], SamplingParams(max_tokens=3, logprobs=0))[0]
    assert all(top == () for _, _, top in zero.logprobs)


# ---- min_tokens -------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids(tiny):
    ours, _, _, _ = tiny
    ps = prompts(5, ours.config.vocab_size, seed=7)
    first = [s.output_ids[0] for s in run_rows(engine_of(ours), ps, SamplingParams(max_tokens=1))]
    # every row's greedy first token is an EOS: without min_tokens each row stops at once
    stopped = run_rows(engine_of(ours, eos=first), ps, SamplingParams(max_tokens=20))
    assert all(s.num_output == 1 and s.finish_reason == "stop" for s in stopped)
    held = run_rows(engine_of(ours, eos=first), ps, SamplingParams(max_tokens=20, min_tokens=6))
    for s in held:
        assert s.num_output >= 7 or s.finish_reason == "length"
        assert not set(s.output_ids[:6]) & set(first)
    by_stop_ids = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=tuple(first)))
    for s in by_stop_ids:
        assert not set(s.output_ids[:4]) & set(first)


# ---- stop strings -----------------------------------------------------------------------------------


def test_stop_string_split_across_tokens_unit(tiny):
    tok = tiny[2]
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    hit = next(k for k in range(len(ids)) if "ck bro" in tok.decode(ids[:k + 1]))  # the token completing the match
    assert "ck" in tok.decode(ids[:hit]) and "ck bro" not in tok.decode(ids[:hit])  # it spans a token boundary
    for include, expected in ((False, "The qui"), (True, "The quick bro")):
        d = IncrementalDetokenizer(tok, [], ("lazy", "ck bro"), include_stop_str_in_output=include)
        hits = [d.step(i) for i in ids[:hit + 1]]
        assert hits[-1] and not any(hits[:-1])
        assert d.text == expected and d.stop_string == "ck bro"
    d = IncrementalDetokenizer(tok, [], ("quick",), min_tokens=len(ids))
    assert not any(d.step(i) for i in ids)  # held back by min_tokens
    assert d.finish() == tok.decode(ids)


def test_stop_strings_end_rows_in_the_engine(tiny):
    ours, _, tok, _ = tiny
    ps = prompts(6, ours.config.vocab_size, seed=8)
    plain = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=24, ignore_eos=True))
    stops = []
    for s in plain:  # a stop string made of the end of token 5 and the start of token 6
        a, b = tok.decode(s.output_ids[5:6]), tok.decode(s.output_ids[6:7])
        stops.append((a[-2:] + b[:1]) if a and b and "\ufffd" not in a + b else None)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop=(st,) if st else ()) for st in stops]
    detok = lambda p, sp: IncrementalDetokenizer(tok, p, sp.stop) if sp.stop else None  # noqa: E731
    got = run_rows(engine_of(ours), ps, params, detok=detok)
    checked = 0
    for s, base, st in zip(got, plain, stops):
        if st is None:
            continue
        full = tok.decode(base.output_ids)
        assert s.finish_reason == "stop" and s.detokenizer.stop_string == st
        assert s.detokenizer.text == full[:full.find(st)]
        assert s.output_ids == base.output_ids[:s.num_output] and s.num_output <= 7
        checked += 1
    assert checked >= 3


# ---- seeds and n > 1 -----------------------------------------------------------------------------------


def run_cli(*args) -> str:
    result = CliRunner().invoke(main, ["run", *map(str, args), "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_n_completions_are_distinct_seeded_and_reproducible(tmp_path, tiny):
    path = tiny[3]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"The fox number {i} jumps"}) + "\n" for i in range(5)))
    common = ("--model", path, "--input", src, "--max-tokens", 8, "--temperature", 1.0, "--n", 3, "--ignore-eos")
    run_cli(*common, "--output", tmp_path / "a", "--seed", 7)
    run_cli(*common, "--output", tmp_path / "b", "--seed", 7)
    run_cli(*common, "--output", tmp_path / "c", "--seed", 8)
    a, b, c = (read_results(tmp_path / x) for x in "abc")
    comps = a.column("completions").to_pylist()
    for row, text, tokens in zip(comps, a.column("generated_text").to_pylist(), a.column("completion_tokens").to_pylist()):
        assert [c["index"] for c in row] == [0, 1, 2]
        assert len({c["text"] for c in row}) == 3  # distinct completions
        assert row[0]["text"] == text and tokens == sum(c["completion_tokens"] for c in row) == 24
    assert comps == b.column("completions").to_pylist()  # same seed, same completions
    assert comps != c.column("completions").to_pylist()
    # n = 1 keeps the old schema: no completions column
    run_cli("--model", path, "--input", src, "--max-tokens", 8, "--temperature", 1.0, "--output", tmp_path / "d", "--seed", 7)
    d = read_results(tmp_path / "d")
    assert "completions" not in d.schema.names and "logprobs" not in d.schema.names
    assert d.column("generated_text").to_pylist() == [r[0]["text"] for r in comps]  # completion 0 = the n = 1 text


def test_per_row_parameters_seed_and_errors(tmp_path, tiny):
    path = tiny[3]
    rows = [
        {"prompt": "Hello fox", "sampling": {"temperature": 1.0, "seed": 42, "max_tokens": 6}},
        {"prompt": "Hello fox", "temperature": 1.0, "seed": 42, "max_tokens": 6},  # same seed, same prompt, other row
        {"prompt": "Hello fox", "sampling": json.dumps({"temperature": 1.0, "seed": 42, "max_tokens": 6, "n": 2})},
        {"prompt": "Hello fox", "sampling": {"top_p": 1.5}},
        {"prompt": "Hello fox", "max_tokens": "many"},
        {"prompt": "Hello fox", "sampling": {"beam_width": 4}},
        {"prompt": "Hello fox", "logprobs": 2, "max_tokens": 3},
        {"prompt": "Hello fox", "sampling": "{not json"},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_cli("--model", path, "--input", src, "--output", tmp_path / "o", "--max-tokens", 4)
    t = read_results(tmp_path / "o")
    text, errors = t.column("generated_text").to_pylist(), t.column("error").to_pylist()
    assert text[0] == text[1] == t.column("completions")[2].as_py()[0]["text"]
    assert t.column("completion_tokens").to_pylist()[:3] == [6, 6, 12]
    assert "top_p" in errors[3] and "max_tokens" in errors[4] and "beam_width" in errors[5] and "sampling" in errors[7]
    assert len(t.column("logprobs")[6].as_py()) == 3 and t.column("logprobs")[0].as_py() is None


def test_parse_names_the_bad_field():
    base = SamplingParams()
    for values, field in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
                          ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
                          ({"frequency_penalty": "x"}, "frequency_penalty"), ({"stop": [1]}, "stop"),
                          ({"stop_token_ids": "2"}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"),
                          ({"min_tokens": 300}, "min_tokens"), ({"ignore_eos": 1}, "ignore_eos"), ({"seed": 1.5}, "seed")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams.parse(values, base)
        with pytest.raises(RowError, match=field):
            row_sampling({"sampling": values}, base)
    p = SamplingParams.parse({"stop": "###", "top_k": -1, "max_tokens": 5.0, "temperature": None}, base)
    assert p.stop == ("###",) and p.top_k == 0 and p.max_tokens == 5 and p.temperature == 0.0
    assert row_sampling({"prompt": "x"}, base) is base


def test_argmax_rows_matches_torch_argmax_including_ties_and_nan():
    from batchjob.kernels.reference.elementwise import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1024, generator=g)
    x[1, 3] = x[1, 700] = 50.0  # a tie across chunks: the first index wins
    x[2, 130] = x[2, 131] = 50.0  # a tie within a chunk
    x[3, 900] = float("nan")  # NaN counts as the maximum, as in torch
    x[4] = -float("inf")
    for t in (x, x.bfloat16(), x[:, :1000]):  # 1000: not a multiple of the chunk width (plain argmax)
        assert torch.equal(argmax_rows(t), t.argmax(dim=-1))


# ---- bad_words ---------------------------------------------------------------------------------------


def test_bad_words_match_transformers_and_reach_every_entry_point(tiny, tmp_path):
    # vLLM's bad_words: a word's last token is banned once the output ends with its other tokens; transformers'
    # bad_words_ids is the same rule over prompt + output, so the words here never begin inside the prompt
    from batchjob.job.rows.row_plan import bad_words_token_ids

    ours, ref, tok, path = tiny
    ps = prompts(4, ours.config.vocab_size, seed=11)
    free = run_rows(engine_of(ours), ps, SamplingParams(max_tokens=12, ignore_eos=True))
    one = (free[0].output_ids[1],)  # a token the free run takes: banned everywhere
    two = tuple(free[1].output_ids[3:5])  # banned after its first token
    assert all(p[-1] != two[0] for p in ps)
    banned = SamplingParams(max_tokens=12, ignore_eos=True, bad_words=("x",), bad_words_token_ids=(one, two))
    got = run_rows(engine_of(ours), ps, banned)
    for p, s in zip(ps, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None, bad_words_ids=[list(one), list(two)])
        assert s.output_ids == out[0, len(p):].tolist()
        assert one[0] not in s.output_ids
        assert not any(tuple(s.output_ids[i:i + 2]) == two for i in range(len(s.output_ids) - 1))
    assert got[0].output_ids != free[0].output_ids and got[1].output_ids != free[1].output_ids
    # a row with bad words never speculates or overlaps: its next token depends on its earlier ones
    assert banned.reads_output and not SamplingParams().reads_output

    # the words as text: the job's flag, a row's own column and the API's keyword tokenize them as the planner does
    # a word the free run wrote as one token (the tiny tokenizer's byte tokens decode to no word)
    row, word = next((r, w) for r, s in enumerate(free) for t in s.output_ids if (w := tok.decode([t]).strip()).isalpha()
                     and (t,) in bad_words_token_ids(tok, (w,)))
    prompt = ps[row]
    expected = run_rows(engine_of(ours), [prompt], dataclasses.replace(banned, bad_words=(word,),
                                                                       bad_words_token_ids=bad_words_token_ids(tok, (word,))))[0]
    assert expected.output_ids != free[row].output_ids
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": prompt, "bad_words": [word]}) + "\n")
    base = ["run", "--model", str(path), "--input", str(src), "--max-tokens", "12", "--ignore-eos", "--no-progress",
            "--kernels", "torch"]
    done = CliRunner().invoke(main, base + ["--output", str(tmp_path / "flag"), "--bad-words", word])
    assert done.exit_code == 0, done.output
    rows = read_results(tmp_path / "flag").to_pylist()
    assert [r["generated_text"] for r in rows] == [tok.decode(expected.output_ids)] * 2
    done = CliRunner().invoke(main, base + ["--output", str(tmp_path / "column")])
    assert done.exit_code == 0, done.output
    rows = read_results(tmp_path / "column").to_pylist()
    assert [r["generated_text"] for r in rows] == [tok.decode(free[row].output_ids), tok.decode(expected.output_ids)]
    from batchjob import api
    result = api.generate([prompt], model=str(path), max_tokens=12, ignore_eos=True, bad_words=word, kernels="torch")
    assert list(result[0].token_ids) == expected.output_ids
    # refused as vLLM refuses them: an empty word; the token ids are the planner's to make
    with pytest.raises(ValueError, match="bad_words: words must not be empty"):
        SamplingParams.parse({"bad_words": ["ok", " "]})
    with pytest.raises(ValueError, match="bad_words_token_ids: made from bad_words"):
        SamplingParams.parse({"bad_words_token_ids": [[5]]})
