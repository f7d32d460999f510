"""OpenAI Batch JSONL: detection by the first lines, request lines -> records (field mapping, per-line
errors, duplicate custom_ids), and a whole file through `batchjob run` to a response file that parses
line by line and an errors file (where a line without a custom_id goes, and only there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.openai_batch import CHAT, COMPLETIONS, openai_batch_lines, request_record
from batchjob.io.parts import read_results
from batchjob.io.sources import JsonlSource, OpenAIBatchSource, open_source


def chat_line(cid: str, content="Hello there", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def completion_line(cid: str, prompt="The quick brown fox", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"model": "tiny", "prompt": prompt, **body}}


def test_body_fields_map_to_sampling_parameters():
    r = request_record(chat_line("a", max_completion_tokens=9, max_tokens=100, temperature=0.5, top_p=0.9, stop="END",
                                 n=2, seed=3, logprobs=True, top_logprobs=4, presence_penalty=0.1, frequency_penalty=0.2,
                                 top_k=7, stream=False, user="u"))
    assert r["endpoint"] == CHAT and r["prompt"] is None and r["messages"] == [{"role": "user", "content": "Hello there"}]
    assert r["sampling"] == {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": "END", "n": 2, "seed": 3,
                             "logprobs": 4, "presence_penalty": 0.1, "frequency_penalty": 0.2, "top_k": 7}
    assert request_record(chat_line("a", logprobs=True))["sampling"] == {"logprobs": 0}
    r = request_record(completion_line("b", max_tokens=5, logprobs=2, stop=["\n", "."]))
    assert r["prompt"] == "The quick brown fox" and r["sampling"] == {"max_tokens": 5, "logprobs": 2, "stop": ["\n", "."]}
    assert request_record(completion_line("c", prompt=[5, 6, 7]))["prompt"] == [5, 6, 7]
    assert request_record(completion_line("c", prompt=["one"]))["prompt"] == "one"
    parts = chat_line("d")
    parts["body"]["messages"] = [{"role": "developer", "content": "Be kind."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert request_record(parts)["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize("line, field", [
    ({"method": "POST", "url": CHAT, "body": {}}, "custom_id"),
    ({**chat_line("x"), "method": "GET"}, "method"),
    ({**chat_line("x"), "url": "/v1/rerank"}, "url"),
    ({**chat_line("x"), "url": "/v1/embeddings"}, "body.messages: not supported by batchjob for /v1/embeddings"),
    ({**chat_line("x"), "url": "/v1/embeddings", "body": {"input": []}}, "body.input"),
    ({k: v for k, v in chat_line("x").items() if k != "body"}, "body"),
    (chat_line("x", top_logprobs=3), "top_logprobs"),
    (chat_line("x", functions=[{"name": "f"}]), "body.functions"),  # the legacy name of tools
    (chat_line("x", stream=True), "body.stream"),
    (completion_line("x", prompt=["a", "b"]), "body.prompt"),
    (completion_line("x", echo=True), "body.echo"),
    ({**chat_line("x"), "body": {"messages": []}}, "body.messages"),
    ({**chat_line("x"), "body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}}, "content"),
    ([1, 2], "JSON object"),
])
def test_bad_request_lines_name_the_field(line, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        request_record(line)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_detection_duplicates_and_errors_keep_the_custom_id(tmp_path):
    src = write_lines(tmp_path / "batch.jsonl", [
        "{oops", chat_line("a"), completion_line("b"), chat_line("a"), {"custom_id": "c", "method": "POST", "url": "/v1/x", "body": {}},
        completion_line("b"), "", completion_line("d"),
    ])
    source = open_source(src)  # the first line does not parse: detection looks at the first line that does
    assert isinstance(source, OpenAIBatchSource) and source.num_rows == 7
    rows = list(source.rows())
    assert [r.row_index for r in rows] == list(range(7))
    assert "invalid JSON" in rows[0].error and rows[0].record is None
    assert rows[1].error is None and rows[2].error is None and rows[6].error is None
    assert "duplicate custom_id 'a'" in rows[3].error and "row 1" in rows[3].error and rows[3].record["custom_id"] == "a"
    assert "url" in rows[4].error and rows[4].record == {"custom_id": "c", "endpoint": None}
    assert "duplicate custom_id 'b'" in rows[5].error
    from batchjob.io.ranges import RowRanges

    resumed = list(source.rows(skip=RowRanges([(0, 3)])))  # the first use was committed: the repeat still fails
    assert "duplicate" in resumed[0].error
    plain = write_lines(tmp_path / "plain.jsonl", [{"prompt": "x", "custom_id": "a"}])
    assert type(open_source(plain)) is JsonlSource
    assert isinstance(open_source(plain, input_format="openai-batch"), OpenAIBatchSource)


def misspelt_custom_id(cid: str) -> dict:
    """A chat request whose custom_id is misspelt as `invalid_field` (issue 21)."""
    return {"invalid_field": cid, **{k: v for k, v in chat_line(cid).items() if k != "custom_id"}}


def test_detection_reads_the_first_lines_so_a_bad_first_line_is_that_rows_error(tmp_path):
    src = write_lines(tmp_path / "batch.jsonl", [misspelt_custom_id("req-1"), chat_line("req-2"), completion_line("req-3")])
    source = open_source(src)  # detected by the first 20 lines, not by line 1 alone
    assert isinstance(source, OpenAIBatchSource) and source.num_rows == 3
    rows = list(source.rows())
    assert rows[0].record == {"custom_id": None, "endpoint": CHAT}
    assert rows[0].error.startswith("batch.jsonl line 1: custom_id: missing (the line has 'invalid_field' instead?)")
    assert [r.error for r in rows[1:]] == [None, None] and rows[2].record["prompt"] == "The quick brown fox"
    alone = write_lines(tmp_path / "alone.jsonl", [misspelt_custom_id("req-1")])  # three of the four fields
    assert isinstance(open_source(alone), OpenAIBatchSource)
    # plain files stay plain: a stray request-like line among prompts, or url and body without the rest
    stray = write_lines(tmp_path / "stray.jsonl", [chat_line("a"), {"prompt": "x"}, {"prompt": "y"}])
    assert type(open_source(stray)) is JsonlSource
    web = write_lines(tmp_path / "web.jsonl", [{"url": "https://example.com", "body": "<p>hi</p>", "prompt": "Sum up"}])
    assert type(open_source(web)) is JsonlSource
    with pytest.raises(ValueError, match=r"custom_id: a non-empty string is required, got 7"):
        request_record({**chat_line("x"), "custom_id": 7})


def test_a_line_without_custom_id_goes_to_the_errors_file_only(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    src = write_lines(tmp_path / "batch.jsonl", [misspelt_custom_id("req-1"), chat_line("req-2", max_tokens=3),
                                                 completion_line("req-3", max_tokens=3)])
    runner = CliRunner()
    for name, extra in (("detected", []), ("named", ["--input-format", "openai-batch"])):
        out = tmp_path / name
        r = runner.invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(out),
                                 "--output-format", "openai-batch", "--no-progress", *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        results = read_jsonl(out / "results.jsonl")  # never a null custom_id in the response file
        assert [x["custom_id"] for x in results] == ["req-2", "req-3"] and all(x["response"] for x in results)
        failed = read_jsonl(out / "errors.jsonl")
        assert len(failed) == 1 and failed[0]["custom_id"] is None and failed[0]["response"] is None
        assert failed[0]["id"].startswith("batch_req_") and failed[0]["error"]["code"] == "invalid_request"
        assert failed[0]["error"]["message"].startswith("batch.jsonl line 1: custom_id: missing") and \
            "invalid_field" in failed[0]["error"]["message"]

    to = tmp_path / "exported" / "responses.jsonl"  # export writes the errors beside --to
    r = runner.invoke(main, ["export", str(out), "--format", "openai-batch", "--to", str(to)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    errors_to = tmp_path / "exported" / "responses.errors.jsonl"
    assert r.output.strip() == f"batchjob: 2 response lines -> {to}; failed requests (1) -> {errors_to}"
    assert [x["custom_id"] for x in read_jsonl(to)] == ["req-2", "req-3"] and read_jsonl(errors_to) == failed


def check_response_line(line: dict, request: dict | None) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_")
    if line["error"] is not None:
        assert line["response"] is None and set(line["error"]) == {"code", "message"}
        return
    resp = line["response"]
    assert resp["status_code"] == 200 and resp["request_id"]
    body = resp["body"]
    chat = request["url"] == CHAT
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-") and isinstance(body["created"], int) and body["model"]
    n = request["body"].get("n", 1)
    assert [c["index"] for c in body["choices"]] == list(range(n))
    want_lp = request["body"].get("logprobs")
    for c in body["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        if chat:
            assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
            if want_lp:
                top = request["body"].get("top_logprobs", 0)
                assert c["logprobs"]["content"] and all(len(t["top_logprobs"]) == top and t["bytes"] == list(t["token"].encode())
                                                        for t in c["logprobs"]["content"])
        else:
            assert isinstance(c["text"], str)
            if want_lp is not None:
                lp = c["logprobs"]
                assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        if not want_lp and want_lp != 0:
            assert c["logprobs"] is None
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= n


def test_openai_batch_file_runs_to_a_response_file(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    requests = [
        chat_line("chat-1", max_tokens=6, temperature=0.8, n=2, seed=5, logprobs=True, top_logprobs=2),
        completion_line("cmpl-1", max_tokens=5, logprobs=1),
        "{not json",
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/images/generations", "body": {"prompt": "x"}},
        {"custom_id": "no-body", "method": "POST", "url": COMPLETIONS},
        chat_line("chat-1", content="again"),
        completion_line("bad-temp", temperature="hot"),
        chat_line("chat-2", max_completion_tokens=4, stop=["\n"]),
        completion_line("cmpl-2", prompt=[5, 6, 7, 8], max_tokens=3, seed=1, temperature=1.0),
        completion_line("too-long", prompt="word " * 3000),
    ]
    src = write_lines(tmp_path / "batch.jsonl", requests)
    out = tmp_path / "out"
    # capped below the model's context: "too long" is said of max_model_len, and its code is still the data's
    args = ["run", "--model", str(model), "--input", str(src), "--output", str(out), "--max-tokens", "8",
            "--max-model-len", "512", "--output-format", "openai-batch", "--no-progress"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "10 rows (6 errors)" in r.output
    table = read_results(out).to_pylist()  # the Arrow rows carry each error's code beside its message
    assert [(x["custom_id"], x["error_code"]) for x in table if x["error"]] == [
        (None, "invalid_request"), ("bad-url", "invalid_request"), ("no-body", "invalid_request"),
        ("chat-1", "invalid_request"), ("bad-temp", "invalid_request"), ("too-long", "context_length_exceeded")]
    assert all(x["error_code"] is None for x in table if not x["error"])
    lines = read_jsonl(out / "results.jsonl")  # every line with a custom_id: the one that is not JSON has none
    assert [x["custom_id"] for x in lines] == ["chat-1", "cmpl-1", "bad-url", "no-body", "chat-1", "bad-temp",
                                               "chat-2", "cmpl-2", "too-long"]
    for line, req in zip(lines, [x for x in requests if isinstance(x, dict)]):
        check_response_line(line, req)
    ok = [i for i, x in enumerate(lines) if x["error"] is None]
    assert ok == [0, 1, 6, 7]
    failed = read_jsonl(out / "errors.jsonl")  # every failed line, in input order
    assert [x["custom_id"] for x in failed] == [None, "bad-url", "no-body", "chat-1", "bad-temp", "too-long"]
    assert failed[1:] == [x for x in lines if x["error"]]
    assert "invalid JSON" in failed[0]["error"]["message"] and "line 3" in failed[0]["error"]["message"]
    errors = {x["custom_id"]: x["error"] for x in lines if x["error"]}
    assert "url" in errors["bad-url"]["message"] and "body" in errors["no-body"]["message"]
    assert "duplicate custom_id" in lines[4]["error"]["message"] and "temperature" in errors["bad-temp"]["message"]
    assert errors["too-long"]["code"] == "context_length_exceeded" and errors["bad-url"]["code"] == "invalid_request"
    choices = lines[0]["response"]["body"]["choices"]
    assert len(choices) == 2 and choices[0]["message"]["content"] != choices[1]["message"]["content"]
    assert lines[6]["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert lines[7]["response"]["body"]["usage"]["prompt_tokens"] == 4

    # the export path gives the same lines from the Arrow output; a rerun commits nothing new
    table = read_results(out)
    assert {"custom_id", "endpoint", "logprobs", "completions"} <= set(table.schema.names)
    created = lines[0]["response"]["body"]["created"]
    again = [json.loads(x) for x in openai_batch_lines(table, model=lines[0]["response"]["body"]["model"], created=created)]
    assert [x for x in again if x["custom_id"]] == lines and [x for x in again if x["error"]] == failed
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0 and "0 rows" in r.output
    rerun = read_jsonl(out / "results.jsonl")
    for a, b in zip(rerun, lines):
        if a["response"]:
            a["response"]["body"]["created"] = created
    assert rerun == lines and read_jsonl(out / "errors.jsonl") == failed


def test_plain_rows_as_openai_completions(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "Hello fox"}, {"prompt": ""}])
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(out),
                                  "--max-tokens", "3", "--output-format", "openai-batch", "--no-progress"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["row-0", "row-1"]
    assert lines[0]["response"]["body"]["object"] == "text_completion" and lines[1]["error"]["code"] == "invalid_request"


def test_export_openai_batch_from_one_folder_and_from_shards(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    requests = [chat_line(f"c{i}", max_tokens=3) if i % 2 else completion_line(f"p{i}", max_tokens=3) for i in range(5)]
    requests.insert(3, completion_line("c1"))  # a duplicate in the second shard of the first use's
    src = write_lines(tmp_path / "batch.jsonl", requests)
    runner = CliRunner()

    def run(*extra):
        r = runner.invoke(main, ["run", "--model", str(model), "--input", str(src), "--no-progress", *map(str, extra)],
                          catch_exceptions=False)
        assert r.exit_code == 0, r.output

    def export(out, to):
        r = runner.invoke(main, ["export", str(out), "--format", "openai-batch", "--to", str(to)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return [json.loads(x) for x in Path(to).read_text().splitlines()]

    run("--output", tmp_path / "one")
    whole = export(tmp_path / "one", tmp_path / "one.jsonl")
    run("--output", tmp_path / "sh", "--shard", "0/2")
    r = runner.invoke(main, ["export", str(tmp_path / "sh"), "--format", "openai-batch", "--to", str(tmp_path / "x.jsonl")])
    assert r.exit_code == 1 and "not complete" in r.output  # a shard is missing: no partial response file
    run("--output", tmp_path / "sh", "--shard", "1/2")
    sharded = export(tmp_path / "sh", tmp_path / "sh.jsonl")
    assert [x["custom_id"] for x in sharded] == [x["custom_id"] for x in whole] == [
        "p0", "c1", "p2", "c1", "c3", "p4"]
    assert "duplicate custom_id 'c1'" in sharded[3]["error"]["message"]
    assert read_jsonl(tmp_path / "sh.errors.jsonl") == [sharded[3]]  # the errors beside each --to file
    assert read_jsonl(tmp_path / "one.errors.jsonl") == [whole[3]]
    for a, b in zip(sharded, whole):
        assert (a["response"] is None) == (b["response"] is None)
        if a["response"]:
            assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]


def test_example_job_files_load():
    from batchjob.job.options.config import load_job

    repo = Path(__file__).resolve().parents[2]
    cfg = load_job(repo / "jobs" / "openai_batch.toml", {})
    assert cfg.output_format == "openai-batch"
    source = open_source(repo / cfg.input)
    assert isinstance(source, OpenAIBatchSource)
    rows = list(source.rows())
    # the embeddings line parses; a generate job answers it with an error (it needs --task embed)
    assert sum(r.error is None for r in rows) == 6 and rows[5].record["endpoint"] == "/v1/embeddings"
    cfg = load_job(repo / "jobs" / "sampling.toml", {})
    assert cfg.sampling_defaults().n == 2 and cfg.stop == ["\n\n"]


def test_a_crash_after_the_last_commit_before_the_response_files_is_finished_by_the_rerun(tmp_path, tiny_model_dir):
    """Found by the crash simulator: every row committed, the process gone before results.jsonl was renamed into
    place (a SIGKILL, a power cut). The rerun said "already finished" and never wrote the response files."""
    model = tiny_model_dir("llama", max_positions=1024)
    src = write_lines(tmp_path / "batch.jsonl", [chat_line(f"req-{i}", max_tokens=2) for i in range(3)])
    out = tmp_path / "out"
    args = ["run", "--model", str(model), "--input", str(src), "--output", str(out), "--output-format", "openai-batch",
            "--no-progress"]
    assert CliRunner().invoke(main, args).exit_code == 0
    first = read_jsonl(out / "results.jsonl")
    (out / "results.jsonl").unlink()  # the errors file was renamed first; the crash came before this one
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "already finished" in result.output, result.output
    again = read_jsonl(out / "results.jsonl")
    assert [x["custom_id"] for x in again] == ["req-0", "req-1", "req-2"]
    assert [x["response"]["body"]["choices"] for x in again] == [x["response"]["body"]["choices"] for x in first]
