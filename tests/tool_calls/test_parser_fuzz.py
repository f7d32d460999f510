"""No parser raises, whatever a model writes: a seeded generator mangles recorded calls of every format (truncations,
random characters and code points, tags in the wrong places, nesting deeper than Python reads, values no JSON holds:
bytes, sets, complex numbers, NaN, 1e999, integers too long to write) and feeds them to every tool parser and to every
reasoning parser's split (token ids at random among the tags). Each answer gives calls whose arguments are JSON text
of an object (RFC 8259: no NaN or Infinity, UTF-8), or no calls (with an error only where a call was started, the
text then as it was); the same text gives the same answer."""
from __future__ import annotations

import json
import random

import pytest

from batchjob.reasoning.harmony import CONSTRAIN, TOKENS, HarmonyParser
from batchjob.reasoning.parsers import ThinkParser
from batchjob.reasoning.split import AddressedMessage, Split
from batchjob.tool_calls.parsers import PARSERS, ParsedCalls, parse

RECORDED = {  # each format's calls as its models write them; VALUE: an argument's value, drawn from VALUES
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "days": VALUE}}\n</tool_call>',
               'Sure.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
               '"arguments": "{\\"x\\": VALUE}"}\n</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": {"city": VALUE}}; {"name": "s", '
                    '"parameters": {"q": null}}',
                    'Here: {"name": "getOpenIncidentsTool", "parameters": {"a": VALUE}} more?'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": VALUE}}]',
                'Ok[TOOL_CALLS]get_weather[ARGS]{"city": VALUE}[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"q": 1}',
                '[TOOL_CALLS]get_weather{"city": VALUE}'],
    "pythonic": ['[get_weather(city="Kraków", days=VALUE), search(query={"q": [1, 2.5, None]}, exact=False, n=-1)]',
                 "<|python_start|>[get_user_info(user_id=7890, special=VALUE)]<|python_end|>"],
    "openai": ['{"location": VALUE}', '{"a": {"b": {"c": [true, false, null, VALUE]}}}'],
}
VALUES = ["1", '"\\ud83c\\udde8"', '"é"', "null", "None", "NaN", "Infinity", "-Infinity", "1e999", "-1e400",
          "9" * 5000, "0x" + "f" * 5000, "b'x'", "{1, 2}", "set()", "1j", "...", "(1, 2)", "{1: 2}", "{'a': b''}",
          "-True", "'\\ud800'", '"\\ud800"', "[" * 5000, '{"a":' * 3000, "x", "f(1)", "**d", "lambda: 0"]
PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<|python_start|>",
          "<|python_end|>", *VALUES, "\ud800", "\x00", "\u2028", "🇨🇭", '"', "'", "\\", "*a", "f(", ")", "=", ";",
          ":", ","]
CHARS = '{}[]()"\':;,=\\ \n\t.-+eE0123456789abcxyz_'


def mangle(rng: random.Random, text: str) -> str:
    at = rng.randrange(len(text) + 1)
    span = text[at:at + rng.randrange(1, 40)]
    op = rng.randrange(8)
    if op == 0:
        return text[:at]
    if op == 1:
        return text[:at] + rng.choice(CHARS) + text[at:]
    if op == 2:
        return text[:at] + chr(rng.randrange(0x110000)) + text[at:]
    if op == 3:
        return text[:at] + rng.choice(PIECES) + text[at:]
    if op == 4:
        return text[:at] + text[at + len(span):]
    if op == 5:
        return text[:at] + span * rng.randrange(2, 5) + text[at:]
    if op == 6:
        depth = rng.choice([3, 50, 300, 3000, 100_000])
        opening, closing = rng.choice([("[", "]"), ("{", "}"), ("(", ")"), ('{"a":', "}"), ("[f(a=", ")]")])
        return text[:at] + opening * depth + span + closing * rng.choice([0, depth]) + text[at:]
    return text[:at] + text[at:][::-1]


def texts(parser: str, seed: int, count: int) -> list[str]:
    """Mostly `parser`'s own format (a value at random, then up to three manglings), else another's."""
    rng = random.Random(seed)
    formats = [t for ts in RECORDED.values() for t in ts]
    out = []
    for _ in range(count):
        text = rng.choice(RECORDED[parser] if rng.random() < 0.7 else formats).replace("VALUE", rng.choice(VALUES))
        for _ in range(rng.randrange(4)):
            text = mangle(rng, text)
        out.append(text)
    return out


def _no_constant(name):
    raise AssertionError(f"{name} in arguments")


def check(parsed: ParsedCalls, text: str) -> None:
    assert isinstance(parsed, ParsedCalls) and isinstance(parsed.content, str)
    assert parsed.error is None or (isinstance(parsed.error, str) and parsed.error)
    if parsed.calls is None:
        assert parsed.error is None or parsed.content == text
        return
    assert parsed.calls and parsed.error is None
    assert len({c["id"] for c in parsed.calls}) == len(parsed.calls)
    for c in parsed.calls:
        name, arguments = c["function"]["name"], c["function"]["arguments"]
        assert c["type"] == "function" and isinstance(name, str) and name.strip() and name.isprintable()
        assert isinstance(json.loads(arguments, parse_constant=_no_constant), dict)
        arguments.encode("utf-8")


@pytest.mark.parametrize("parser", PARSERS)
def test_no_tool_parser_raises_on_mangled_calls(parser):
    for n, text in enumerate(texts(parser, seed=PARSERS.index(parser), count=2500)):
        messages = [AddressedMessage("functions.f", "json", text)] if parser == "openai" else None
        answer = "answer" if messages else text
        got = parse(parser, answer, (n,), messages)
        check(got, answer)
        if n % 25 == 0:
            assert parse(parser, answer, (n,), messages) == got  # the same answer every time


VOCAB = ["<think>", "</think>", "<tool_call>", "</tool_call>", *TOKENS, CONSTRAIN, "\n", "\n\n", " ", "analysis",
         "final", "commentary", "assistant", " to=functions.f", "to=functions.g", " to=browser.search", " json", "json",
         '{"a": 1}', '{"a": ', "NaN}", "x", " y", "é", "{", "}"]
ID = {t: i for i, t in enumerate(VOCAB)}
SPECIAL = {ID[t] for t in (*TOKENS, CONSTRAIN)}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def decode_skipping(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i not in SPECIAL)


REASONING = [ThinkParser("qwen3", ID["<think>"], ID["</think>"], tool_call_id=ID["<tool_call>"]),
             ThinkParser("deepseek_r1", ID["<think>"], ID["</think>"]),
             HarmonyParser.of({t: ID[t] for t in (*TOKENS, CONSTRAIN)}),
             HarmonyParser.of({t: ID[t] for t in TOKENS})]


@pytest.mark.parametrize("parser", REASONING, ids=["qwen3", "deepseek_r1", "gpt_oss", "gpt_oss-no-constrain"])
def test_no_reasoning_parser_raises_on_random_tokens(parser):
    rng = random.Random(7)
    for n in range(1500):
        ids = [rng.randrange(len(VOCAB)) for _ in range(rng.choice([0, 1, 3, 10, 40]))]
        if rng.random() < 0.5:  # a recorded shape, mangled
            ids = [ID[t] for t in ("<|channel|>", "analysis", "<|message|>", "x", "<|end|>", "<|start|>", "assistant",
                                   "<|channel|>", "commentary", " to=functions.f", " json", "<|message|>", '{"a": 1}',
                                   "<|call|>")] + ids
            del ids[rng.randrange(len(ids)):][:rng.randrange(3)]
        dec = decode if n % 2 else decode_skipping
        opened = rng.random() < 0.5
        stop_text = None if rng.random() < 0.7 else mangle(rng, dec(ids) or "x")
        split = parser.split(ids, dec, opened, stop_text)
        assert isinstance(split, Split) and isinstance(split.content, str)
        assert split.reasoning is None or isinstance(split.reasoning, str)
        assert 0 <= split.reasoning_tokens <= len(ids) + 2
        if isinstance(parser, ThinkParser):
            assert split.calls is None
            continue
        assert isinstance(split.calls, tuple)
        assert all(isinstance(m, AddressedMessage) and isinstance(m.body, str) for m in split.calls)
        check(parse("openai", split.content, ids, split.calls), split.content)
