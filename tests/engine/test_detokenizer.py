"""Incremental detokenization on SmolLM2's byte-level BPE: characters split across tokens (CJK, emoji)
come out whole, the pieces add up to the full decode, and stop strings match across tokens."""
from __future__ import annotations

import pytest

from batchjob.engine.core.detokenizer import IncrementalDetokenizer

TEXTS = [
    "你好，世界。こんにちは、元気ですか？ 안녕하세요",
    "Emoji: 🙂👍🏽🇫🇷 family 👨‍👩‍👧 and math ∑∫√ done.",
    "Naïve café — “quoted” ½ · Привет, мир! 🙂 end",
]


@pytest.fixture(scope="module")
def tok(smollm2_loaded):
    return smollm2_loaded.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_come_out_whole(tok, text):
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some character is split across byte-level tokens
    d = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for i in ids:
        before = d.text
        d.step(i)
        pieces.append(d.text[len(before):])
    assert all("\ufffd" not in p for p in pieces)  # nothing is emitted until its character is complete
    assert "".join(pieces) == d.finish() == tok.decode(ids) == text


def test_stop_string_inside_split_characters(tok):
    text = TEXTS[1]
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], ("👍🏽",))
    stopped = [d.step(i) for i in ids]
    assert stopped.count(True) >= 1
    assert d.text == "Emoji: 🙂" and "\ufffd" not in d.text
    d = IncrementalDetokenizer(tok, [], ("世界",), include_stop_str_in_output=True)
    for i in tok.encode(TEXTS[0], add_special_tokens=False):
        if d.step(i):
            break
    assert d.text == "你好，世界"


def test_unfinished_bytes_are_flushed_at_the_end(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    partial = ids[:-1]  # the emoji's last byte token is missing
    d = IncrementalDetokenizer(tok, [])
    for i in partial:
        d.step(i)
    assert d.text == "ok" or d.text == "ok "
    assert d.finish() == tok.decode(partial)  # the incomplete character shows as U+FFFD, as a full decode does
