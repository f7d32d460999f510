"""Tool-call tags that a tokenizer marks special (Mistral's [TOOL_CALLS] and [ARGS], Llama 3's <|python_tag|>) reach
the parser: the answer is decoded without special tokens, which used to leave the mistral parser nothing to find on a
real Mistral tokenizer. A real `tokenizers` vocabulary with the tags added as special tokens, as Mistral's
tokenizer.json adds them; the row goes from its token ids to its output fields."""
from __future__ import annotations

import json

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from batchjob.engine.requests import RequestOutput
from batchjob.job.rows.results import OutputColumns, PendingRow, ResultRow, TokenText
from batchjob.tool_calls.requests import tool_request

WORDS = ["<unk>", "</s>", "get_weather", '{"city":', '"Paris"}', "Sure,", "calling", "now.", '{"name":', '"get_weather",',
         '"parameters":', '"Paris"}}']
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


class Tokenizer:
    """The job's tokenizer's two calls (models/tokenizer.py) over a `tokenizers` backend."""

    def __init__(self, specials: list[str]):
        self.backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
        self.backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.backend.add_special_tokens(specials)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def fields(tok: Tokenizer, text: str, parser: str, choice: str = "auto") -> ResultRow:
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    out = RequestOutput(0, None, [], tuple(ids), "stop", None, None, None, None, None, "", None)
    pending = PendingRow(1, OutputColumns(tools=True), tools=tool_request([WEATHER], choice))
    pending.add(0, out, tok, TokenText(tok), None, parser)
    return pending.result()


def test_mistrals_special_tool_call_tags_are_read():
    tok = Tokenizer(["[TOOL_CALLS]", "[ARGS]"])
    assert tok.decode(tok.backend.encode("[TOOL_CALLS]get_weather").ids) == "get_weather"  # what decode alone leaves
    got = fields(tok, 'Sure, [TOOL_CALLS] get_weather [ARGS] {"city": "Paris"}', "mistral")
    calls = got.extra["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert got.generated_text == "Sure," and got.finish_reason == "tool_calls" and got.extra["tool_call_error"] is None


def test_llama3s_special_python_tag_is_read_and_left_out_of_the_text():
    tok = Tokenizer(["<|python_tag|>"])
    got = fields(tok, '<|python_tag|> {"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3_json")
    calls = got.extra["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert got.generated_text == "" and got.extra["tool_call_error"] is None


def test_a_row_without_tools_is_decoded_as_before():
    tok = Tokenizer(["[TOOL_CALLS]"])
    got = fields(tok, "Sure, [TOOL_CALLS] calling now.", "mistral", choice="none")
    assert got.generated_text == "Sure, calling now." and got.extra["tool_calls"] is None
