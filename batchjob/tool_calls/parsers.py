"""Tool-call parsers: an answer's calls out of the syntax its family writes, as vLLM's tool parsers read them, into
OpenAI's `tool_calls` (`{id, type: "function", function: {name, arguments}}`, `arguments` JSON text of an object).

- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a
  call; the last one may stay open (the answer ends inside it, its JSON whole).
- `llama3_json` (Llama 3.1-3.3): JSON calls `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`),
  separated by `;`, found anywhere in the text as vLLM finds them (prose around them is content).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (tokenizers before v11), or
  `[TOOL_CALLS]name{...}` for each call (v11 on: Mistral Small 3.2, Magistral, Devstral; with `[ARGS]` before the
  arguments and `[CALL_ID]id` after the name where the tokenizer writes them).
- `pythonic` (Llama 3.2 / 4's pythonic template, Phi-4-mini): `[f(a=1, b="x"), g()]`, literal arguments only.
- `openai` (gpt-oss): harmony messages addressed to a function (`to=functions.NAME`), which the `gpt_oss` reasoning
  parser sets apart from the answer (reasoning/harmony.py).

Any text gives calls, or none. A call that was started and does not parse refuses every call of the answer, as in
vLLM: the text stays as it was and `ParsedCalls.error` says why. No parser raises, and `arguments` is always JSON text
(tool_calls/arguments.py)."""
from __future__ import annotations

import ast
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from batchjob.tool_calls.arguments import kind, literal, loads, object_text, raw_decode

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai")


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    calls: list[dict] | None  # OpenAI tool_calls; None: no call (or a call that did not parse: see error)
    content: str  # the answer's text outside its calls (the raw text when a call did not parse)
    error: str | None = None


def call_id(output_ids, k: int) -> str:
    """A call's id, a function of the row's own tokens: the same after a resume."""
    digest = hashlib.sha256(f"{list(output_ids)}:{k}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def _call(name, arguments, output_ids, k: int) -> dict:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"call {k}: a call without a function name")
    if not name.isprintable():  # control characters, or a lone surrogate (no UTF-8 holds one)
        raise ValueError(f"call {k}: the function name {name[:40]!r} is not printable text")
    try:
        text = object_text(arguments)
    except ValueError as e:
        raise ValueError(f"call {k} ({name}): {e}") from None
    return {"id": call_id(output_ids, k), "type": "function", "function": {"name": name, "arguments": text}}


def _outside(pieces) -> str:
    """The answer's text around its calls: each piece without the blank space at its ends, one a line."""
    return "\n".join(p.strip() for p in pieces if p.strip())


def _never_raises(parse):
    """A parser that answers any text: an exception it did not foresee is the answer's error, never the job's."""
    name = parse.__name__.removeprefix("parse_")

    @functools.wraps(parse)
    def guarded(text: str, *args) -> ParsedCalls:
        try:
            return parse(text, *args)
        except Exception as e:  # noqa: BLE001 - a model's text must not fail a job
            return ParsedCalls(None, text, f"{name}: the calls could not be read ({type(e).__name__}: {e})")
    return guarded


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@_never_raises
def parse_hermes(text: str, output_ids=()) -> ParsedCalls:
    if "<tool_call>" not in text:
        return ParsedCalls(None, text)
    calls, outside, at = [], [], 0
    try:
        for k, m in enumerate(_HERMES.finditer(text)):
            outside.append(text[at:m.start()])
            at = m.end()
            block = m.group(1) if m.group(1) is not None else m.group(2)
            try:
                obj = loads(block)
            except ValueError as e:
                raise ValueError(f"call {k}: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"call {k}: expected a JSON object, got {kind(obj)}")
            calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), output_ids, k))
    except ValueError as e:
        return ParsedCalls(None, text, f"hermes: {e}")
    outside.append(text[at:])
    return ParsedCalls(calls, _outside(outside))


_PYTHON_TAG = "<|python_tag|>"


@_never_raises
def parse_llama3_json(text: str, output_ids=()) -> ParsedCalls:
    """Every top-level JSON object of the text is a call (vLLM's reading); a text that starts with one (or with
    `<|python_tag|>`) started a call, so one that does not parse is an error; in prose it is just text."""
    started = _PYTHON_TAG in text or text.lstrip().startswith("{")
    calls, outside, at = [], [], 0
    try:
        while (start := text.find("{", at)) != -1:
            try:
                obj, end = raw_decode(text, start)
            except ValueError as e:
                raise ValueError(f"call {len(calls)}: {e}") from None
            arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
            calls.append(_call(obj.get("name"), arguments, output_ids, len(calls)))
            outside.append(text[at:start])
            at = end
        if started and not calls:
            raise ValueError(f"no JSON call after {_PYTHON_TAG}")
    except ValueError as e:
        return ParsedCalls(None, text, f"llama3_json: {e}" if started else None)
    if not calls:
        return ParsedCalls(None, text)
    outside.append(text[at:])
    return ParsedCalls(calls, _outside(p.replace(_PYTHON_TAG, "").strip(" \t\r\n;") for p in outside))


_TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[^\s\[\]{}]*\s*)?(?:\[ARGS\]\s*)?(?=\{)")
_LIST = re.compile(r"\[\s*\{")


@_never_raises
def parse_mistral(text: str, output_ids=()) -> ParsedCalls:
    if _TOOL_CALLS not in text:
        return ParsedCalls(None, text)
    content, *chunks = text.split(_TOOL_CALLS)
    calls, outside = [], [content]
    try:
        for chunk in chunks:
            found, rest = _mistral_calls(chunk, len(calls))
            calls += [_call(name, arguments, output_ids, len(calls) + i) for i, (name, arguments) in enumerate(found)]
            outside += rest
    except ValueError as e:
        return ParsedCalls(None, text, f"mistral: {e}")
    return ParsedCalls(calls, _outside(outside))


def _mistral_calls(chunk: str, k: int) -> tuple[list[tuple], list[str]]:
    """The (name, arguments) of the calls written after one `[TOOL_CALLS]` (`k`: the first one's number), and the text
    around them: `name{...}` (v11 on), or a JSON list of calls (or one call), junk before it allowed as vLLM does."""
    named = _NAMED.match(chunk)
    if named:
        try:
            arguments, end = raw_decode(chunk, named.end())
        except ValueError as e:
            raise ValueError(f"call {k} ({named.group(1)}): {e}") from None
        return [(named.group(1), arguments)], [chunk[end:]]
    body = chunk.lstrip()
    starts = [len(chunk) - len(body)] if body.startswith(("[", "{")) else []
    if (m := _LIST.search(chunk)) is not None and m.start() not in starts:
        starts.append(m.start())
    if not starts:
        raise ValueError(f"call {k}: expected a call after {_TOOL_CALLS}, got {body[:40]!r}")
    for n, start in enumerate(starts):
        try:
            value, end = raw_decode(chunk, start)
            break
        except ValueError as e:
            if n == len(starts) - 1:
                raise ValueError(f"call {k}: {e}") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"call {k}: expected a JSON list of calls after {_TOOL_CALLS}, got {kind(value)}")
    return [(v.get("name"), v.get("arguments", {})) for v in value], [chunk[:start], chunk[end:]]


_PYTHONIC = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")


@_never_raises
def parse_pythonic(text: str, output_ids=()) -> ParsedCalls:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not _PYTHONIC.match(body):
        return ParsedCalls(None, text)
    try:
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as e:
            raise ValueError(f"not a Python list of calls ({e.msg})") from None
        except (MemoryError, RecursionError):  # what CPython's parser raises for some deep nesting
            raise ValueError("nested deeper than Python reads") from None
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
            raise ValueError("expected a list of calls, [f(a=1), g()]")
        calls = [_pythonic_call(c, output_ids, k) for k, c in enumerate(tree.elts)]
    except ValueError as e:
        return ParsedCalls(None, text, f"pythonic: {e}")
    return ParsedCalls(calls, "")


def _pythonic_call(c: ast.Call, output_ids, k: int) -> dict:
    if not isinstance(c.func, ast.Name):
        raise ValueError(f"call {k}: the function must be a plain name, got `{ast.unparse(c.func)[:40]}`")
    if c.args or any(kw.arg is None for kw in c.keywords):
        raise ValueError(f"call {k} ({c.func.id}): keyword arguments only (a=1)")
    arguments = {}
    for kw in c.keywords:
        try:
            arguments[kw.arg] = literal(kw.value)
        except ValueError as e:
            raise ValueError(f"call {k} ({c.func.id}): argument {kw.arg}: {e}") from None
    return _call(c.func.id, arguments, output_ids, k)


@_never_raises
def parse_openai(text: str, output_ids=(), messages=None) -> ParsedCalls:
    """`messages`: the harmony messages the answer addressed to tools (reasoning/split.py's `Split.calls`); those to
    `functions.NAME` are calls (others, to a built-in tool such as `browser.search`, are not)."""
    if messages is None:
        return ParsedCalls(None, text, "openai: reads gpt-oss's harmony messages, which only the gpt_oss reasoning "
                                       "parser sets apart (--reasoning-parser gpt_oss)")
    calls = []
    try:
        for m in messages:
            if m.recipient.startswith("functions."):
                calls.append(_call(m.recipient.removeprefix("functions."), m.body, output_ids, len(calls)))
    except ValueError as e:
        return ParsedCalls(None, text, f"openai: {e}")
    return ParsedCalls(calls or None, text)


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral, "pythonic": parse_pythonic,
         "openai": parse_openai}


def parse(parser: str, text: str, output_ids=(), messages=None) -> ParsedCalls:
    """The calls in an answer by the job's tool parser. `messages`: the answer's harmony messages addressed to tools
    (`Split.calls`), which the `openai` parser reads instead of the text."""
    if parser == "openai":
        return parse_openai(text, output_ids, messages)
    return PARSE[parser](text, output_ids)


# each parser's tags: tokenizers mark several of them special (Mistral's [TOOL_CALLS], [ARGS], [CALL_ID]; Llama 3's
# <|python_tag|>; Llama 4's <|python_start|>), and the answer is decoded without special tokens, which would leave the
# parser nothing to find: a tool row's answer keeps them (vLLM decodes such rows with skip_special_tokens=False)
TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",),
        "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), "pythonic": ("<|python_start|>", "<|python_end|>"),
        "openai": ()}


def tag_decoder(parser: str, token_id: Callable[[str], int | None], decode: Callable[[list[int]], str]
                ) -> Callable[[list[int]], str]:
    """`decode` (special tokens left out) that writes the parser's tags the vocabulary has as tokens, where `decode`
    would leave them out; the text between tags is decoded as before."""
    tags = {i: tag for tag in TAGS[parser] if (i := token_id(tag)) is not None and decode([i]) != tag}
    if not tags:
        return decode

    def keeping(ids) -> str:
        ids, out, start = list(ids), [], 0
        for k, t in enumerate(ids):
            if t in tags:
                out += [decode(ids[start:k]), tags[t]]
                start = k + 1
        return "".join(out) + decode(ids[start:])

    return keeping


def detect(template: str | None) -> str | None:
    """The parser a chat template's call syntax calls for, or None."""
    if not template:
        return None
    if "<|channel|>" in template or "to=functions" in template:
        return "openai"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": ' in template or "ipython" in template:
        return "llama3_json"
    if "[func_name1(" in template or "pythonic" in template:
        return "pythonic"
    return None
