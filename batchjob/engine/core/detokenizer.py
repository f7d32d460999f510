"""Incremental detokenization and stop strings: a row's text grows by a few decoded tokens per step.

Each step decodes only a short window (vLLM's prefix/read offsets): the text of the tokens since the
last emitted boundary, minus the text of the context just before it. A window whose text ends in U+FFFD
is an incomplete UTF-8 sequence (a character split across byte-level tokens); it is held back until
the next token completes it, so the text never carries a replacement character the full decode lacks.
"""
from __future__ import annotations

_CONTEXT = 5  # prompt tokens decoded before the first output token (leading-space handling)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), *,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer  # batchjob.models.tokenizer.Tokenizer (anything with decode(ids, skip_special_tokens))
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.num_output = 0
        self.stop_string: str | None = None  # the stop string that ended the row

    def step(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string ended the row (`text` is then cut there, for good)."""
        if self.stop_string is not None:
            return True
        self.ids.append(token_id)
        self.num_output += 1
        new = self._decode_new()
        if not new:
            return False
        self.text += new
        if self.stop and self.num_output > self.min_tokens:
            return self._check_stop(len(new))
        return False

    def finish(self) -> str:
        """The text, with any held-back bytes flushed (as U+FFFD when they never formed a character)."""
        if self.stop_string is None and self.read_offset < len(self.ids):
            decode = self.tokenizer.decode
            prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
            full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        return self.text

    def _decode_new(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def _check_stop(self, new_chars: int) -> bool:
        # only the new characters (and a stop string's length before them) can hold a new match
        text, best = self.text, None
        for s in self.stop:
            at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.stop_string = s
        self.text = text[:at + len(s)] if self.include_stop else text[:at]
        return True
