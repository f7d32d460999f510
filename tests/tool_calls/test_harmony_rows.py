"""gpt-oss rows with tools, from a completion's tokens to its output fields: the `gpt_oss` reasoning parser sets the
messages to functions apart, the `openai` tool parser makes them the row's `tool_calls` (finish_reason `tool_calls`),
the preamble stays the answer; a job that names `openai` without the harmony split says so on the row."""
from __future__ import annotations

import json

from batchjob.engine.requests import RequestOutput
from batchjob.job.rows.results import OutputColumns, PendingRow, ResultRow, TokenText
from batchjob.reasoning.harmony import CONSTRAIN, TOKENS, HarmonyParser
from batchjob.tool_calls.requests import tool_request

SPECIAL = [*TOKENS, CONSTRAIN]
VOCAB = [*SPECIAL, "assistant", "analysis", "commentary", "final", " to=functions.get_weather", " ", "json",
         "The user wants weather.", "Checking the weather.", '{"location":"SF","unit":"C"}']
ID = {t: i for i, t in enumerate(VOCAB)}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


class Tokenizer:
    """Decodes as the job's tokenizer does: special tokens left out."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and VOCAB[i] in SPECIAL))

    def token_id(self, token: str) -> int | None:
        return ID.get(token)


def row(*tokens: str, tool_parser: str = "openai", reasoning=True) -> ResultRow:
    out = RequestOutput(0, None, [ID["<|start|>"], ID["assistant"]], tuple(ID[t] for t in tokens), "stop", None,
                        None, None, None, None, "", None)
    pending = PendingRow(1, OutputColumns(reasoning=True, tools=True), tools=tool_request([WEATHER], "auto"))
    parser = HarmonyParser.of({t: ID[t] for t in SPECIAL}) if reasoning else None
    pending.add(0, out, Tokenizer(), TokenText(Tokenizer()), parser, tool_parser)
    return pending.result()


CALL = ("<|channel|>", "analysis", "<|message|>", "The user wants weather.", "<|end|>", "<|start|>", "assistant",
        "<|channel|>", "commentary", "<|message|>", "Checking the weather.", "<|end|>", "<|start|>", "assistant",
        "<|channel|>", "commentary", " to=functions.get_weather", " ", "<|constrain|>", "json", "<|message|>",
        '{"location":"SF","unit":"C"}', "<|call|>")


def test_a_gpt_oss_call_is_the_rows_tool_call_and_its_preamble_the_answer():
    got = row(*CALL)
    calls = got.extra["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"location": "SF", "unit": "C"})]
    assert got.finish_reason == "tool_calls" and got.generated_text == "Checking the weather."
    assert got.extra["reasoning"] == "The user wants weather." and got.extra["tool_call_error"] is None


def test_without_the_harmony_split_the_openai_parser_names_what_it_needs():
    got = row(*CALL, reasoning=False)
    assert got.extra["tool_calls"] is None and "--reasoning-parser gpt_oss" in got.extra["tool_call_error"]


def test_the_openai_tool_parser_needs_the_gpt_oss_split_and_says_so_at_start():
    import pytest

    from batchjob.errors import ConfigError
    from batchjob.job.rows.tool_rows import ToolRows

    template = "{% for t in tools %}{{ t }}{% endfor %}<|start|>assistant<|channel|>final<|message|>"
    with pytest.raises(ConfigError, match=r"^tool_parser openai \(auto, for the chat template's harmony format\): .*"
                                          r"--reasoning-parser gpt_oss"):
        ToolRows.of("auto", Tokenizer(), template, implied=True)
    with pytest.raises(ConfigError, match=r"^tool_parser openai: "):
        ToolRows.of("openai", Tokenizer(), template, reasoning_parser=None)
    for reasoning in ("gpt_oss", "auto"):
        assert ToolRows.of("auto", Tokenizer(), template, reasoning_parser=reasoning).parser == "openai"
