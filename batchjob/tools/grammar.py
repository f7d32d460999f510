"""Valid calls, not hoped-for ones: for `tool_choice` "required" or a named function, the grammar that keeps decoding
inside the parser's call syntax, with each call's `arguments` matching its tool's JSON schema (llguidance's `%json`
inside a Lark grammar, run by the structured-output engine like any row's grammar). A tag the vocabulary holds as one
token (`<tool_call>` in Qwen's) is written as that token, as the model writes it."""
from __future__ import annotations

import json
from collections.abc import Callable

from batchjob.tools.requests import Tool

CONSTRAINED = ("hermes", "mistral", "llama3_json")  # parsers whose call syntax has a grammar here


def _calls_schema(tools: tuple[Tool, ...], arguments_key: str = "arguments") -> dict:
    """One call: {"name": one of the tools, its arguments by that tool's schema}."""
    one = [{"type": "object", "properties": {"name": {"const": t.name}, arguments_key: t.parameters},
            "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return one[0] if len(one) == 1 else {"anyOf": one}


def _literal(text: str, token_id: Callable[[str], int | None]) -> str:
    """A tag as the grammar writes it: its token where the vocabulary has it whole, else its text."""
    tid = token_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def call_grammar(parser: str, tools: tuple[Tool, ...], single: bool, token_id: Callable[[str], int | None]) -> str:
    """The Lark grammar of an answer that is one call (`single`: a named function) or one or more, of `tools`."""
    if parser == "hermes":
        call = (f'call: {_literal("<tool_call>", token_id)} "\\n" %json {json.dumps(_calls_schema(tools))} "\\n" '
                f'{_literal("</tool_call>", token_id)}\n')
        return ("start: call\n" if single else 'start: call ("\\n" call)*\n') + call
    if parser == "mistral":
        items = {"type": "array", "items": _calls_schema(tools), "minItems": 1, **({"maxItems": 1} if single else {})}
        return f'start: {_literal("[TOOL_CALLS]", token_id)} %json {json.dumps(items)}\n'
    if parser == "llama3_json":
        call = f"call: %json {json.dumps(_calls_schema(tools, 'parameters'))}\n"
        return ("start: call\n" if single else 'start: call ("; " call)*\n') + call
    raise ValueError(f"tool_choice: the {parser} parser's calls cannot be constrained yet (use auto)")
