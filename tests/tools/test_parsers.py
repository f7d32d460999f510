"""Tool-call parsers on recorded outputs written from each family's documented format (Qwen2.5/Qwen3 and Hermes'
`<tool_call>` blocks, Llama 3.1's JSON calls, Mistral's `[TOOL_CALLS]` list, the pythonic list): several calls in one
answer, nested JSON and unicode arguments, text around calls, and broken calls (which keep the raw text and say
why); a row's tools and tool_choice checked; the call grammars accept valid calls and nothing else."""
from __future__ import annotations

import json

import llguidance
import pytest

from batchjob.tools.grammar import call_grammar
from batchjob.tools.parsers import detect, parse_hermes, parse_llama3_json, parse_mistral, parse_pythonic
from batchjob.tools.requests import tool_request

NESTED = {"query": {"filters": [{"field": "città", "op": "=", "value": "Zürich 🇨🇭"}], "limit": 5}, "flag": True}


def fn(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_several_calls_with_nested_unicode_arguments_and_text_around():
    text = ("Let me look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n"
            "</tool_call>\n<tool_call>\n" + json.dumps({"name": "search", "arguments": NESTED}, ensure_ascii=False)
            + "\n</tool_call>")
    got = parse_hermes(text, [1, 2, 3])
    assert got.error is None and got.content == "Let me look both up."
    assert [fn(c) for c in got.calls] == [("get_weather", {"city": "東京"}), ("search", NESTED)]
    assert len({c["id"] for c in got.calls}) == 2 and got.calls == parse_hermes(text, [1, 2, 3]).calls  # stable ids


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "hermes: Expecting ','"),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "without its </tool_call>"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "without a function name"),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "arguments must be a JSON object"),
])
def test_hermes_broken_calls_keep_the_raw_text_and_say_why(text, why):
    got = parse_hermes(text)
    assert got.calls is None and got.content == text and why in got.error


def test_hermes_without_a_call_is_an_answer():
    got = parse_hermes("The weather is fine.")
    assert got.calls is None and got.error is None and got.content == "The weather is fine."


def test_llama3_json_calls():
    got = parse_llama3_json('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                            '{"name": "search", "parameters": ' + json.dumps(NESTED) + "}")
    assert [fn(c) for c in got.calls] == [("get_weather", {"city": "Lima"}), ("search", NESTED)]
    assert parse_llama3_json("Sure, here it is.").calls is None
    bad = parse_llama3_json('{"name": "f", "parameters": {"a": }')
    assert bad.calls is None and "llama3_json" in bad.error


def test_mistral_calls():
    got = parse_mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                        '{"name": "search", "arguments": ' + json.dumps(NESTED, ensure_ascii=False) + "}]")
    assert [fn(c) for c in got.calls] == [("get_weather", {"city": "Oslo"}), ("search", NESTED)] and got.content == ""
    bad = parse_mistral("[TOOL_CALLS] [{\"name\": \"f\", ")
    assert bad.calls is None and "mistral" in bad.error


def test_pythonic_calls():
    got = parse_pythonic('[get_weather(city="Kraków", days=3), search(query={"q": [1, 2.5, None]}, exact=False)]')
    assert [fn(c) for c in got.calls] == [("get_weather", {"city": "Kraków", "days": 3}),
                                          ("search", {"query": {"q": [1, 2.5, None]}, "exact": False})]
    bad = parse_pythonic("[get_weather(city=x)]")  # not a literal
    assert bad.calls is None and "pythonic" in bad.error


def test_detect_from_templates():
    assert detect("...<tool_call>\\n{{ tool | tojson }}") == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("<|python_tag|>") == "llama3_json"
    assert detect("{{ messages }}") is None


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}


@pytest.mark.parametrize("tools, choice, says", [
    ("[1]", None, "tools[0]: expected"),
    ([WEATHER, WEATHER], None, "names must be unique"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope' is not among the tools"),
    ([WEATHER], "sometimes", "expected auto, none, required or a named function"),
    (None, "required", "needs tools"),
    ("{bad", None, "tools: invalid JSON"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, says):
    with pytest.raises(ValueError, match=None) as e:
        tool_request(tools, choice)
    assert says in str(e.value)


def test_a_named_choice_forces_that_tool_and_required_any():
    req = tool_request(json.dumps([WEATHER, SEARCH]), {"type": "function", "function": {"name": "search"}})
    assert req.choice == "search" and [t.name for t in req.forced] == ["search"]
    assert [t.name for t in tool_request([WEATHER, SEARCH], "required").forced] == ["get_weather", "search"]
    assert tool_request([WEATHER], "auto").forced == () and tool_request(None, None) is None


@pytest.mark.parametrize("parser, good, bad", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": {"q": "cats"}}]',
     '[TOOL_CALLS][{"name": "search", "arguments": {"q": "much too long"}}]'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
])
def test_call_grammars_take_valid_calls_only(parser, good, bad, smollm2_loaded):
    from batchjob.engine.structured.grammar import GrammarTokenizer

    tools = tool_request([WEATHER, SEARCH], "required").tools
    gt = GrammarTokenizer.from_tokenizer(smollm2_loaded.tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(parser, tools, False, smollm2_loaded.tokenizer.token_id))
    for text, ok in ((good, True), (bad, False)):
        m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
        ids = smollm2_loaded.tokenizer.encode(text, add_special_tokens=False)
        assert (m.validate_tokens(ids) == len(ids)) is ok, text


@pytest.mark.parametrize("text, ok", [
    ("Hello there, no call.", True),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>', True),
    ('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),  # no such tool
    ('<tool_call>\n{"name": "search", "arguments": {"q": "far too long a query"}}\n</tool_call>', False),
])
def test_an_auto_grammar_takes_free_text_or_valid_calls(text, ok, smollm2_loaded):
    """tool_choice auto: free text, or a call constrained from its opening tag on."""
    from batchjob.engine.structured.grammar import GrammarTokenizer
    from batchjob.tools.grammar import auto_grammar

    tools = tool_request([WEATHER, SEARCH], "auto").tools
    gt = GrammarTokenizer.from_tokenizer(smollm2_loaded.tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(auto_grammar("hermes", tools, False, smollm2_loaded.tokenizer.token_id))
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
    ids = smollm2_loaded.tokenizer.encode(text, add_special_tokens=False)
    assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) is ok, text
