"""A call's arguments as JSON text (RFC 8259): what a tool parser read, decoded strictly (no NaN or Infinity, no number
too large for a float) and written back as a JSON object; the pythonic syntax's Python literals turned into JSON values.
What no JSON holds (bytes, sets, complex numbers, a name instead of a literal) is a ValueError that names it."""
from __future__ import annotations

import ast
import json
import math


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]} is too large for a float")
    return value


DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def loads(text: str):
    """The one JSON value `text` holds (whitespace around it allowed), read strictly."""
    try:
        return DECODER.decode(text)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None


def raw_decode(text: str, at: int) -> tuple[object, int]:
    """The JSON value that starts at `text[at]`, read strictly, and where it ends."""
    try:
        return DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None


_TOO_DEEP = "JSON nested deeper than Python reads"


def dumps(value) -> str:
    """JSON text of a JSON value: its strings as written, or \\u-escaped where one holds a lone surrogate (a JSON escape
    can write one, UTF-8 cannot)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, allow_nan=False)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    return text


def kind(value) -> str:
    """A JSON value's kind, for errors: "a list", "a string"."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return names.get(type(value), f"a Python {type(value).__name__}")


def object_text(arguments) -> str:
    """A call's arguments as JSON text of an object: a dict read from JSON, or JSON text of one."""
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments must be a JSON object, got {kind(arguments)}")
    return dumps(arguments)


_KEYS = (str, int, float, type(None))  # what json.dumps writes as an object's key (bool is an int)


def literal(node: ast.expr):
    """The JSON value a pythonic argument writes: a string, a finite number (signed), True/False/None, a list or tuple,
    a dict (its keys constants), of those."""
    if isinstance(node, ast.Constant):
        return _constant(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = _constant(node.operand.value)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):  # keys as JSON writes them, as vLLM's: 1 -> "1", None -> "null"
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, _KEYS) for k in node.keys):
            raise ValueError("a dict's keys must be strings, numbers, True/False or None")
        return {k.value: literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"`{ast.unparse(node)[:40]}` is not a literal (a string, number, True/False/None, list or dict)")


def _constant(value):
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, float):
        raise ValueError(f"{value!r} is not a JSON number")
    raise ValueError(f"{repr(value)[:40]} is not a JSON value (a {type(value).__name__})")
