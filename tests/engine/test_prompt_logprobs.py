"""Prompt logprobs on the engine: scoring rows (max_tokens 0: prefill only) and generate rows with
`prompt_logprobs: k`, equal to transformers' log-softmax of its logits, chunked, batched, preempted."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from batchjob.engine.params import SamplingParams
from tests.builders import run_rows
from tests.engine.test_determinism import tiny_model as determinism_model
from tests.job.test_embed import ours


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_model_dir):
    """(our model, transformers' causal LM) of a tiny family, fp32."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(request.param, max_positions=1024)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours(path), ref


def run(model, ps, params, *, caching=True, **options):
    engine, seqs = run_rows(model, ps, params, caching=caching, **options)
    assert engine.pool.num_used == 0 or params.max_tokens > 0 and caching  # a scoring row's blocks go back
    return seqs


def reference(ref, p):
    """transformers: (logprob of each prompt token from the second, argmax, log-softmax rows)."""
    with torch.no_grad():
        lsm = torch.log_softmax(ref(torch.tensor([p])).logits[0].float(), dim=-1)
    targets = torch.tensor(p[1:])
    return lsm[:-1].gather(1, targets[:, None]).squeeze(1), lsm[:-1].argmax(-1), lsm[:-1]


def prompts(n, seed=0, lo=2, hi=60, vocab=400):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check(seq, ref, p, k=0):
    lp, am, lsm = reference(ref, p)
    got = seq.prompt_logprobs
    assert len(got) == len(p) - 1
    torch.testing.assert_close(torch.tensor([e[0] for e in got]), lp, atol=1e-3, rtol=0)
    assert [e[1] for e in got] == am.tolist()
    if k:
        top_v, top_i = lsm.topk(k, dim=-1)
        for e, ids, vals in zip(got, top_i.tolist(), top_v):
            assert [i for i, _ in e[2]] == ids
            torch.testing.assert_close(torch.tensor([v for _, v in e[2]]), vals, atol=1e-3, rtol=0)


def test_scoring_rows_equal_transformers_chunked_and_batched(tiny):
    model, ref = tiny
    ps = prompts(6, seed=1) + [[7], prompts(1, seed=2, lo=90, hi=90)[0]]  # one token: nothing to score
    for seq, p in zip(run(model, ps, SamplingParams(max_tokens=0, prompt_logprobs=0), budget=32), ps):
        assert seq.finish_reason == "stop" and seq.num_output == 0
        if len(p) == 1:
            assert seq.prompt_logprobs == []
        else:
            check(seq, ref, p)


def test_top_k_alternatives_and_the_cache_is_not_read(tiny):
    model, ref = tiny
    head = prompts(1, seed=3, lo=40, hi=40)[0]
    ps = [head + [5, 6, 7], head + [9, 10]]
    seqs = run(model, ps, SamplingParams(max_tokens=0, prompt_logprobs=3), max_num_seqs=1)
    for seq, p in zip(seqs, ps):
        assert seq.prefix_hit_tokens == 0  # every position must be computed to be scored
        check(seq, ref, p, k=3)


def test_generate_rows_with_prompt_logprobs(tiny):
    model, ref = tiny
    ps = prompts(5, seed=4, lo=10, hi=50)
    plain = run(model, ps, SamplingParams(max_tokens=6, ignore_eos=True), budget=24)
    scored = run(model, ps, SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2), budget=24)
    for a, b, p in zip(plain, scored, ps):
        assert a.output_ids == b.output_ids and a.prompt_logprobs is None
        check(b, ref, p, k=2)


def test_recompute_preemption_restarts_the_list(tiny):
    model, ref = tiny
    ps = prompts(8, seed=5, lo=50, hi=60)
    # a pool too small for all rows' prompts at once: rows are preempted (recompute) and restart
    seqs = run(model, ps, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0), budget=96,
               prefill_chunk=16, num_blocks=24, preemption="recompute", caching=False)
    assert sum(s.num_preemptions for s in seqs) > 0
    for seq, p in zip(seqs, ps):
        check(seq, ref, p)


def test_checks():
    with pytest.raises(ValueError, match="max_tokens: must be >= 1 .0 only with prompt_logprobs"):
        SamplingParams.parse({"max_tokens": 0})
    with pytest.raises(ValueError, match="prompt_logprobs: must be in"):
        SamplingParams.parse({"prompt_logprobs": 21})
    with pytest.raises(ValueError, match="scoring row"):
        SamplingParams.parse({"max_tokens": 0, "prompt_logprobs": 0, "n": 2})
    assert SamplingParams.parse({"max_tokens": 0, "prompt_logprobs": "1" and 1}).prefill_only


@pytest.mark.skipif(shutil.which("g++") is None,
                    reason="batch invariance in bf16 rests on the native kernels (docs/design/determinism.md)")
def test_bf16_a_scoring_row_alone_equals_in_a_batch():
    model = determinism_model(torch.bfloat16)
    rng = random.Random(7)
    ps = [[rng.randrange(3, 384) for _ in range(rng.randint(3, 90))] for _ in range(8)]
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    batched = run(model, ps, params, block_size=16, budget=64)  # chunked and batched
    for i in (0, 5):
        assert run(model, [ps[i]], params, block_size=16)[0].prompt_logprobs == batched[i].prompt_logprobs
