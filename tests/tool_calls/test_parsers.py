"""Tool-call parsers on recorded outputs written from each family's documented format: Qwen2.5/Qwen3 and Hermes'
`<tool_call>` blocks (and a last one left open), Llama 3.1's JSON calls (with prose around them, as vLLM reads them),
Mistral's `[TOOL_CALLS]` list (junk around it) and its v11+ `[TOOL_CALLS]name{...}` calls (with `[ARGS]` and
`[CALL_ID]`), the pythonic list (Llama 3.2/4); several calls in one answer, nested JSON and unicode arguments, broken
calls (which keep the raw text and say why, the same every run); arguments always RFC 8259 JSON; a row's tools and
tool_choice checked; the call grammars accept valid calls and nothing else."""
from __future__ import annotations

import json

import llguidance
import pytest

from batchjob.tool_calls.grammar import call_grammar
from batchjob.tool_calls.parsers import (PARSERS, detect, parse, parse_hermes, parse_llama3_json, parse_mistral,
                                    parse_pythonic)
from batchjob.tool_calls.requests import tool_request

NESTED = {"query": {"filters": [{"field": "città", "op": "=", "value": "Zürich 🇨🇭"}], "limit": 5}, "flag": True}


def fn(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def names_and_arguments(parsed) -> list[tuple[str, dict]]:
    assert parsed.error is None, parsed.error
    return [fn(c) for c in parsed.calls]


# -- hermes (Qwen2.5 / Qwen3 / Hermes / SmolLM3): `<tool_call>\n{json}\n</tool_call>` per call, as the templates show

QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n</tool_call>')


def test_hermes_qwen_parallel_calls():
    got = parse_hermes(QWEN_TWO_CALLS, [1, 2, 3])
    assert names_and_arguments(got) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]
    assert got.content == ""
    assert len({c["id"] for c in got.calls}) == 2 and got.calls == parse_hermes(QWEN_TWO_CALLS, [1, 2, 3]).calls


def test_hermes_several_calls_with_nested_unicode_arguments_and_text_around():
    text = ("Let me look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n"
            "</tool_call>\n<tool_call>\n" + json.dumps({"name": "search", "arguments": NESTED}, ensure_ascii=False)
            + "\n</tool_call>")
    got = parse_hermes(text, [1, 2, 3])
    assert got.error is None and got.content == "Let me look both up."
    assert [fn(c) for c in got.calls] == [("get_weather", {"city": "東京"}), ("search", NESTED)]
    assert got.calls[0]["function"]["arguments"] == '{"city": "東京"}'  # UTF-8 as written, not \\u-escaped


def test_hermes_a_last_call_left_open_is_a_call_as_in_vllm():
    """A stop string at `</tool_call>` (or the end of the answer) leaves the last block open: its JSON is whole."""
    got = parse_hermes('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n')
    assert names_and_arguments(got) == [("get_weather", {"city": "Lima"})] and got.content == "I will check."


def test_hermes_arguments_given_as_json_text_come_out_as_json_text():
    got = parse_hermes('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>')
    assert got.calls[0]["function"]["arguments"] == '{"a": [1, 2]}'


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "hermes: call 0: Expecting ',' delimiter"),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}', "hermes: call 0: Expecting ',' delimiter"),  # cut
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "hermes: call 0: a call without a function name"),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "arguments must be a JSON object, got a list"),
    ('<tool_call>\n[1]\n</tool_call>', "call 0: expected a JSON object, got a list"),
    ('<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {"x": NaN}}'
     '</tool_call>', "call 1: NaN is not JSON"),  # one bad call refuses its siblings, as vLLM does
    ('<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 5000 + "}", "call 0: JSON nested deeper than Python reads"),
])
def test_hermes_broken_calls_keep_the_raw_text_and_say_why(text, why):
    got = parse_hermes(text)
    assert got.calls is None and got.content == text and why in got.error, got.error


def test_hermes_without_a_call_is_an_answer():
    got = parse_hermes("The weather is fine.")
    assert got.calls is None and got.error is None and got.content == "The weather is fine."


# -- llama3_json (Llama 3.1-3.3's JSON tool calling): `{"name": ..., "parameters": {...}}`, `<|python_tag|>` optional

def test_llama3_json_calls():
    got = parse_llama3_json('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                            '{"name": "search", "parameters": ' + json.dumps(NESTED) + "}")
    assert names_and_arguments(got) == [("get_weather", {"city": "Lima"}), ("search", NESTED)] and got.content == ""
    assert parse_llama3_json("Sure, here it is.") == parse("llama3_json", "Sure, here it is.")
    assert parse_llama3_json("Sure, here it is.").calls is None


def test_llama3_json_as_meta_documents_it():
    got = parse_llama3_json('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                            '"unit": "Fahrenheit"}}')
    assert names_and_arguments(got) == [("get_current_conditions", {"location": "San Francisco, CA",
                                                                      "unit": "Fahrenheit"})]


def test_llama3_json_finds_calls_in_prose_as_vllm_does_and_keeps_the_prose():
    got = parse_llama3_json('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like '
                            'to know more?')
    assert names_and_arguments(got) == [("getOpenIncidentsTool", {})]
    assert got.content == "Here is the result:\nWould you like to know more?"


def test_llama3_json_prose_with_braces_that_are_no_call_is_an_answer():
    for text in ("In C: int main() { return 0; }", 'The JSON {"a": 1} has no name.'):
        assert parse_llama3_json(text) == type(parse_llama3_json(text))(None, text)


@pytest.mark.parametrize("text, why", [
    ('{"name": "f", "parameters": {"a": }', "llama3_json: call 0: Expecting value"),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"n": 1e999}}',
     "call 1: the number 1e999 is too large for a float"),
    ("<|python_tag|>", "no JSON call after <|python_tag|>"),
])
def test_llama3_json_a_started_call_that_does_not_parse_says_why(text, why):
    got = parse_llama3_json(text)
    assert got.calls is None and got.content == text and why in got.error, got.error


# -- mistral: `[TOOL_CALLS]` + a JSON list (tokenizers v3-v7), `[TOOL_CALLS]name[ARGS]{...}` (v11 on)

def test_mistral_calls():
    got = parse_mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                        '{"name": "search", "arguments": ' + json.dumps(NESTED, ensure_ascii=False) + "}]")
    assert names_and_arguments(got) == [("get_weather", {"city": "Oslo"}), ("search", NESTED)] and got.content == ""
    bad = parse_mistral("[TOOL_CALLS] [{\"name\": \"f\", ")
    assert bad.calls is None and "mistral: call 0: " in bad.error


def test_mistral_7b_v03_list_and_nemo_list_with_ids():
    v3 = parse_mistral('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                       '"format": "celsius"}}]')
    assert names_and_arguments(v3) == [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]
    nemo = parse_mistral('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Ab12Cd34E"}]')
    assert names_and_arguments(nemo) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "cafés"}',  # v13
    '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}[TOOL_CALLS]search[CALL_ID]Z9y8X7w6V'
    '[ARGS]{"q": "cafés"}',  # v11: the call's id between the name and the arguments
    '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]search{"q": "cafés"}',  # decoded without [ARGS]
])
def test_mistral_v11_named_calls(text):
    got = parse_mistral("Let me check.\n" + text)
    assert names_and_arguments(got) == [("get_weather", {"city": "Paris"}), ("search", {"q": "cafés"})]
    assert got.content == "Let me check."


def test_mistral_junk_around_the_list_is_content_and_the_calls_are_read_as_vllm_reads_them():
    got = parse_mistral('Checking.[TOOL_CALLS] Sure: [{"name": "f", "arguments": {"a": 1}}] done')
    assert names_and_arguments(got) == [("f", {"a": 1})] and got.content == "Checking.\nSure:\ndone"


@pytest.mark.parametrize("text, why", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', "mistral: call 0 (get_weather): Expecting value"),
    ("[TOOL_CALLS]get_weather", "call 0: expected a call after [TOOL_CALLS], got 'get_weather'"),
    ("[TOOL_CALLS]", "call 0: expected a call after [TOOL_CALLS], got ''"),
    ('[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g[ARGS]{"b": Infinity}', "call 1 (g): Infinity is not JSON"),
])
def test_mistral_broken_calls_refuse_the_answer(text, why):
    got = parse_mistral(text)
    assert got.calls is None and got.content == text and why in got.error, got.error


# -- pythonic (Llama 3.2's and Llama 4's pythonic templates, Phi-4-mini)

def test_pythonic_calls():
    got = parse_pythonic('[get_weather(city="Kraków", days=3), search(query={"q": [1, 2.5, None]}, exact=False)]')
    assert names_and_arguments(got) == [("get_weather", {"city": "Kraków", "days": 3}),
                                        ("search", {"query": {"q": [1, 2.5, None]}, "exact": False})]


def test_pythonic_llama_3_2_and_llama_4_as_documented():
    got = parse_pythonic("[get_user_info(user_id=7890, special='black')]")
    assert names_and_arguments(got) == [("get_user_info", {"user_id": 7890, "special": "black"})]
    got = parse_pythonic('<|python_start|>[get_weather(location="Menlo Park", offset=-2.5, days=(1, 2))]<|python_end|>')
    assert names_and_arguments(got) == [("get_weather", {"location": "Menlo Park", "offset": -2.5, "days": [1, 2]})]


@pytest.mark.parametrize("text, why", [
    ("[get_weather(city=x)]", "pythonic: call 0 (get_weather): argument city: `x` is not a literal"),
    ('[f(a=b"x")]', "call 0 (f): argument a: b'x' is not a JSON value (a bytes)"),
    ("[f(a={1, 2})]", "argument a: `{1, 2}` is not a literal"),
    ("[f(a=1j)]", "argument a: 1j is not a JSON value (a complex)"),
    ("[f(a=1e999)]", "argument a: inf is not a JSON number"),
    ("[f(a=...)]", "argument a: Ellipsis is not a JSON value"),
    ("[f(a={b'k': 2})]", "argument a: a dict's keys must be strings, numbers, True/False or None"),
    ("[f(a={1e999: 2})]", "call 0 (f): Out of range float values are not JSON compliant"),
    ("[f(1)]", "call 0 (f): keyword arguments only"),
    ("[ok(a=1), f(a=b'x')]", "call 1 (f)"),  # one bad call refuses its siblings, as vLLM does
    ("[f(a=1), os.system(a=1)]", "call 1: the function must be a plain name, got `os.system`"),
    ("[f(a=1)] and then some prose", "pythonic: not a Python list of calls"),
    ("[f(a=" + "[" * 300 + "]" * 300 + ")]", "too many nested parentheses"),
    ("[f(a=" + "9" * 5000 + ")]", "Exceeds the limit (4300 digits)"),
])
def test_pythonic_values_no_json_holds_refuse_the_answer_the_same_way_every_run(text, why):
    got = parse_pythonic(text)
    assert got.calls is None and got.content == text and why in got.error, got.error
    assert " at 0x" not in got.error and got == parse_pythonic(text)  # no memory address: the same text every run


def test_pythonic_a_huge_integer_stays_an_integer():
    got = parse_pythonic("[f(a=123456789012345678901234567890, b=-7)]")
    assert got.calls[0]["function"]["arguments"] == '{"a": 123456789012345678901234567890, "b": -7}'


def test_pythonic_dict_keys_are_written_as_json_writes_them_as_vllm_does():
    got = parse_pythonic("[f(a={1: 'x', None: 2.5, False: [3]})]")
    assert got.calls[0]["function"]["arguments"] == '{"a": {"1": "x", "null": 2.5, "false": [3]}}'


# -- arguments are RFC 8259 JSON, or the call is refused

@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": -Infinity}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": NaN}"}</tool_call>',
])
def test_non_finite_numbers_are_refused_never_written(text):
    got = parse_hermes(text)
    assert got.calls is None and got.error and "Infinity" not in str(got.calls)


def test_a_lone_surrogate_in_an_argument_is_escaped_so_the_text_is_utf8():
    got = parse_hermes('<tool_call>{"name": "f", "arguments": {"s": "a\\ud800b", "t": "é"}}</tool_call>')
    text = got.calls[0]["function"]["arguments"]
    assert text.encode("utf-8") and json.loads(text) == {"s": "a\ud800b", "t": "é"}


def test_detect_from_templates():
    assert detect("...<tool_call>\\n{{ tool | tojson }}") == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("<|python_tag|>") == "llama3_json"
    assert detect("<|start|>assistant<|channel|>commentary to=functions.{{ name }}") == "openai"
    assert detect("{{ messages }}") is None
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "openai"}


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
    from batchjob.tool_calls.grammar import auto_grammar

    tools = tool_request([WEATHER, SEARCH], "auto").tools
    gt = GrammarTokenizer.from_tokenizer(smollm2_loaded.tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_lark(auto_grammar("hermes", tools, False, smollm2_loaded.tokenizer.token_id))
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
    ids = smollm2_loaded.tokenizer.encode(text, add_special_tokens=False)
    assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) is ok, text
