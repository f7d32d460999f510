"""Tool-call parsers: an answer's calls out of the syntax its family writes, as vLLM's tool parsers read them, into
OpenAI's `tool_calls` (`{id, type: "function", function: {name, arguments}}`, `arguments` a JSON string).

- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a
  call, text around them the content.
- `llama3_json` (Llama 3.1-3.3): the answer is a JSON call `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`; text before it the content.
- `pythonic` (Llama 3.2 / 4's pythonic template, Phi-4-mini): `[f(a=1, b="x"), g()]`, literal arguments only.

A call that does not parse leaves the text as it was and says why (`ParsedCalls.error`)."""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    calls: list[dict] | None  # OpenAI tool_calls; None: no call (or a call that did not parse: see error)
    content: str  # the answer without its calls (the raw text when a call did not parse)
    error: str | None = None


def call_id(output_ids, k: int) -> str:
    """A call's id, a function of the row's own tokens: the same after a resume."""
    digest = hashlib.sha256(f"{list(output_ids)}:{k}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def _call(name, arguments, output_ids, k: int) -> dict:
    if not isinstance(name, str) or not name:
        raise ValueError("a call without a function name")
    if isinstance(arguments, str):
        json.loads(arguments)  # a JSON string of the arguments: must be JSON
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        raise ValueError(f"call {name!r}: arguments must be a JSON object, got {type(arguments).__name__}")
    return {"id": call_id(output_ids, k), "type": "function", "function": {"name": name, "arguments": arguments}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str, output_ids=()) -> ParsedCalls:
    if "<tool_call>" not in text:
        return ParsedCalls(None, text)
    calls = []
    try:
        blocks = _HERMES.findall(text)
        if text.count("<tool_call>") != len(blocks):
            raise ValueError("a <tool_call> without its </tool_call>")
        for k, block in enumerate(blocks):
            obj = json.loads(block)
            if not isinstance(obj, dict):
                raise ValueError(f"call {k}: expected a JSON object")
            calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), output_ids, k))
    except ValueError as e:
        return ParsedCalls(None, text, f"hermes: {e}")
    return ParsedCalls(calls, _HERMES.sub("", text).strip())


def parse_llama3_json(text: str, output_ids=()) -> ParsedCalls:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedCalls(None, text)
    calls = []
    try:
        decoder, at, k = json.JSONDecoder(), 0, 0
        while at < len(body):
            obj, end = decoder.raw_decode(body, at)
            if not isinstance(obj, dict):
                raise ValueError(f"call {k}: expected a JSON object")
            calls.append(_call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})), output_ids, k))
            k += 1
            rest = body[end:].lstrip()
            if rest and not rest.startswith(";"):
                raise ValueError(f"text after call {k - 1}: {rest[:40]!r}")
            at = len(body) - len(rest.removeprefix(";").lstrip())
    except ValueError as e:
        return ParsedCalls(None, text, f"llama3_json: {e}")
    return ParsedCalls(calls, "")


def parse_mistral(text: str, output_ids=()) -> ParsedCalls:
    if "[TOOL_CALLS]" not in text:
        return ParsedCalls(None, text)
    content, _, rest = text.partition("[TOOL_CALLS]")
    try:
        value = json.loads(rest.strip())
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            raise ValueError("expected a JSON list of calls after [TOOL_CALLS]")
        calls = [_call(v.get("name"), v.get("arguments", {}), output_ids, k) for k, v in enumerate(value)]
    except ValueError as e:
        return ParsedCalls(None, text, f"mistral: {e}")
    return ParsedCalls(calls, content.strip())


def parse_pythonic(text: str, output_ids=()) -> ParsedCalls:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]") and "(" in body):
        return ParsedCalls(None, text)
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
            raise ValueError("expected a list of calls, [f(a=1), g()]")
        calls = []
        for k, c in enumerate(tree.elts):
            if not isinstance(c.func, ast.Name) or c.args:
                raise ValueError(f"call {k}: a plain function name and keyword arguments only")
            args = {kw.arg: ast.literal_eval(kw.value) for kw in c.keywords}
            calls.append(_call(c.func.id, args, output_ids, k))
    except (SyntaxError, ValueError) as e:
        return ParsedCalls(None, text, f"pythonic: {e}")
    return ParsedCalls(calls, "")


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral, "pythonic": parse_pythonic}


def detect(template: str | None) -> str | None:
    """The parser a chat template's call syntax calls for, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": ' in template or "ipython" in template:
        return "llama3_json"
    if "[func_name1(" in template or "pythonic" in template:
        return "pythonic"
    return None
