"""What a row asks its output to match: `StructuredOutputs`, parsed from the row's `structured_outputs` (vLLM's
StructuredOutputsParams names) or from an OpenAI `response_format`, with the canonical grammar text that keys the
compile cache and its translation into the grammar llguidance compiles.

Parsing checks the shape only (one known key, the right type, JSON text that parses). Whether a schema, regex or
grammar compiles is the compiler's to say (grammar.py), so its message reaches the row as it was written.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")
_ANY_OBJECT = '{"type":"object"}'
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=")  # `root ::= ...`; Lark writes `start: ...`


class StructuredOutputsError(ValueError):
    """A `structured_outputs` or `response_format` value of the wrong shape; the message names the field."""


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One constraint on a completion. `text` is its canonical grammar text: the JSON schema as compact JSON
    (key order kept), the regex, the choices as a JSON list, the grammar as given ("" for `json_object`)."""

    kind: Kind
    text: str

    @property
    def key(self) -> str:
        """The compile cache's key: equal for two specs exactly when they compile to the same grammar text."""
        return f"{self.kind}:{hashlib.sha256(self.text.encode()).hexdigest()}"

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise AttributeError(f"a {self.kind} spec has no choices")
        return json.loads(self.text)

    @property
    def grammar_syntax(self) -> Literal["lark", "gbnf"] | None:
        """For a `grammar`: GBNF when it writes rules as `name ::= ...` (llama.cpp), else Lark."""
        if self.kind != "grammar":
            return None
        return "gbnf" if _GBNF_RULE.search(self.text) else "lark"

    def to_llguidance(self) -> str:
        """The grammar llguidance's `LLMatcher` takes (its JSON grammar format). Raises ValueError with the
        converter's message for a GBNF grammar that does not convert; errors in the grammar itself surface
        when it is compiled."""
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(self.choices))
        if self.grammar_syntax == "gbnf":
            try:
                lark = gbnf_to_lark(self.text)
            except Exception as e:  # noqa: BLE001 - the converter raises its own error types and plain ones
                raise ValueError(f"GBNF grammar does not convert to Lark: {e}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


def choice_lark(choices: list[str]) -> str:
    """An alternation of literal strings; Lark string literals take JSON's escapes (quotes, backslashes,
    newlines, \\u escapes)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def parse_structured_outputs(value: Any, field: str = "structured_outputs") -> StructuredOutputs | None:
    """A row's `structured_outputs`: a dict (or the JSON text of one) with exactly one of `json` (a JSON schema:
    object or JSON text), `json_object: true`, `regex`, `choice` (list of strings), `grammar` (Lark or GBNF).
    Keys set to null count as absent; None or an all-null dict gives None (no constraint)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _json(value, f"{field}: not valid JSON")
    if not isinstance(value, dict):
        raise StructuredOutputsError(f"{field}: expected an object with one of {_allowed()}, got {_type(value)}")
    unknown = sorted(k for k in value if k not in KINDS)
    if unknown:
        raise StructuredOutputsError(f"{field}: unknown key{'s' if len(unknown) > 1 else ''} "
                                     f"{', '.join(map(repr, unknown))}; allowed: {_allowed()}")
    given = [k for k in KINDS if value.get(k) is not None]
    if len(given) > 1:
        raise StructuredOutputsError(f"{field}: give exactly one of {_allowed()}, got {', '.join(given)}")
    if not given:
        return None
    kind = given[0]
    return _parse_kind(kind, value[kind], f"{field}.{kind}")


def from_response_format(value: Any, field: str = "response_format") -> StructuredOutputs | None:
    """OpenAI's `response_format`: `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`,
    `{"type": "json_object"}`, or `{"type": "text"}` (None: no constraint)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredOutputsError(f"{field}: expected an object with a 'type', got {_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object", "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise StructuredOutputsError(f"{field}.json_schema: expected an object with 'name' and 'schema', "
                                         f"got {_type(inner)}")
        if "schema" not in inner:
            raise StructuredOutputsError(f"{field}.json_schema: missing 'schema' (the JSON schema to match)")
        return _parse_kind("json", inner["schema"], f"{field}.json_schema.schema")
    raise StructuredOutputsError(f"{field}.type: {kind!r} is not one of 'json_schema', 'json_object', 'text'")


def _parse_kind(kind: Kind, raw: Any, field: str) -> StructuredOutputs:
    if kind == "json":
        schema = _json(raw, f"{field}: the schema is not valid JSON") if isinstance(raw, str) else raw
        if not isinstance(schema, dict):
            raise StructuredOutputsError(f"{field}: a JSON schema must be an object, got {_type(schema)}")
        # compact, key order kept: the order of `properties` is the order the output writes them in
        return StructuredOutputs("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if kind == "json_object":
        if raw is not True:
            raise StructuredOutputsError(f"{field}: must be true (any JSON object), got {raw!r}")
        return StructuredOutputs("json_object", "")
    if kind == "choice":
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) for c in raw):
            raise StructuredOutputsError(f"{field}: expected a non-empty list of strings, got {_type(raw)}")
        return StructuredOutputs("choice", json.dumps(list(dict.fromkeys(raw)), ensure_ascii=False))
    if not isinstance(raw, str) or not raw.strip():
        what = "a regular expression" if kind == "regex" else "a Lark or GBNF grammar"
        raise StructuredOutputsError(f"{field}: expected {what} as a non-empty string, got {_type(raw)}")
    return StructuredOutputs(kind, raw)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StructuredOutputsError(f"{what} ({e})") from None


def _allowed() -> str:
    return ", ".join(KINDS)


def _type(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.60}"
