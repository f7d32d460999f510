"""Score jobs (`--task score`): each prompt token's logprob, a continuation's summed logprob and is_greedy
(lm-evaluation-harness's loglikelihood), equal to transformers; `--prompt-logprobs k` on generate jobs."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from batchjob.io.manifest import Manifest
from batchjob.io.parts import read_results
from batchjob.models.loader import load_model
from tests.job.test_resume import FAST, cli, start_job, wait_for_parts, write_jsonl


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


@pytest.fixture(scope="module")
def ref(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(llama_dir):
    return load_model(str(llama_dir)).tokenizer


def log_softmax(ref, ids):
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def encode(tok, text):
    return tok.encode_batch([text], add_special_tokens=True)[0]


ROWS = [{"prompt": "The fox jumps over", "continuation": " the lazy dog"},
        {"prompt": "a b c ", "continuation": "d e"},  # the trailing space moves to the continuation (lm-eval)
        {"prompt": "one two three four five six"},  # no continuation: the whole prompt is scored
        {"prompt": [5, 6, 7, 8], "continuation": [9, 10]},  # token ids
        {"prompt": "x", "continuation": 3},  # a bad continuation: a row error
        {"prompt": "", "continuation": "dog"}]


def test_a_score_job_equals_transformers(tmp_path, llama_dir, ref, tok):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "score", "--dtype", "float32",
        "--max-num-batched-tokens", 8, *FAST)  # chunked: a prompt spans several steps
    table = read_results(out)
    assert table.schema.field("prompt_logprobs").type == pa.list_(pa.float64())
    assert table.schema.field("is_greedy").type == pa.bool_()
    rows = table.to_pylist()
    assert [r["finish_reason"] for r in rows] == ["stop"] * 4 + ["error"] * 2
    assert "column 'continuation': expected a non-empty string" in rows[4]["error"]
    assert "a continuation is scored after a prompt" in rows[5]["error"]
    for row, given in zip(rows[:4], ROWS):
        prompt, cont = given["prompt"], given.get("continuation")
        if isinstance(prompt, list):
            ids, start = prompt + cont, len(prompt)
        elif cont is None:
            ids, start = encode(tok, prompt), None
        else:
            context = prompt.rstrip()
            ids, start = encode(tok, context + prompt[len(context):] + cont), len(encode(tok, context))
        assert row["prompt_tokens"] == len(ids) and row["completion_tokens"] == 0 and row["generated_text"] == ""
        lsm = log_softmax(ref, ids)
        want = lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) == len(ids)
        torch.testing.assert_close(torch.tensor(row["prompt_logprobs"][1:], dtype=torch.float32), want, atol=1e-3, rtol=0)
        assert row["prompt_logprob_sum"] == pytest.approx(want.sum().item(), abs=1e-3)
        if start is None:
            assert row["continuation_logprob"] is None and row["is_greedy"] is None
            continue
        # the direct computation: the continuation's tokens under the logits of the positions before them
        direct = sum(lsm[p - 1, ids[p]].item() for p in range(start, len(ids)))
        greedy = all(lsm[p - 1].argmax().item() == ids[p] for p in range(start, len(ids)))
        assert row["continuation_logprob"] == pytest.approx(direct, abs=1e-3)
        assert row["continuation_tokens"] == len(ids) - start and row["is_greedy"] == greedy


def test_greedy_continuations_are_greedy(tmp_path, llama_dir, tok):
    """A continuation the model generated greedily is is_greedy; one token changed makes it not."""
    import batchjob

    prompt = "The fox jumps"
    generated = batchjob.generate([prompt], model=str(llama_dir), max_tokens=6, ignore_eos=True, dtype="float32",
                                  kv_cache_gb=0.02)[0].token_ids
    ids = encode(tok, prompt)
    other = [(generated[0] + 1) % 400, *generated[1:]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ids, "continuation": list(generated)},
                                              {"prompt": ids, "continuation": other}])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "score", "--dtype", "float32",
        "--prompt-logprobs", 2, *FAST)
    rows = read_results(out).to_pylist()
    assert [r["is_greedy"] for r in rows] == [True, False]
    top = rows[0]["prompt_top_logprobs"]
    assert top[0] is None and all(len(t) == 2 for t in top[1:])
    # the greedy continuation's tokens are each the top alternative at their position
    assert [t[0]["token_id"] for t in top[len(ids):]] == list(generated)


def test_prompt_logprobs_on_a_generate_job(tmp_path, llama_dir, ref, tok):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "The fox jumps over the lazy dog"}])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--prompt-logprobs", 1, "--max-tokens", 4,
        "--ignore-eos", "--dtype", "float32", *FAST)
    row = read_results(out).to_pylist()[0]
    ids = encode(tok, "The fox jumps over the lazy dog")
    lsm = log_softmax(ref, ids)
    entries = row["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and row["completion_tokens"] == 4
    for p, e in enumerate(entries[1:], start=1):
        assert e["token_id"] == ids[p] and e["logprob"] == pytest.approx(lsm[p - 1, ids[p]].item(), abs=1e-3)
        assert e["top_logprobs"][0]["token_id"] == lsm[p - 1].argmax().item()


def test_a_score_job_resumes_after_sigkill_exactly_once(tmp_path, llama_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps", "continuation": " over" * (1 + i % 5)}
                                              for i in range(300)])
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    args = ["--model", llama_dir, "--input", src, "--task", "score", "--part-rows", 10, "--max-num-seqs", 4,
            "--dtype", "float32", *FAST]
    cli("run", *args, "--output", ref_out)
    proc = start_job(*args, "--output", out)
    wait_for_parts(out, proc, parts=2)
    proc.kill()
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 300
    cli("run", *args, "--output", out)
    got, want = read_results(out), read_results(ref_out)
    assert got.column("row_index").to_pylist() == list(range(300))
    for a, b in zip(got.column("continuation_logprob").to_pylist(), want.column("continuation_logprob").to_pylist()):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("flags, says", [
    (["--task", "score", "--chat"], "chat: not with task = \"score\""),
    (["--task", "score", "--n", "2"], "n: not with task"),
    (["--task", "score", "--pooling", "mean"], "pooling: applies to task = \"embed\" only"),
    (["--task", "embed", "--prompt-logprobs", "1"], "prompt_logprobs: not with task = \"embed\""),
])
def test_bad_combinations_are_config_errors(tmp_path, llama_dir, flags, says):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c"}])
    text = cli("run", "--model", llama_dir, "--input", src, "--output", tmp_path / "out", *flags, *FAST, code=2)
    assert says in text


def test_a_row_asking_for_generation_in_a_score_job_is_a_row_error(tmp_path, llama_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c", "max_tokens": 5}, {"prompt": "a b c"}])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "score", *FAST)
    rows = read_results(out).to_pylist()
    assert [r["finish_reason"] for r in rows] == ["error", "stop"]
    assert "score job's rows generate nothing" in rows[0]["error"]


def test_api_score_equals_the_job(tmp_path, llama_dir, ref, tok):
    import batchjob

    prompts, conts = ["The fox jumps over", "a b c "], [" the lazy dog", "d e"]
    results = batchjob.score(prompts, conts, model=str(llama_dir), dtype="float32", kv_cache_gb=0.02)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p, "continuation": c} for p, c in zip(prompts, conts)])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "score", "--dtype", "float32", *FAST)
    for r, row in zip(results, read_results(out).to_pylist()):
        assert r.finish_reason == "stop" and r.text == ""
        for name in ("prompt_logprobs", "prompt_logprob_sum", "continuation_logprob", "continuation_tokens", "is_greedy"):
            assert getattr(r, name) == pytest.approx(row[name], abs=1e-6)
    whole = batchjob.LLM(str(llama_dir), dtype="float32", kv_cache_gb=0.02).score("The fox jumps", prompt_logprobs=1)[0]
    assert whole.continuation_logprob is None and len(whole.prompt_top_logprobs) == len(encode(tok, "The fox jumps"))
    generated = batchjob.generate(["The fox jumps"], model=str(llama_dir), max_tokens=2, prompt_logprobs=0,
                                  dtype="float32", kv_cache_gb=0.02)[0]
    assert [e["logprob"] for e in generated.prompt_logprobs[1:]] == pytest.approx(whole.prompt_logprobs[1:], abs=1e-5)
    with pytest.raises(ValueError, match="continuations: expected one per prompt"):
        batchjob.score(["a", "b"], ["c"], model=str(llama_dir), kv_cache_gb=0.02)
    with pytest.raises(ValueError, match="temperature: unknown keyword"):
        batchjob.score(["a"], model=str(llama_dir), temperature=0.5)


def test_the_example_score_job_on_the_embedded_model(tmp_path):
    """jobs/score.toml (SmolLM2, 8 questions x 4 answers): every row scored; SmolLM2-135M picks most golds."""
    from pathlib import Path

    job = Path(__file__).resolve().parents[2] / "jobs" / "score.toml"
    out = tmp_path / "out"
    cli("run", job, "--output", out, "--no-progress")
    rows = read_results(out).to_pylist()
    assert len(rows) == 32 and {r["finish_reason"] for r in rows} == {"stop"}
    assert all(r["continuation_tokens"] >= 1 and r["continuation_logprob"] < 0 for r in rows)
    best = {}
    for r in rows:
        if r["question_id"] not in best or r["continuation_logprob"] > best[r["question_id"]]["continuation_logprob"]:
            best[r["question_id"]] = r
    assert sum(r["gold"] for r in best.values()) >= 5  # 6 of 8 measured (bf16, native kernels); chance is 2
