"""Valid calls, not hoped-for ones: for `tool_choice` "required" or a named function, the grammar that keeps decoding
inside the parser's call syntax, with each call's `arguments` matching its tool's JSON schema (llguidance's `%json`
inside a Lark grammar, run by the structured-output engine like any row's grammar). A tag the vocabulary holds as one
token (`<tool_call>` in Qwen's) is written as that token, as the model writes it."""
from __future__ import annotations

import json
from collections.abc import Callable

from batchjob.tool_calls.requests import Tool

CONSTRAINED = ("hermes", "mistral", "llama3_json")  # parsers whose call syntax has a grammar here
AUTO_CONSTRAINED = ("hermes", "mistral")  # ... and whose calls an `auto` answer can start anywhere, after free text


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


def auto_grammar(parser: str, tools: tuple[Tool, ...], single: bool, token_id: Callable[[str], int | None]) -> str:
    """The Lark grammar of an `auto` answer: free text, or free text and then calls, each constrained from its opening
    tag on (a call the model starts is a valid one). Where the tag is one token, free text cannot write it; where it
    is text, the free text cannot contain it (a lexeme that ends at the tag: llguidance's `suffix`)."""
    more = "" if single else ' ("\\n" call)*'
    if parser == "hermes":
        opening, close = "<tool_call>", _literal("</tool_call>", token_id)
        body = f'"\\n" %json {json.dumps(_calls_schema(tools))} "\\n" {close}'
        calls = f'call: {_literal(opening, token_id)} {body}\n'
    elif parser == "mistral":
        opening = "[TOOL_CALLS]"
        items = {"type": "array", "items": _calls_schema(tools), "minItems": 1, **({"maxItems": 1} if single else {})}
        body, more, calls = f"%json {json.dumps(items)}", "", ""
    else:
        raise ValueError(f"tool_choice auto: the {parser} parser's calls cannot be constrained")
    free = "FREE: /(.|\\n)*/ & ~/(.|\\n)*" + _escaped(opening) + "(.|\\n)*/\n"
    if token_id(opening) is not None:  # one token: free text cannot write it
        return (f"start: TEXT | TEXT {_literal(opening, token_id)} {body}{more} TAIL\nTEXT: /(.|\\n)*/\n"
                f"TAIL: /\\s*/\n{calls}")
    return (f"start: FREE | lead {body}{more} TAIL\nlead[suffix={json.dumps(opening)}]: /(.|\\n)*/\n{free}"
            f"TAIL: /\\s*/\n{calls}")


def _escaped(text: str) -> str:
    """`text` as a literal inside a Lark regex."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
