"""The Python API (batchjob/api.py): generate() in memory and run() of a job, on the tiny local models;
the same text as the engine and as a real `batchjob run` of the same prompts."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from click.testing import CliRunner

import batchjob
from batchjob import api
from batchjob.cli.main import main
from batchjob.job.options.config import ConfigError, load_job
from batchjob.engine.params import SamplingParams
from batchjob.job.engine_setup import build_engine
from batchjob.job.options.resolved import ResolvedJob
from batchjob.job.options.keywords import api_message
from batchjob.models.loader import load_model

PROMPTS = ["The quick brown fox", "Batch inference reads rows", "def square(x: int) -> int:", "Hello & welcome"]
SMALL = {"dtype": "float32", "kv_cache_gb": 0.05}  # fp32 for exact comparisons; a small KV pool starts fast


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> api.LLM:
    return api.cached_llm(str(model_dir), **SMALL)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_parts(out: Path) -> list[dict]:
    tables = [ipc.open_file(p).read_all() for p in sorted(out.glob("part-*.arrow"))]
    return pa.concat_tables(tables).sort_by("row_index").to_pylist()


def test_plain_prompts_give_one_result_each_in_input_order(llm):
    results = llm.generate(PROMPTS, max_tokens=5)
    assert len(results) == len(PROMPTS)
    for prompt, r in zip(PROMPTS, results):
        assert isinstance(r, batchjob.Result) and r.error is None
        assert r.finish_reason in ("stop", "length") and 1 <= r.completion_tokens <= 5
        assert r.prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert len(r.token_ids) == r.completion_tokens and r.text == llm.tokenizer.decode(list(r.token_ids))
        assert r.logprobs is None and r.completions is None
    # a single prompt is a list of one, the same as that prompt in a batch (greedy: any row gives it)
    assert llm.generate(PROMPTS[2], max_tokens=5) == [results[2]]
    assert llm.generate(PROMPTS[::-1], max_tokens=5) == results[::-1]


def test_greedy_text_is_the_engines(llm, model_dir):
    loaded = load_model(str(model_dir), dtype=torch.float32)
    engine = build_engine(ResolvedJob.of(load_job(None, {"input": "x", "device": "cpu", **SMALL})), loaded)
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    seqs = engine.generate(ids, SamplingParams(max_tokens=7))
    results = llm.generate(PROMPTS, max_tokens=7)
    assert [r.token_ids for r in results] == [tuple(s.output_ids) for s in seqs]
    assert [r.finish_reason for r in results] == [s.finish_reason for s in seqs]


def test_token_id_prompts_are_used_as_they_are(llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    by_text = llm.generate(PROMPTS, max_tokens=4)
    assert llm.generate(ids, max_tokens=4) == by_text
    assert llm.generate(ids[1], max_tokens=4) == [by_text[1]]  # one list of ints is one prompt
    assert llm.generate([{"prompt_token_ids": ids[0]}, {"prompt": ids[3]}], max_tokens=4) == [by_text[0], by_text[3]]


def test_chat_messages_are_rendered_with_the_models_template(llm):
    tok = llm.tokenizer
    conversation = [{"role": "user", "content": "Hello & welcome"}]
    rendered = tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=True), add_special_tokens=False)
    [r] = llm.generate(conversation, max_tokens=4)  # one conversation is one prompt
    assert r.error is None and r.prompt_tokens == len(rendered)
    # chat=True wraps a plain prompt as a user message: the same prompt, the same text
    assert llm.generate(["Hello & welcome"], chat=True, max_tokens=4) == [r]
    assert llm.generate([{"messages": conversation}], max_tokens=4) == [r]
    assert llm.generate([tuple(rendered)], max_tokens=4)[0].text == r.text
    [with_system] = llm.generate([conversation], system_prompt="Be brief.", max_tokens=4)
    system = [{"role": "system", "content": "Be brief."}, *conversation]
    assert with_system.prompt_tokens == len(tok.encode(tok.apply_chat_template(system), add_special_tokens=False))
    # a template given as text (or a file, as in a job) replaces the model's
    [plain] = llm.generate(conversation, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", max_tokens=4)
    assert plain.prompt_tokens == len(tok.encode("Hello & welcome", add_special_tokens=False))
    with pytest.raises(ValueError, match="chat_template"):
        llm.generate(conversation, chat_template="{% for m in messages %}")


def test_n_completions_each_with_its_own_stream(llm):
    [r] = llm.generate(PROMPTS[0], n=3, temperature=1.0, seed=1, max_tokens=6)
    assert r.completions is not None and [c.index for c in r.completions] == [0, 1, 2]
    first = r.completions[0]
    assert (first.text, first.finish_reason, first.token_ids) == (r.text, r.finish_reason, r.token_ids)
    assert r.completion_tokens == sum(c.completion_tokens for c in r.completions)
    assert len({c.token_ids for c in r.completions}) > 1
    assert llm.generate(PROMPTS[0], n=3, temperature=1.0, seed=1, max_tokens=6) == [r]  # seeded: the same again
    [greedy] = llm.generate(PROMPTS[0], n=2, max_tokens=6)
    assert greedy.completions[0].text == greedy.completions[1].text


def test_logprobs_per_generated_token(llm):
    [r] = llm.generate(PROMPTS[1], logprobs=2, max_tokens=5)
    assert len(r.logprobs) == r.completion_tokens
    for entry, token_id in zip(r.logprobs, r.token_ids):
        assert entry["token_id"] == token_id and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token_id"] == token_id  # greedy: the best
        assert entry["token"] == llm.tokenizer.decode([token_id], skip_special_tokens=False)


def test_a_bad_prompt_is_its_own_result_and_the_others_run(llm):
    good = llm.generate(PROMPTS[0], max_tokens=4)[0]
    prompts = [PROMPTS[0], "", "word " * 300, [], {"prompt": PROMPTS[0], "top_p": 1.5}, 42, [99999], PROMPTS[0],
               [{"role": "user"}]]
    results = llm.generate(prompts, max_tokens=4)
    assert len(results) == len(prompts)
    assert results[0] == good and results[7] == good
    bad = {i: r.error for i, r in enumerate(results) if r.finish_reason == "error"}
    assert set(bad) == {1, 2, 3, 4, 5, 6, 8}
    assert "empty" in bad[1] and "context" in bad[2] and results[2].prompt_tokens == len(llm.tokenizer.encode(prompts[2]))
    assert "empty" in bad[3] and "top_p" in bad[4] and "int" in bad[5] and "99999" in bad[6] and "content" in bad[8]
    assert all(results[i].text == "" and results[i].completion_tokens == 0 for i in bad)


def test_bad_arguments_raise_value_error_naming_them(llm, model_dir):
    with pytest.raises(ValueError, match="max_token"):
        llm.generate(PROMPTS, max_token=3)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(PROMPTS, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPTS, top_p=2.0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(PROMPTS, max_num_seqs=4)  # an engine knob belongs to LLM(), not to its generate()
    with pytest.raises(ValueError, match="dtype"):
        batchjob.generate(PROMPTS, model=str(model_dir), dtype="float64")
    with pytest.raises(ValueError, match="input"):
        batchjob.generate(PROMPTS, model=str(model_dir), input="x.jsonl")  # a job field, not a generate() one
    with pytest.raises(ValueError, match="colour"):
        llm.generate([{"prompt": "x", "colour": "red"}])
    with pytest.raises(ValueError, match="bogus"):
        api.LLM(str(model_dir), bogus=1)


def test_sampled_text_is_what_batchjob_run_writes_for_the_row(tmp_path, llm, model_dir):
    rows = [{"prompt": p} for p in PROMPTS * 2] + [{"prompt": PROMPTS[0], "seed": 5}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    sampling = {"temperature": 0.9, "seed": 7, "max_tokens": 8, "n": 2, "logprobs": 1, "stop": ["e"]}
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--no-progress", "--dtype", "float32",
            "--kv-cache-gb", 0.05, *[x for k, v in sampling.items() for x in (f"--{k.replace('_', '-')}", json.dumps(v))]]
    done = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    written = read_parts(out)
    results = llm.generate(rows, **sampling)
    assert len({r.text for r in results[:4]}) > 1  # sampled, not all alike
    for row, r in zip(written, results):
        assert (row["generated_text"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"]) == \
               (r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens)
        assert [c["text"] for c in row["completions"]] == [c.text for c in r.completions]
        assert [e["token_id"] for e in row["logprobs"]] == [e["token_id"] for e in r.logprobs]


def test_run_a_dict_and_a_file_return_the_summary(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS] + [{"prompt": ""}])
    job = {"model": str(model_dir), "input": str(src), "output": str(tmp_path / "a"), "seed": 3, "progress": False,
           "sampling": {"max_tokens": 5, "temperature": 0.8}, "engine": SMALL}
    summary = batchjob.run(job)
    assert (summary.rows, summary.errors, summary.output) == (5, 1, str(tmp_path / "a"))
    assert summary.generated_tokens == sum(r["completion_tokens"] for r in read_parts(tmp_path / "a"))
    toml = tmp_path / "job.toml"
    toml.write_text(f'model = "{model_dir}"\ninput = "{src}"\nseed = 3\nprogress = false\n'
                    '[sampling]\nmax_tokens = 5\ntemperature = 0.8\n[engine]\ndtype = "float32"\nkv_cache_gb = 0.05\n')
    from_file = batchjob.run(toml, output=str(tmp_path / "b"))  # an override wins over the file
    assert (from_file.rows, from_file.errors, from_file.output) == (5, 1, str(tmp_path / "b"))
    assert read_parts(tmp_path / "a") == read_parts(tmp_path / "b")
    again = batchjob.run(job)  # committed: nothing to do, as with `batchjob run`
    assert again.rows == 0
    assert batchjob.run(job, restart=True).rows == 5
    with pytest.raises(ConfigError, match="temprature"):
        batchjob.run(job, temprature=1.0)
    with pytest.raises(ConfigError, match="sampling.temprature"):
        batchjob.run({**job, "sampling": {"temprature": 1.0}})
    with pytest.raises(ConfigError, match="top_p"):
        batchjob.run(job, top_p=3.0)
    with pytest.raises(ConfigError, match="not found"):
        batchjob.run(tmp_path / "missing.toml")


def test_a_second_generate_with_the_same_model_does_not_load_it_again(model_dir, monkeypatch):
    api.clear_cache()
    loads = []
    from batchjob.job.options import resolved  # the one place a job or an LLM loads its model

    real = resolved.load_model
    monkeypatch.setattr(resolved, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    first = batchjob.generate(PROMPTS[:2], model=str(model_dir), max_tokens=3, **SMALL)
    llm = api.cached_llm(str(model_dir), **SMALL)
    second = batchjob.generate(PROMPTS[:2], model=str(model_dir), max_tokens=3, temperature=0.5, **SMALL)
    assert len(loads) == 1 and api.cached_llm(str(model_dir), **SMALL) is llm
    assert batchjob.generate(PROMPTS[:2], model=str(model_dir), max_tokens=3, **SMALL) == first
    api.cached_llm(str(model_dir), max_num_seqs=8, **SMALL)  # other engine knobs: another engine
    assert len(loads) == 2 and api.cached_llm(str(model_dir), **SMALL) is llm


def test_a_call_stopped_midway_leaves_nothing_behind_for_the_next(model_dir, monkeypatch):
    llm = api.LLM(str(model_dir), **SMALL)
    expected = llm.generate(PROMPTS, max_tokens=6, stop="[")  # a stop string is a string, even one like "["
    steps = []

    def interrupted():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, max_tokens=6, stop="[")
    assert llm.generate(PROMPTS, max_tokens=6, stop="[") == expected  # a fresh engine: no leftover rows


def test_importing_batchjob_does_not_import_torch():
    code = "import sys, batchjob; assert 'torch' not in sys.modules; assert 'generate' in dir(batchjob)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert batchjob.generate is api.generate and batchjob.run is api.run and batchjob.LLM is api.LLM


def test_plain_prompts_that_end_at_their_first_token_warn_that_the_model_wants_chat(llm, model_dir):
    every_token = list(range(llm.tokenizer.vocab_size))  # whatever comes first ends the prompt: an instruct model's EOS
    with pytest.warns(batchjob.ChatHintWarning, match=r"4 of 4 prompts ended at their first token.*chat=True") as caught:
        results = llm.generate(PROMPTS, stop_token_ids=every_token, max_tokens=4)
    assert [r.completion_tokens for r in results] == [1] * 4
    assert caught[0].filename == __file__  # the warning names the caller's line, not batchjob's
    with pytest.warns(batchjob.ChatHintWarning, match="1 of 1 prompts"):
        batchjob.generate(PROMPTS[0], model=str(model_dir), stop_token_ids=every_token, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", batchjob.ChatHintWarning)  # chat input: nothing to say
        llm.generate(PROMPTS, chat=True, stop_token_ids=every_token, max_tokens=4)
        llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], stop_token_ids=every_token, max_tokens=4)
        llm.generate(PROMPTS, max_tokens=4)  # text that goes on
        llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], stop_token_ids=every_token)  # ids: maybe chat already


def test_chat_takes_conversations_as_vllm_does(llm, model_dir):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    results = llm.chat(conversations, max_tokens=5)
    assert results == llm.generate(conversations, max_tokens=5) == llm.generate(PROMPTS[:3], chat=True, max_tokens=5)
    assert llm.chat(conversations[1], max_tokens=5) == [results[1]]  # one conversation is a list of one
    assert batchjob.chat(conversations, model=str(model_dir), max_tokens=5, **SMALL) == results
    [with_system] = llm.chat(conversations[0], system_prompt="Be brief.", max_tokens=5)
    assert [with_system] == llm.generate([conversations[0]], system_prompt="Be brief.", max_tokens=5)
    assert with_system.prompt_tokens != results[0].prompt_tokens
    mixed = llm.chat([conversations[0], "not a conversation", []], max_tokens=5)
    assert mixed[0] == results[0] and [r.error for r in mixed[1:]] == [
        "conversation 1: expected a non-empty list of {role, content} messages, got str",
        "conversation 2: expected a non-empty list of {role, content} messages, got list"]
    with pytest.raises(ValueError, match="chat: unknown keyword argument to chat"):
        llm.chat(conversations, chat=True)


def test_the_errors_a_caller_catches_are_exported_without_importing_torch(tmp_path, model_dir):
    code = ("import sys, batchjob\n"
            "from batchjob import ConfigError, ChatHintWarning, SourceError, SinkError, TooManyErrors, AllRowsFailed\n"
            "assert 'torch' not in sys.modules\n"
            "assert issubclass(ConfigError, ValueError) and issubclass(ChatHintWarning, UserWarning)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    from batchjob.engine.worker.kv_budget import KvBudgetError
    from batchjob.io.sources import SourceError
    from batchjob.job.error_budget import TooManyErrors
    from batchjob.kernels import KernelError
    from batchjob.models.loader import ModelLoadError

    assert (batchjob.ConfigError, batchjob.SourceError, batchjob.ModelLoadError, batchjob.KernelError,
            batchjob.TooManyErrors, batchjob.KvBudgetError) == (ConfigError, SourceError, ModelLoadError, KernelError,
                                                               TooManyErrors, KvBudgetError)
    assert {"ConfigError", "SourceError", "ModelLoadError", "KernelError", "TooManyErrors", "chat"} <= set(dir(batchjob))
    with pytest.raises(batchjob.ModelLoadError):
        batchjob.LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(batchjob.SourceError, match=r"input not found: .*none\.jsonl \(input\)"):
        batchjob.run({"model": str(model_dir), "input": str(tmp_path / "none.jsonl"), "output": str(tmp_path / "out")})
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ""}, {"prompt": ""}])
    with pytest.raises(batchjob.TooManyErrors, match="every row failed"):
        batchjob.run({"model": str(model_dir), "input": str(src), "output": str(tmp_path / "bad"), "progress": False,
                      "engine": SMALL})


def test_api_messages_name_keyword_arguments_not_flags_or_columns(llm, model_dir):
    results = llm.generate(["", {"prompt": 3}, [{"role": "user"}], {"prompt": "x", "sampling": "{"}])
    assert [r.error.split(":")[0] for r in results] == ["prompt is empty", "prompt", "messages", "sampling"]
    assert not any("column '" in r.error for r in results)  # `batchjob run` says: column 'prompt' is empty
    with pytest.raises(batchjob.KernelError) as raised:
        batchjob.LLM(str(model_dir), kernels="triton", **SMALL)  # no Triton on this CPU
    assert "use kernels='auto' or 'torch'" in str(raised.value) and "--" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"draft_model=PATH"):
        batchjob.LLM(str(model_dir), speculative="draft")
    with pytest.raises(ConfigError, match=r"temprature: unknown keyword argument to generate\(\) \(did you mean 'temperature'\?\)"):
        batchjob.generate("x", model=str(model_dir), temprature=0.5)
    with pytest.raises(ConfigError, match=r"input: no input given; pass input=PATH"):
        batchjob.run({"model": str(model_dir)})
    assert api_message("raise --gpu-memory-utilization or lower --max-num-seqs; rerun with --restart to start "
                           "over; pip install --no-deps x; --no-prefix-caching") == (
        "raise gpu_memory_utilization or lower max_num_seqs; rerun with restart=True to start over; "
        "pip install --no-deps x; prefix_caching=False")


def test_run_reports_every_unknown_field_with_what_it_probably_meant(tmp_path, model_dir):
    job = {"model": str(model_dir), "input": "x.jsonl", "temperatur": 1, "engine": {"max_tokens": 3, "max_num_seq": 2}}
    with pytest.raises(ConfigError) as raised:
        batchjob.run(job)
    assert str(raised.value) == ("run(): unknown field 'temperatur' (did you mean 'temperature'?); [engine] max_tokens: "
                                 "belongs in [sampling] (or at the top level), not in [engine]; unknown field "
                                 "'engine.max_num_seq' (did you mean 'max_num_seqs'?)")
    with pytest.raises(ConfigError, match=r"unknown field 'max_token' \(did you mean 'max_tokens'\?\)"):
        batchjob.run(job, max_token=3)


def test_help_of_generate_says_what_it_takes_returns_and_raises():
    doc = batchjob.generate.__doc__
    for said in ("a string", "a list of token ids", "a conversation", "a dict of a job row's fields", "max_tokens",
                 "temperature", "stop_token_ids", "chat_template", "max_num_seqs", "kv_cache_dtype", "max_model_len",
                 "Returns one Result per prompt", "Raises ConfigError", "ModelLoadError", "ChatHintWarning"):
        assert said in doc, said
    assert "conversation" in batchjob.LLM.chat.__doc__ and "conversation" in batchjob.chat.__doc__


def test_the_ray_data_stage_runs_batches_given_at_once_in_shared_steps(tiny_model_dir):
    """LLMStage called from several threads at once (Ray Data's max_concurrency): the batches share the engine's
    steps, and each batch's text equals a generate() of that batch alone (a row's random stream is its place in its
    own batch); other columns come back as they were."""
    import threading

    import numpy as np

    model = str(tiny_model_dir("llama"))
    options = dict(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
    stage = batchjob.LLMStage(model, engine={"max_num_seqs": 32, "kv_cache_gb": 0.05}, **options)
    batches = [{"id": np.array([f"b{b}r{i}" for i in range(8)]),
                "prompt": np.array([f"Batch {b} row {i}: the quick brown fox" for i in range(8)])} for b in range(3)]
    engine, seen = stage.llm.engine, []
    step = engine.run_step

    def counted():
        out = step()
        if engine.last_step is not None:
            seen.append(len(engine.last_step.seqs))
        return out

    engine.run_step = counted
    got: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda b=b: got.__setitem__(b, stage(batches[b]))) for b in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    alone = batchjob.LLM(model, max_num_seqs=32, kv_cache_gb=0.05)
    for b, batch in enumerate(batches):
        want = alone.generate([{"prompt": str(p)} for p in batch["prompt"]], **options)
        assert got[b]["generated_text"] == [r.text for r in want], b
        assert list(got[b]["id"]) == list(batch["id"]) and got[b]["error"] == [None] * 8
    assert max(seen) > 8  # rows of more than one batch in one step


# the job options the API has no keyword for: `model` is LLM()'s first argument and `task` its call (generate, embed,
# score); the rest name files, columns and the run of a job (run() takes them all)
NOT_KEYWORDS = {"model", "task", "input", "input_format", "output", "output_format", "part_rows", "part_seconds",
                "part_format", "keep_columns", "id_column", "prompt_column", "messages_column", "image_column",
                "continuation_column", "lora_column", "lanes", "lane_column", "progress", "log_every", "limit",
                "drain_timeout", "max_errors", "shard", "data_parallel"}  # a job's (batchjob.run takes them), not a call's


def test_every_per_job_option_is_a_keyword_of_the_api_from_the_one_options_table():
    from batchjob.job.options.options import OPTIONS, Api, api_keywords

    assert {name for name, o in OPTIONS.items() if not o.api} == NOT_KEYWORDS
    assert set(api.LLM_KEYWORDS) == set(OPTIONS) - NOT_KEYWORDS | {"structured_outputs", "lora"}
    assert set(api.GENERATE_KEYWORDS) == set(api_keywords(Api.SAMPLING, Api.CHAT)) | {"structured_outputs", "lora"}
    assert set(api.CHAT_KEYWORDS) == set(api.GENERATE_KEYWORDS) - {"chat"}  # a conversation is a chat already
    for name in ("reasoning_parser", "tool_parser", "chat_template_kwargs", "limit_images_per_prompt",
                 "max_reasoning_tokens"):
        assert name in api.CHAT_KEYWORDS and name in api.LLM_KEYWORDS


def test_call_options_given_to_llm_are_the_defaults_of_the_calls_that_take_them(model_dir):
    llm = api.LLM(str(model_dir), max_tokens=3, pooling="mean", **SMALL)
    assert all(r.completion_tokens <= 3 for r in llm.generate(PROMPTS))  # a generate() default
    assert all(r.completion_tokens <= 3 for r in llm.chat([{"role": "user", "content": "hi"}]))
    assert llm.generate(PROMPTS[0], max_tokens=5)[0].completion_tokens == 5  # a call's own keyword wins
    assert llm.embed(PROMPTS[:1]) == llm.embed(PROMPTS[:1], pooling="mean") != llm.embed(PROMPTS[:1], pooling="last")
    with pytest.raises(ConfigError, match="reasoning_parser 'nope' is unknown"):
        api.LLM(str(model_dir), reasoning_parser="nope", **SMALL)  # checked when the LLM is made, not at a call
    with pytest.raises(ConfigError, match=r"chat_template_kwargs: the prompts are plain prompts.*chat=True"):
        llm.generate(PROMPTS, chat_template_kwargs={"enable_thinking": False})
    assert llm.generate(PROMPTS[0], chat=True, chat_template_kwargs={"x": 1}, max_tokens=2)[0].error is None
    [row] = llm.generate({"prompt": "x", "chat_template_kwargs": {"x": 1}}, max_tokens=2)
    assert row.error.startswith("chat_template_kwargs: this row is a plain prompt, which no chat template renders") \
        and "chat=True" in row.error
