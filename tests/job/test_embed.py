"""Embed rows (`--task embed`): prefill only, the final normed hidden states pooled, on the same engine;
equal to transformers' `last_hidden_state` pooled, chunked or not, with or without a shared cached prefix."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import PoolingParams, SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.builders import run_rows
from tests.engine.test_determinism import tiny_model as determinism_model


def ours(path, dtype=torch.float32):
    loaded = load_model(str(path), dtype=dtype)
    return build_model(loaded.config, dict(loaded.weights), dtype)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_model_dir):
    """(our model, transformers' base model) of a tiny family, fp32."""
    from transformers import AutoModel

    path = tiny_model_dir(request.param, max_positions=1024)
    ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return ours(path), ref


def embed(model, ps, pooling, **options):
    params = SamplingParams(max_tokens=10_000, pooling=pooling)  # max_tokens does not matter to an embed row
    engine, seqs = run_rows(model, ps, params, **options)
    assert engine.pool.num_used == 0  # every row's blocks went back
    return seqs


def reference(ref, p, pooling: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        h = ref(torch.tensor([p])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling.pooling]
    if pooling.dimensions:
        v = v[:pooling.dimensions]
    return F.normalize(v, dim=-1) if pooling.normalize else v


def prompts(n, seed=0, lo=3, hi=60, vocab=400):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_equals_transformers_pooled_chunked_and_batched(tiny, pooling):
    model, ref = tiny
    ps = prompts(6, seed=1) + [prompts(1, seed=2, lo=90, hi=90)[0]]  # the last one spans several 32-token chunks
    for normalize in (True, False):
        pp = PoolingParams(pooling, normalize)
        for seq, p in zip(embed(model, ps, pp, budget=32), ps):
            assert seq.finish_reason == "stop" and seq.num_output == 0 and seq.num_prompt == len(p)
            got = torch.tensor(seq.embedding)
            assert got.dtype == torch.float32 and got.shape == (model.config.hidden_size,)
            torch.testing.assert_close(got, reference(ref, p, pp), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_rows_sharing_a_cached_prefix(tiny, pooling):
    model, ref = tiny
    head = prompts(1, seed=3, lo=40, hi=40)[0]
    ps = [head + [5, 6, 7], head + [9, 10]]
    pp = PoolingParams(pooling)
    seqs = embed(model, ps, pp, max_num_seqs=1)  # one at a time: the second finds the first's blocks
    for seq, p in zip(seqs, ps):
        torch.testing.assert_close(torch.tensor(seq.embedding), reference(ref, p, pp), atol=1e-4, rtol=1e-4)
    # last pooling reads the cached prefix; mean and cls need every position computed in the row itself
    assert seqs[1].prefix_hit_tokens == (40 if pooling == "last" else 0)


def test_last_pooling_uses_the_prefix_cache_mean_does_not(tiny):
    model, _ = tiny
    head = prompts(1, seed=3, lo=40, hi=40)[0]
    ps = [head + [5, 6, 7], head + [9, 10]]
    hits = {}
    for pooling in ("last", "mean"):
        seqs = embed(model, ps, PoolingParams(pooling), max_num_seqs=1)
        hits[pooling] = seqs[1].prefix_hit_tokens
    assert hits == {"last": 40, "mean": 0}


def test_dimensions_truncate_then_renormalise(tiny):
    model, ref = tiny
    ps = prompts(3, seed=4)
    full = embed(model, ps, PoolingParams("mean", normalize=False))
    cut = embed(model, ps, PoolingParams("mean", dimensions=16))
    for f, c, p in zip(full, cut, ps):
        assert len(c.embedding) == 16
        torch.testing.assert_close(torch.tensor(c.embedding), F.normalize(torch.tensor(f.embedding[:16]), dim=-1))
        torch.testing.assert_close(torch.tensor(c.embedding), reference(ref, p, PoolingParams("mean", dimensions=16)),
                                   atol=1e-4, rtol=1e-4)


def test_embed_and_generate_rows_share_a_step(tiny):
    model, _ = tiny
    ps = prompts(4, seed=5)
    engine = Engine(model, [], EngineConfig(num_blocks=512, block_size=8))
    gen = [Sequence(i, list(p), SamplingParams(max_tokens=5)) for i, p in enumerate(ps)]
    emb = [Sequence(10 + i, list(p), SamplingParams(pooling=PoolingParams("mean"))) for i, p in enumerate(ps)]
    for s in gen + emb:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    alone = embed(model, ps, PoolingParams("mean"))
    assert all(s.num_output == 5 and s.embedding is None for s in gen)
    for s, a in zip(emb, alone):
        torch.testing.assert_close(torch.tensor(s.embedding), torch.tensor(a.embedding), atol=1e-5, rtol=1e-5)


def test_async_scheduling_gives_the_same_embeddings(tiny):
    model, _ = tiny
    ps = prompts(6, seed=8)
    engine = Engine(model, [], EngineConfig(num_blocks=512, block_size=8, async_scheduling=True,
                                            scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    gen = [Sequence(i, list(p), SamplingParams(max_tokens=4)) for i, p in enumerate(ps)]
    emb = [Sequence(10 + i, list(p), SamplingParams(pooling=PoolingParams("cls"))) for i, p in enumerate(ps)]
    for s in gen + emb:
        assert engine.add(s) is None
    while engine.has_work:
        engine.step()
    assert engine.pool.num_used == 0 and all(s.num_output == 4 for s in gen)
    for s, a in zip(emb, embed(model, ps, PoolingParams("cls"))):
        assert s.finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(s.embedding), torch.tensor(a.embedding), atol=1e-5, rtol=1e-5)


def test_recomputed_row_restarts_its_pooling(tiny):
    model, ref = tiny
    ps = prompts(8, seed=6, lo=50, hi=60)
    pp = PoolingParams("mean")
    # a pool too small for all rows' prompts at once: rows are preempted mid-prompt and recomputed
    seqs = embed(model, ps, pp, budget=96, prefill_chunk=16, num_blocks=24, preemption="recompute", caching=False)
    assert any(s.num_preemptions for s in seqs)
    for seq, p in zip(seqs, ps):
        torch.testing.assert_close(torch.tensor(seq.embedding), reference(ref, p, pp), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(shutil.which("g++") is None,
                    reason="batch invariance in bf16 rests on the native kernels (docs/design/determinism.md)")
def test_bf16_a_row_alone_equals_in_a_batch():
    model = determinism_model(torch.bfloat16)
    rng = random.Random(7)
    ps = [[rng.randrange(3, 384) for _ in range(rng.randint(3, 90))] for _ in range(8)]
    for pooling in ("last", "mean", "cls"):
        pp = PoolingParams(pooling)
        batched = embed(model, ps, pp, block_size=16, budget=64)  # chunked and batched
        for i in (0, 5):
            assert embed(model, [ps[i]], pp, block_size=16)[0].embedding == batched[i].embedding


def test_embed_prompt_fits_without_a_generated_token(tiny):
    model, _ = tiny
    engine = Engine(model, [], EngineConfig(num_blocks=512, block_size=8,
                                            scheduler=SchedulerConfig(max_model_len=16)))
    assert engine.add(Sequence(0, list(range(3, 19)), SamplingParams(pooling=PoolingParams()))) is None
    assert "at most 16" in str(engine.add(Sequence(1, list(range(3, 20)), SamplingParams(pooling=PoolingParams()))))
    assert engine.add(Sequence(2, list(range(3, 19)), SamplingParams())) is not None  # a generate row needs + 1


def test_bad_pooling_params_name_the_field():
    with pytest.raises(ValueError, match="pooling: must be one of"):
        SamplingParams(pooling=PoolingParams("max")).check()
    with pytest.raises(ValueError, match="dimensions"):
        SamplingParams(pooling=PoolingParams(dimensions=0)).check()
    with pytest.raises(ValueError, match="n, logprobs"):
        SamplingParams(n=2, pooling=PoolingParams()).check()
    with pytest.raises(ValueError, match="not per row"):
        SamplingParams.parse({"pooling": {"pooling": "mean"}})


# the job: --task embed through the CLI

from tests.job.test_resume import FAST, cli, start_job, wait_for_parts, write_jsonl  # noqa: E402
from batchjob.io.manifest import Manifest  # noqa: E402
from batchjob.io.parts import read_results  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def test_a_job_writes_the_embedding_column(tmp_path, llama_dir):
    from transformers import AutoModel
    import pyarrow as pa

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps"} for i in range(5)])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "embed", "--pooling", "mean",
        "--embed-prefix", "query: ", "--dtype", "float32", *FAST)
    table = read_results(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert set(table.column("generated_text").to_pylist()) == {""}
    assert set(table.column("finish_reason").to_pylist()) == {"stop"}
    assert set(table.column("completion_tokens").to_pylist()) == {0}
    from batchjob.models.loader import load_model as load

    tok = load(str(llama_dir)).tokenizer
    ref = AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for i, (emb, n) in enumerate(zip(table.column("embedding").to_pylist(), table.column("prompt_tokens").to_pylist())):
        ids = tok.encode_batch([f"query: The fox number {i} jumps"], add_special_tokens=True)[0]
        assert n == len(ids)
        torch.testing.assert_close(torch.tensor(emb), reference(ref, ids, PoolingParams("mean")), atol=1e-4, rtol=1e-4)


def test_the_model_folders_pooling_is_the_default(tmp_path, llama_dir):
    import json
    import shutil

    from batchjob.job.options.config import JobConfig
    from batchjob.job.rows.embed_task import resolve_pooling

    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                  "pooling_mode_mean_tokens": False}))
    assert resolve_pooling(JobConfig(task="embed"), folder).pooling == "cls"
    assert resolve_pooling(JobConfig(task="embed"), llama_dir).pooling == "last"
    assert resolve_pooling(JobConfig(task="embed", pooling="mean"), folder).pooling == "mean"  # the job's own wins


def test_an_embed_job_resumes_after_sigkill_exactly_once(tmp_path, llama_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps " * (1 + i % 7)} for i in range(400)])
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--model", llama_dir, "--input", src, "--task", "embed", "--pooling", "mean", "--part-rows", 10,
            "--max-num-seqs", 4, "--dtype", "float32", *FAST]
    cli("run", *args, "--output", ref)
    proc = start_job(*args, "--output", out)
    wait_for_parts(out, proc, parts=2)
    proc.kill()  # SIGKILL: no handler, no final commit
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 400
    cli("run", *args, "--output", out)
    got, want = read_results(out), read_results(ref)
    assert got.column("row_index").to_pylist() == list(range(400))  # each row exactly once
    for a, b in zip(got.column("embedding").to_pylist(), want.column("embedding").to_pylist()):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_a_changed_embed_option_is_another_job(tmp_path, llama_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c"}])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "embed", *FAST)
    text = cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "embed", "--dimensions", 8,
               *FAST, code=1)
    assert "params.task.dimensions: null -> 8" in text and "--restart" in text


@pytest.mark.parametrize("flags, says", [
    (["--task", "embed", "--chat"], "chat: not with task"),
    (["--task", "embed", "--logprobs", "2"], "logprobs: not with task"),
    (["--task", "embed", "--n", "2"], "n: not with task"),
    (["--task", "embed", "--regex", "a+"], "structured outputs: not with task"),
    (["--task", "embed", "--speculative", "ngram"], "speculative: not with task"),
    (["--pooling", "mean"], "pooling: applies to task = \"embed\" only"),
    (["--dimensions", "8"], "dimensions: applies to task"),
])
def test_bad_combinations_are_config_errors(tmp_path, llama_dir, flags, says):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c"}])
    text = cli("run", "--model", llama_dir, "--input", src, "--output", tmp_path / "out", *flags, *FAST, code=2)
    assert says in text


def test_messages_rows_are_refused_per_row(tmp_path, llama_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "a b"}])
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "embed", *FAST)
    table = read_results(out)
    assert table.column("finish_reason").to_pylist() == ["error", "stop"]
    assert "not chat messages" in table.column("error").to_pylist()[0]


# the Python API

def test_api_embed_equals_transformers(tiny_model_dir):
    from transformers import AutoModel

    import batchjob
    from batchjob.models.loader import load_model as load

    path = tiny_model_dir("qwen3", max_positions=1024)
    texts = ["the fox jumps", "a b c d e f", ""]
    results = batchjob.embed(texts, model=str(path), pooling="mean", dimensions=32, dtype="float32", kv_cache_gb=0.02)
    llm_results = batchjob.LLM(str(path), dtype="float32", kv_cache_gb=0.02).embed(texts[:2], pooling="mean", dimensions=32)
    tok = load(str(path)).tokenizer
    ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for r, l, text in zip(results, llm_results, texts):
        ids = tok.encode_batch([text], add_special_tokens=True)[0]
        assert r.finish_reason == "stop" and r.text == "" and r.prompt_tokens == len(ids) and len(r.embedding) == 32
        torch.testing.assert_close(torch.tensor(r.embedding), reference(ref, ids, PoolingParams("mean", dimensions=32)),
                                   atol=1e-4, rtol=1e-4)
        assert l.embedding == r.embedding
    assert results[2].finish_reason == "error" and results[2].embedding is None
    with pytest.raises(ValueError, match="pooling"):
        batchjob.embed(["x"], model=str(path), pooling="max", kv_cache_gb=0.02)
    with pytest.raises(ValueError, match="temperature: unknown keyword"):
        batchjob.embed(["x"], model=str(path), temperature=0.5)


# OpenAI Batch /v1/embeddings lines, and --truncate

def embeddings_line(cid, body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", **body}}


def test_openai_embeddings_in_and_out(tmp_path, llama_dir):
    import base64
    import json

    import numpy as np

    lines = [embeddings_line("one", {"input": "The fox jumps"}),
             embeddings_line("two", {"input": ["The fox jumps", "a b c d"], "encoding_format": "base64"}),
             embeddings_line("ids", {"input": [5, 6, 7], "dimensions": 16}),
             embeddings_line("bad", {"input": "x", "encoding_format": "int8"}),
             embeddings_line("long", {"input": ["short", "word " * 1500]})]
    src = write_jsonl(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "out"
    cli("run", "--model", llama_dir, "--input", src, "--output", out, "--task", "embed", "--dtype", "float32",
        "--output-format", "openai-batch", *FAST)
    got = {r["custom_id"]: r for r in (json.loads(x) for x in (out / "results.jsonl").read_text().splitlines())}
    alone = batchjob_embed(llama_dir, ["The fox jumps", "a b c d", [5, 6, 7]])
    one = got["one"]["response"]["body"]
    assert got["one"]["error"] is None and one["object"] == "list" and one["data"][0]["object"] == "embedding"
    assert one["data"][0]["embedding"] == pytest.approx(alone[0], abs=1e-6)
    two = got["two"]["response"]["body"]
    assert [d["index"] for d in two["data"]] == [0, 1]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in two["data"]]
    assert decoded[0] == pytest.approx(alone[0], abs=1e-6) and decoded[1] == pytest.approx(alone[1], abs=1e-6)
    assert two["usage"]["prompt_tokens"] == two["usage"]["total_tokens"] > one["usage"]["prompt_tokens"]
    vec = got["ids"]["response"]["body"]["data"][0]["embedding"]
    full = torch.tensor(alone[2])
    assert len(vec) == 16  # the request's dimensions: the first 16 of the unnormalised vector, renormalised
    assert abs(float(torch.tensor(vec).norm()) - 1) < 1e-5
    assert "encoding_format" in got["bad"]["error"]["message"]
    long = got["long"]["error"]["message"]  # found after the source read it: it names the line all the same
    assert long.startswith("requests.jsonl line 5: input[1]") and "at most" in long
    assert full.shape[0] == 64


def batchjob_embed(path, texts, **options):
    import batchjob

    return [r.embedding for r in batchjob.embed(texts, model=str(path), dtype="float32", kv_cache_gb=0.02, **options)]


def test_a_request_file_runs_one_kind_and_says_so_at_start(tmp_path, llama_dir):
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    src = write_jsonl(tmp_path / "requests.jsonl", [embeddings_line("e", {"input": "x"})])
    out = tmp_path / "out"
    text = cli("run", "--model", llama_dir, "--input", src, "--output", out, *FAST, code=1)
    assert "its lines are /v1/embeddings requests; run them with --task embed" in text and not out.exists()
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [embeddings_line("e", {"input": "x"}), chat])
    for task in ("generate", "embed"):
        text = cli("run", "--model", llama_dir, "--input", mixed, "--output", out, "--task", task, *FAST, code=1)
        assert "mixes /v1/embeddings lines (the first is row 0) with /v1/chat/completions or /v1/completions lines " \
               "(the first is row 1); a job runs one kind: split the file by `url`" in text and not out.exists()
    chats = write_jsonl(tmp_path / "chats.jsonl", [chat])
    text = cli("run", "--model", llama_dir, "--input", chats, "--output", out, "--task", "embed", *FAST, code=1)
    assert "run them without --task embed" in text


def test_request_lines_naming_another_model_are_answered_and_counted(tmp_path, llama_dir):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
             for i, name in enumerate(["gpt-4o-mini", "gpt-4o-mini", llama_dir.name, "other"])]
    src = write_jsonl(tmp_path / "requests.jsonl", lines)
    text = cli("run", "--model", llama_dir, "--input", src, "--output", tmp_path / "out", *FAST)
    assert (f"; 3 request lines named another model ('gpt-4o-mini', 'other'), answered by {llama_dir.name} -> "
            in text), text
    assert read_results(tmp_path / "out").column("error").null_count == 4  # answered all the same, as vLLM does


def test_truncate_keeps_the_first_tokens(tmp_path, llama_dir):
    from batchjob.models.loader import load_model as load

    text = "word " * 1500  # past the tiny model's 1024 positions
    ids = load(str(llama_dir)).tokenizer.encode_batch([text], add_special_tokens=True)[0]
    assert len(ids) > 1024
    kept = batchjob_embed(llama_dir, [text], truncate=True)[0]
    assert kept == pytest.approx(batchjob_embed(llama_dir, [ids[:1024]])[0], abs=1e-6)
    import batchjob

    failed = batchjob.embed([text], model=str(llama_dir), dtype="float32", kv_cache_gb=0.02)[0]
    assert failed.finish_reason == "error" and "at most 1024 fit" in failed.error
