"""Tool calls in a job (issue 36) on SmolLM2 (the embedded GGUF) with a Hermes-style template (Qwen2.5's shape: the
tools in a system turn, calls in `<tool_call>` blocks, results as `<tool_response>` turns): with tool_choice
`required` or a named function every row's calls name a declared tool and their arguments validate against its
schema (jsonschema), finish_reason `tool_calls`; an OpenAI Batch file with `tools` comes back in OpenAI's response
shape; a multi-turn conversation with an assistant's tool_calls and a tool message renders; tools in a job without a
tool parser, or with a template that cannot render them, fail the row alone."""
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


def run(tmp_path, smollm2_gguf_path, rows, *args, name="out"):
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    result = CliRunner().invoke(main, ["run", "--model", str(smollm2_gguf_path), "--input", str(src), "--output",
                                       str(tmp_path / name), "--max-tokens", "60", "--no-progress", *map(str, args)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
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


def test_auto_constrains_a_call_the_model_starts_and_none_parses_nothing(tmp_path, smollm2_gguf_path, template):
    rows = [{"messages": [{"role": "user", "content": q}], "tools": TOOLS} for q in QUESTIONS[:3]]
    rows += [{"messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS, "tool_choice": "none"}]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--tool-parser", "hermes")
    for row in got[:3]:  # a call it starts is decoded inside the grammar (valid); an answer stays an answer
        assert row["error"] is None and row["tool_call_error"] is None
        if row["tool_calls"]:
            assert row["finish_reason"] == "tool_calls" and [valid(c) for c in row["tool_calls"]]
        else:
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


def test_tools_without_a_parser_or_a_template_that_renders_them_fail_the_row(tmp_path, smollm2_gguf_path, template):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, {"messages": [{"role": "user", "content": "hi"}]}]
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", template, "--max-tokens", 2, name="noparser")
    assert "this job parses no tool calls; run it with --tool-parser" in got[0]["error"] and got[1]["error"] is None
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    got = run(tmp_path, smollm2_gguf_path, rows, "--chat-template", plain, "--tool-parser", "hermes", "--max-tokens", 2,
              name="plain")
    assert "the chat template does not render tools" in got[0]["error"] and got[1]["error"] is None
