"""Tool calls in a job (issue 36) on SmolLM2 (the embedded GGUF) with a Hermes-style template (Qwen2.5's shape: the
tools in a system turn, calls in `<tool_call>` blocks, results as `<tool_response>` turns): with tool_choice
`required` or a named function every row's calls name a declared tool and their arguments validate against its
schema (jsonschema), finish_reason `tool_calls`; an OpenAI Batch file with `tools` comes back in OpenAI's response
shape; a multi-turn conversation with an assistant's tool_calls and a tool message renders; `required` with parallel
calls cut by max_tokens keeps the complete calls; rows with tools in a job without a tool parser are read with `auto`
(named on the start line; a template without a call syntax stops the job at start); a template that cannot render
tools fails the row alone."""
from __future__ import annotations

import json

import jsonschema
import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from tests.builders import write_jsonl

HERMES = """{%- if tools %}<|im_start|>system
You are a function calling AI model. You are given these tools: <tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
For each call return a JSON object with the function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {"name": "convert", "description": "convert an amount of money", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 100000},
                                     "to": {"type": "string", "enum": ["EUR", "USD", "JPY"]}},
    "required": ["amount", "to"], "additionalProperties": False}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "How much is 20 dollars in yen?", "Is it raining in Lima today?",
             "Convert 350 euros to dollars.", "Tell me about the weather in Oslo in fahrenheit.", "Hello there!"]


@pytest.fixture()
def template(tmp_path):
    path = tmp_path / "hermes.jinja"
    path.write_text(HERMES)
    return path


def run(tmp_path, smollm2_gguf_path, rows, *args, name="out", said=None):
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    result = CliRunner().invoke(main, ["run", "--model", str(smollm2_gguf_path), "--input", str(src), "--output",
                                       str(tmp_path / name), "--max-tokens", "60", "--no-progress", *map(str, args)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert said is None or said in result.output, result.output
    return read_results(tmp_path / name).sort_by("row_index").to_pylist()


def valid(call: dict, names=tuple(SCHEMAS)) -> str:
    name = call["function"]["name"]
    assert name in names and call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return name


def test_required_and_named_choices_give_valid_calls_on_every_row(tmp_path, smollm2_gguf_path, template):
    named = {"type": "function", "function": {"name": "convert"}}
    rows = [{"messages": [{"role": "user", "content": q}], "tools": TOOLS, "tool_choice": "required",
             "parallel_tool_calls": False} for q in QUESTIONS]
    rows += [{"messages": [{"role": "user", "content": q}], "tools": TOOLS, "tool_choice": named} for q in QUESTIONS]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--tool-parser", "auto")
    for row in got:
        assert row["error"] is None and row["tool_call_error"] is None, row
        assert row["finish_reason"] == "tool_calls" and row["tool_calls"], row
        names = [valid(c) for c in row["tool_calls"]]
        if row["row_index"] >= len(QUESTIONS):
            assert names == ["convert"]


def test_auto_leaves_an_answer_an_answer_and_none_parses_nothing(tmp_path, smollm2_gguf_path, template):
    """auto rows run under the auto grammar (free text, or a call constrained from its opening tag); SmolLM2-135M
    answers these questions in prose (greedy), which stays the answer, with no call error. That a call the model
    starts is held to the tools' schemas is shown on the grammar itself
    (tests/tool_calls/test_parsers.py::test_an_auto_grammar_takes_free_text_or_valid_calls): this model never starts one
    here, so a job test could not show it."""
    rows = [{"messages": [{"role": "user", "content": q}], "tools": TOOLS} for q in QUESTIONS[:3]]
    rows += [{"messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS, "tool_choice": "none"}]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--tool-parser", "hermes")
    for row in got[:3]:
        assert row["error"] is None and row["tool_call_error"] is None and row["tool_calls"] is None
        assert row["generated_text"] and row["finish_reason"] in ("stop", "length")
    assert got[3]["tool_calls"] is None and got[3]["finish_reason"] in ("stop", "length")


def test_an_openai_batch_file_with_tools_answers_in_openais_shape(tmp_path, smollm2_gguf_path, template):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "messages": [{"role": "user", "content": q}], "tools": TOOLS,
                       "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}}
             for i, q in enumerate(QUESTIONS[:3])]
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"}]
    lines.append({"custom_id": "multi", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "smollm2", "messages": turns, "tools": TOOLS, "max_tokens": 20}})
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = CliRunner().invoke(main, ["run", "--model", str(smollm2_gguf_path), "--input", str(src), "--output",
                                       str(tmp_path / "o"), "--chat-template", str(template), "--tool-parser", "hermes",
                                       "--output-format", "openai-batch", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answers = {a["custom_id"]: a for a in map(json.loads, (tmp_path / "o" / "results.jsonl").read_text().splitlines())}
    for i in range(3):
        choice = answers[f"r{i}"]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and [valid(c) for c in choice["message"]["tool_calls"]]
    multi = answers["multi"]
    assert multi["error"] is None and multi["response"]["body"]["usage"]["prompt_tokens"] > 100


def test_required_with_parallel_calls_cut_by_max_tokens_keeps_the_complete_calls(tmp_path, smollm2_gguf_path, template):
    """OpenAI's default (parallel calls allowed): SmolLM2 repeats calls until max_tokens cuts one in half; the calls
    before it are kept, finish_reason stays `length`, tool_call_error quotes the cut one."""
    rows = [{"messages": [{"role": "user", "content": q}], "tools": TOOLS, "tool_choice": "required"} for q in QUESTIONS]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--tool-parser", "hermes")
    cut = [row for row in got if row["finish_reason"] == "length"]
    assert cut, got  # the case this test is about happened
    for row in got:
        assert row["error"] is None and row["tool_calls"] and [valid(c) for c in row["tool_calls"]], row
    for row in cut:
        assert row["tool_call_error"].startswith("the length limit cut the answer after ") and "(kept)" in row["tool_call_error"]
        assert row["generated_text"].startswith("<tool_call>") and repr(row["generated_text"][:80]) in row["tool_call_error"]
    assert all(row["tool_call_error"] is None for row in got if row["finish_reason"] == "tool_calls")


def test_rows_with_tools_in_a_job_without_a_tool_parser_are_read_with_auto(tmp_path, smollm2_gguf_path, template):
    rows = [{"messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS, "tool_choice": "required",
             "parallel_tool_calls": False}, {"messages": [{"role": "user", "content": "hi"}]}]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, name="noparser",
              said="; tool parser: hermes (auto: the rows carry tools)")
    assert got[0]["finish_reason"] == "tool_calls" and [valid(c) for c in got[0]["tool_calls"]]
    assert got[1]["error"] is None and got[1]["tool_calls"] is None
    run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--tool-parser", "auto", "--max-tokens", 2,
        name="named", said="; tool parser: hermes (auto)")
    plain = tmp_path / "plain.jinja"  # no call syntax: auto finds no parser, and the job stops at start, once
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    src = write_jsonl(tmp_path / "plain.jsonl", rows)
    result = CliRunner().invoke(main, ["run", "--model", str(smollm2_gguf_path), "--input", str(src), "--output",
                                       str(tmp_path / "stopped"), "--chat-template", str(plain), "--no-progress"])
    assert result.exit_code != 0 and "tool_parser: the rows carry `tools` and the job names no tool parser; auto: the " \
        "chat template writes no tool-call syntax batchjob knows; name the parser, --tool-parser NAME (hermes, " in result.output
    assert not (tmp_path / "stopped" / "manifest.json").exists()


def test_tools_with_a_template_that_cannot_render_them_fail_the_row(tmp_path, smollm2_gguf_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, {"messages": [{"role": "user", "content": "hi"}]}]
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", plain, "--tool-parser", "hermes", "--max-tokens", 2,
              name="plain")
    assert "the chat template does not render tools" in got[0]["error"] and got[1]["error"] is None


def test_the_python_api_reads_prompts_with_tools_with_auto_when_no_parser_is_named(smollm2_gguf_path):
    from batchjob import api
    from batchjob.errors import ConfigError

    llm = api.LLM(str(smollm2_gguf_path), chat_template=HERMES, max_tokens=60)  # the template: a default of its calls
    prompt = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False}
    [r] = llm.generate(prompt)
    assert r.finish_reason == "tool_calls" and [valid(c) for c in r.tool_calls] and r.tool_call_error is None
    with pytest.raises(ConfigError, match=r"auto: the chat template writes no tool-call syntax .* tool_parser=NAME"):
        llm.generate(prompt, chat_template="{% for m in messages %}{{ m.tools }}{{ m.content }}{% endfor %}")
