"""An answer the length limit cut inside a call (issue 49): the complete calls before the cut are kept, the rest is
the content and is quoted in the error; for each parser's syntax, on answers written in its models' documented format
and cut where max_tokens would cut them. The same in a job: tests/tool_calls/test_tool_jobs.py."""
from __future__ import annotations

import json

import pytest

from batchjob.tool_calls.cut_calls import complete_calls
from batchjob.tool_calls.parsers import PARSE

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
LLAMA3 = ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
          '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "get_wea')
MISTRAL = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
           '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_weather", '
           '"arguments": {"city": ["Pa')
PYTHONIC = '[get_weather(city="Paris", unit="celsius"), get_weather(city="Paris", unit="celsius"), get_weather(ci'


@pytest.mark.parametrize("parser, text, cut", [
    ("hermes", HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("llama3_json", LLAMA3, '; {"name": "get_wea'),
    ("mistral", MISTRAL, ', {"name": "get_weather", "arguments": {"city": ["Pa'),
    ("pythonic", PYTHONIC, ", get_weather(ci"),
])
def test_the_complete_calls_before_the_cut_are_kept_and_the_cut_one_is_quoted(parser, text, cut):
    parse, ids = PARSE[parser], list(range(40))
    failed = parse(text, ids)
    assert failed.calls is None and failed.error  # the whole answer does not parse
    kept = complete_calls(parse, text, ids, failed)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in kept.calls] == \
        [("get_weather", WEATHER)] * 2
    assert [c["id"] for c in kept.calls] == [c["id"] for c in parse(text[:len(text) - len(cut)] + "]" * (
        parser in ("mistral", "pythonic")), ids).calls]  # the ids the uncut calls would have
    assert kept.content == cut.strip() and kept.content.endswith(text[-8:])
    assert kept.error.startswith("the length limit cut the answer after 2 complete calls (kept); the rest does not "
                                 f"parse ({failed.error}): ")
    assert repr(cut.strip()[:80]) in kept.error


def test_a_cut_first_call_keeps_no_calls_and_says_it_was_cut():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    failed = PARSE["hermes"](text, [1, 2])
    kept = complete_calls(PARSE["hermes"], text, [1, 2], failed)
    assert kept.calls is None and kept.content == text
    assert kept.error == f"{failed.error} (the answer was cut: finish_reason length)"


def test_text_before_the_calls_stays_in_the_content():
    text = 'Let me look.\n' + HERMES
    kept = complete_calls(PARSE["hermes"], text, [], PARSE["hermes"](text, []))
    assert len(kept.calls) == 2 and kept.content.startswith("Let me look.\n<tool_call>") and kept.content.endswith("Pa")
