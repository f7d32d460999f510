"""Reasoning parsers: a completion's thinking split from its answer, as vLLM's reasoning parsers and llama.cpp's
`--reasoning-format` split them, with the thinking's token count (OpenAI's `reasoning_tokens`).

- `qwen3` (Qwen3, QwQ, SmolLM3, Phi-4-reasoning, and the Qwen3 thinking releases whose template opens `<think>`
  itself): the thinking is what comes before `</think>` (a leading `<think>` dropped, blank space before it allowed).
  Without `</think>` the completion is all thinking if it was thinking (the prompt ended inside `<think>`, or the
  completion opened it: a budget or max_tokens cut it short), else it is all answer (the model did not think:
  `enable_thinking` off). A thinking that a `<tool_call>` ends without `</think>` (as some Qwen3 releases write) ends
  there, as in vLLM: the call is the answer's.
- `deepseek_r1` (DeepSeek-R1 and its distills): the same, except that a completion without `</think>` is all
  thinking (R1's templates open `<think>` in the prompt; early ones let the model think without writing it).
- `gpt_oss`: the harmony channels (reasoning/harmony.py): `analysis` is the thinking, `final` the answer, messages to
  a function the calls.

The thinking and the answer are stripped of the blank lines around them (`<think>\\n...\\n</think>\\n\\n`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchjob.errors import ConfigError
from batchjob.reasoning import harmony
from batchjob.reasoning.harmony import HarmonyParser
from batchjob.reasoning.split import Split

PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")  # --reasoning-parser's names besides auto


@dataclass(frozen=True, slots=True)
class ThinkParser:
    """A `<think>...</think>` family's parser, with the tags' token ids in this model's vocabulary."""
    name: str
    start_id: int
    end_id: int
    start: str = "<think>"
    end: str = "</think>"
    tool_call_id: int | None = None  # qwen3: `<tool_call>`, which ends a thinking left open

    def opened_by(self, prompt_ids) -> bool:
        """Whether the prompt leaves the completion inside `<think>`: its last `<think>` comes after its last
        `</think>` (a template that opens thinking itself; earlier turns' closed thinking does not count)."""
        for t in reversed(prompt_ids):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        return False

    def split(self, output_ids, decode, opened: bool, stop_text: str | None = None) -> Split:
        """`output_ids`: the completion's token ids; `decode(ids)` their text; `opened`: the prompt left it inside
        `<think>`; `stop_text`: the completion's text where a stop string cut it (its ids may run past it)."""
        ids = list(output_ids)
        first = self._opening(ids, decode)
        end = _index(ids, self.end_id, first)
        if end is None:
            if not (opened or first or self.name == "deepseek_r1"):
                return Split(None, decode(ids) if stop_text is None else stop_text, 0)
            if (call := _index(ids, self.tool_call_id, first)) is not None:
                return self._ended_by_call(ids, first, call, decode, stop_text)
            text = decode(ids[first:]) if stop_text is None else stop_text.lstrip().removeprefix(self.start)
            return Split(text.strip("\n"), "", len(ids) - first)
        content = decode(ids[end + 1:])
        if stop_text is not None:  # the answer as the stop string cut it
            content = stop_text.partition(self.end)[2] if self.end in stop_text else content
        return Split(decode(ids[first:end]).strip("\n"), content.lstrip(), end - first)

    def _opening(self, ids: list[int], decode) -> int:
        """Where the thinking starts: after a leading `<think>` (blank space before it allowed: DeepSeek-R1 may write
        a newline first), else at 0."""
        at = _index(ids, self.start_id, 0)
        if at is None or (at and decode(ids[:at]).strip()):
            return 0
        return at + 1

    def _ended_by_call(self, ids: list[int], first: int, call: int, decode, stop_text: str | None) -> Split:
        """A thinking that `<tool_call>` ended without `</think>`: the call and what follows are the answer."""
        content = decode(ids[call:])
        if stop_text is not None and TOOL_CALL in stop_text:
            content = stop_text[stop_text.index(TOOL_CALL):]
        return Split(decode(ids[first:call]).strip("\n"), content, call - first)

    def budget_lark(self, budget: int, opened: bool) -> str:
        """The Lark grammar of a completion that thinks at most `budget` tokens, as `reasoning_tokens` counts them (the
        tokens between the tags, a newline before `</think>` among them), then answers (reasoning/budget.py)."""
        thinking = f'think <[{self.end_id}]> "\\n\\n"'
        start = thinking if opened else f"(<[{self.start_id}]> {thinking})?"
        return f"start: {start} answer\nthink[max_tokens={budget}]: /(.|\\n)*/\nanswer: /(.|\\n)*/\n"


TOOL_CALL = "<tool_call>"


def _index(ids: list[int], token: int | None, start: int) -> int | None:
    """Where `token` first comes in `ids` from `start`, or None."""
    try:
        return ids.index(token, start) if token is not None else None
    except ValueError:
        return None


class ReasoningParserError(ConfigError):
    """A reasoning parser that does not fit the model, or an unknown one: the message names the option."""


ReasoningParser = ThinkParser | HarmonyParser  # split, opened_by, budget_lark, name


def job_parser(name: str | None, tokenizer, template: str | None) -> tuple[ReasoningParser | None, str | None]:
    """The job's parser and the name it resolved to ("none" when auto finds none); (None, None) without one.
    `tokenizer`: the model's (models/tokenizer.py); `template`: the chat template the job renders with."""
    if name is None:
        return None, None
    return reasoning_parser(name, tokenizer.token_id, template or tokenizer.chat_template)


def reasoning_parser(name: str, token_id: Callable[[str], int | None], template: str | None) -> tuple[ReasoningParser | None, str]:
    """(the parser for `--reasoning-parser NAME` on a model whose vocabulary gives `token_id(text)` and with this chat
    template, the name it resolved to). `auto` picks from the template and vocabulary, None where the model does not
    think."""
    if name == "auto":
        name = detect(token_id, template)
        if name is None:
            return None, "none"
    check_parser_name(name)
    if name == "gpt_oss":
        ids = {t: token_id(t) for t in harmony.TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ReasoningParserError(f"reasoning_parser 'gpt_oss': the model's vocabulary has no {missing[0]} token, so "
                                       "it does not write harmony channels (leave reasoning_parser unset)")
        return HarmonyParser.of({**ids, harmony.CONSTRAIN: token_id(harmony.CONSTRAIN)}), name
    start, end = token_id("<think>"), token_id("</think>")
    if start is None or end is None:
        raise ReasoningParserError(f"reasoning_parser {name!r}: the model's vocabulary has no <think> and </think> "
                                   "tokens, so it does not think in that format (leave reasoning_parser unset)")
    return ThinkParser(name, start, end, tool_call_id=token_id(TOOL_CALL) if name == "qwen3" else None), name


def check_parser_name(name: str, error: type[Exception] | None = None) -> None:
    """Raises `error` (ReasoningParserError) naming the choices for a name that is not one."""
    error = error or ReasoningParserError
    if name != "auto" and name not in PARSERS:
        raise error(f"reasoning_parser {name!r} is unknown; choices: auto, {', '.join(PARSERS)}")


def detect(token_id: Callable[[str], int | None], template: str | None) -> str | None:
    """The parser a model's chat template and vocabulary call for: gpt-oss's harmony template (`<|channel|>`) ->
    gpt_oss; DeepSeek-R1's template (its fullwidth `<｜Assistant｜>` turns) -> deepseek_r1; `<think>` and `</think>` in
    the vocabulary -> qwen3; else None."""
    if template and "<|channel|>" in template and token_id("<|channel|>") is not None:
        return "gpt_oss"
    if token_id("<think>") is None or token_id("</think>") is None:
        return None
    return "deepseek_r1" if template and "｜Assistant｜" in template else "qwen3"
