"""Structured outputs through the engine, the job and the API: rows constrained by JSON schemas, regexes and
choices on the embedded SmolLM2 come back valid; a schema that does not compile fails its row alone; the
text is the same alone and batched, with speculative decoding, and after SIGKILL and resume."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

import batchjob
from batchjob.cli.main import main
from batchjob.errors import ConfigError
from batchjob.io.manifest import Manifest
from batchjob.io.parts import read_results
from tests.job.test_resume import start_job, wait_for_parts

FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress"]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "country": {"enum": ["France", "Peru", "Japan", "Kenya"]}},
                "required": ["city", "country"], "additionalProperties": False},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "address", "hobbies"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
                                         "continent": {"enum": ["Africa", "Asia", "Europe", "Americas", "Oceania"]}},
        "required": ["city", "population_millions", "continent"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"

PROMPTS = [
    ({"json": PERSON}, "Invent a person living in Lima and describe them as JSON."),
    ({"json": PERSON}, "Describe a retired teacher from Kyoto as JSON."),
    ({"json": CITY}, "Describe Nairobi as JSON."),
    ({"json": CITY}, "Describe Paris as JSON."),
    ({"json_object": True}, "Give a JSON object with two facts about the moon."),
    ({"regex": DATE}, "When did the Berlin wall fall? Answer as YYYY-MM-DD."),
    ({"choice": ["positive", "negative"]}, "Is 'I loved this film' positive or negative?"),
    ({"choice": ["positive", "negative"]}, "Is 'the soup was cold and bland' positive or negative?"),
]


def rows(specs_prompts):
    return [{"messages": [{"role": "user", "content": p}], "structured_outputs": s} for s, p in specs_prompts]


def check(spec: dict, text: str) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict)
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    else:
        assert text in spec["choice"]


@pytest.fixture(scope="module")
def batched(smollm2_gguf_path):
    return batchjob.generate(rows(PROMPTS), max_tokens=120)


def test_every_structured_row_that_stops_is_valid_and_most_stop(batched):
    stopped = 0
    for (spec, _), r in zip(PROMPTS, batched):
        assert r.error is None and r.finish_reason in ("stop", "length")
        if r.finish_reason == "stop":
            check(spec, r.text)
            stopped += 1
    assert stopped >= len(PROMPTS) - 1


def test_a_rows_text_is_the_same_alone_and_with_speculative_decoding(batched):
    for i in (0, 4, 6):
        assert batchjob.generate(rows(PROMPTS[i:i + 1]), max_tokens=120)[0].text == batched[i].text
    spec = batchjob.generate(rows(PROMPTS), max_tokens=120, speculative="ngram")
    assert [r.text for r in spec] == [r.text for r in batched]


def test_a_schema_that_does_not_compile_fails_its_row_only(smollm2_gguf_path):
    bad = {"json": {"type": "array", "uniqueItems": True}}
    got = batchjob.generate(rows([PROMPTS[6], (bad, "List colors."), PROMPTS[7]]), max_tokens=20)
    assert got[1].finish_reason == "error" and "uniqueItems" in got[1].error
    assert got[0].text in ("positive", "negative") and got[2].text in ("positive", "negative")
    unknown = batchjob.generate([{"prompt": "x", "structured_outputs": {"choices": ["a"]}}], max_tokens=4)[0]
    assert unknown.finish_reason == "error" and "unknown key 'choices'" in unknown.error


def test_the_job_wide_keyword_and_a_rows_own_field(smollm2_gguf_path):
    got = batchjob.generate([{"prompt": "Capital of Peru?"}, {"prompt": "Capital of Peru?", "structured_outputs": {"regex": "[A-Z][a-z]+"}}],
                            chat=True, max_tokens=12, structured_outputs={"choice": ["Lima", "Cusco"]})
    assert got[0].text in ("Lima", "Cusco") and re.fullmatch("[A-Z][a-z]+", got[1].text)
    with pytest.raises(ConfigError, match="structured_outputs"):
        batchjob.generate(["x"], structured_outputs={"json": {}, "regex": "a"})


def cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_an_openai_batch_with_response_format_comes_back_as_json(tmp_path, smollm2_gguf_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "max_tokens": 80, "response_format": fmt,
                       "messages": [{"role": "user", "content": f"Describe {city} as JSON."}]}}
             for i, city in enumerate(["Lima", "Tokyo", "Cairo"])]
    lines.append({"custom_id": "any", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"max_tokens": 60, "response_format": {"type": "json_object"},
                           "messages": [{"role": "user", "content": "A JSON object about cats."}]}})
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    cli("run", "--input", src, "--output", out, "--output-format", "openai-batch", "--no-progress")
    responses = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in responses] == ["r0", "r1", "r2", "any"]
    for r in responses:
        choice = r["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            if r["custom_id"] != "any":
                jsonschema.validate(value, CITY)
    assert sum(r["response"]["body"]["choices"][0]["finish_reason"] == "stop" for r in responses) >= 3


def test_job_flags_and_table(tmp_path):
    from batchjob.job.options.config import load_job

    cfg = load_job(None, {"input": "x.jsonl", "choice": "yes,no"})
    assert cfg.sampling_defaults().structured_outputs.choices == ["yes", "no"]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(CITY))
    job = tmp_path / "job.toml"
    job.write_text(f'input = "x.jsonl"\n[structured_outputs]\njson_schema = "{schema}"\n')
    cfg = load_job(job, {})
    assert json.loads(cfg.sampling_defaults().structured_outputs.text) == CITY
    with pytest.raises(ConfigError, match="at most one structured output"):
        load_job(None, {"input": "x.jsonl", "regex": "a", "choice": "b"})


def test_a_structured_job_resumes_after_sigkill_with_identical_text(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    specs = [{"choice": ["alpha", "beta gamma", "delta"]}, {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,3}"}, None]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"The fox number {i} jumps", "structured_outputs": specs[i % 3]}) + "\n"
                           for i in range(240)))
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--model", model, "--input", src, "--max-tokens", 10, "--part-rows", 10, "--max-num-seqs", 8, *FAST]
    cli("run", *args, "--output", ref)
    proc = start_job(*args, "--output", out)
    wait_for_parts(out, proc, parts=2)
    proc.kill()
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 240
    cli("run", *args, "--output", out)
    got, want = read_results(out), read_results(ref)
    assert got.column("generated_text").to_pylist() == want.column("generated_text").to_pylist()
    texts = want.column("generated_text").to_pylist()
    assert all(texts[i] in specs[0]["choice"] for i in range(0, 240, 3))
    assert all(re.fullmatch(specs[1]["regex"], texts[i]) for i in range(1, 240, 3) if want.column("finish_reason")[i].as_py() == "stop")
