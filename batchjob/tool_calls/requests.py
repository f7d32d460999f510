"""A row's tools and tool_choice, as OpenAI's chat API takes them (`tools`: function definitions; `tool_choice`:
"auto", "none", "required" or `{"type": "function", "function": {"name": ...}}`), read from a row's columns or an
OpenAI Batch body and checked; ValueError names the field."""
from __future__ import annotations

import json
from dataclasses import dataclass

CHOICES = ("auto", "none", "required")
TOOLS_COLUMN, TOOL_CHOICE_COLUMN, PARALLEL_COLUMN = "tools", "tool_choice", "parallel_tool_calls"  # a row's fields


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict  # the arguments' JSON schema ({"type": "object"} when the definition gives none)
    definition: dict  # as given ({"type": "function", "function": {...}}): what the chat template renders


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # auto | none | required | the name of the one function to call
    parallel: bool = True  # OpenAI's parallel_tool_calls: several calls in one answer (false: at most one)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a call must be one of where the choice forces a call (required: any; a name: that one); ()
        where it does not (auto, none)."""
        if self.choice == "required":
            return self.tools
        if self.choice in ("auto", "none"):
            return ()
        return tuple(t for t in self.tools if t.name == self.choice)


def _json(value, where: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from None
    return value


def tool_request(tools, tool_choice, parallel_tool_calls=None) -> ToolRequest | None:
    """The row's request (None: no tools and no choice, or tool_choice "none" without tools)."""
    tools = _json(tools, "tools")
    if isinstance(tool_choice, str) and tool_choice.lstrip().startswith("{"):  # a named function as JSON text (CSV)
        tool_choice = _json(tool_choice, "tool_choice")
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a list of function definitions, got {type(tools).__name__}")
    parsed = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: a non-empty string is required")
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object")
        parsed.append(Tool(name, params, {"type": "function", "function": fn}))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_choice: expected auto, none, required or {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}}, got {json.dumps(choice)}")
        if fn["name"] not in names:
            raise ValueError(f"tool_choice: function {fn['name']!r} is not among the tools ({', '.join(names)})")
        choice = fn["name"]
    elif choice not in CHOICES:
        raise ValueError(f"tool_choice: expected auto, none, required or a named function, got {choice!r}")
    if parallel_tool_calls not in (None, True, False):
        raise ValueError(f"parallel_tool_calls: expected true or false, got {parallel_tool_calls!r}")
    return ToolRequest(tuple(parsed), choice, parallel_tool_calls is not False)


def carries_tools(record: dict) -> bool:
    """Whether a row asks for tool calls: tools, or a tool_choice other than none."""
    return record.get(TOOLS_COLUMN) not in (None, []) or record.get(TOOL_CHOICE_COLUMN) not in (None, "none")
