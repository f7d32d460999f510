"""A job's tool rows (issue 36): the tool parser the job resolved, each row's tools and tool_choice read (a row's
`tools` and `tool_choice` columns, or an OpenAI Batch body's) for its chat template, and for `required` or a named
function the call grammar that keeps its decoding inside the parser's syntax. Problems are the row's (RowError)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchjob.engine.requests import SamplingParams, StructuredOutputs
from batchjob.errors import ConfigError
from batchjob.tool_calls.grammar import AUTO_CONSTRAINED, CONSTRAINED, auto_grammar, call_grammar
from batchjob.tool_calls.parsers import PARSERS, detect
from batchjob.tool_calls.requests import (PARALLEL_COLUMN, TOOL_CHOICE_COLUMN, TOOLS_COLUMN, ToolRequest, carries_tools,
                                     tool_request)


class ToolRowError(ValueError):
    """A row's tools that cannot run: the message names the field (the prompt builder makes it the row's error)."""


@dataclass(frozen=True, slots=True)
class ToolRows:
    parser: str  # hermes | llama3_json | mistral | pythonic
    token_id: Callable[[str], int | None]  # the model's vocabulary (a tag that is one token is written as it)
    renders_tools: bool  # the chat template reads `tools`

    @classmethod
    def of(cls, name: str | None, tokenizer, template: str | None, implied: bool = False,
           reasoning_parser: str | None = None) -> ToolRows | None:
        """The job's tool rows for `tool_parser` NAME (None: the job parses no calls); `implied`: the job named no
        parser, its rows carry tools (job/inputs.py: auto); `reasoning_parser`: the job's (the `openai` parser reads
        the messages the gpt_oss one sets apart). ConfigError for auto on a template whose call syntax is none we
        know, and for `openai` without the harmony split."""
        if name is None:
            return None
        template = template or tokenizer.chat_template
        picked = name == "auto"
        if picked:
            name = detect(template)
            if name is None:
                why = ("tool_parser: the rows carry `tools` and the job names no tool parser; auto" if implied
                       else "tool_parser auto")
                raise ConfigError(f"{why}: the chat template writes no tool-call syntax batchjob knows; name the "
                                  f"parser, --tool-parser NAME ({', '.join(PARSERS)})")
        if name == "openai" and reasoning_parser not in ("gpt_oss", "auto"):
            how = " (auto, for the chat template's harmony format)" if picked else ""
            raise ConfigError(f"tool_parser openai{how}: gpt-oss's calls are harmony messages addressed to a "
                              "function, which the gpt_oss reasoning parser sets apart; run with --reasoning-parser "
                              "gpt_oss (or auto)")
        return cls(name, tokenizer.token_id, template is not None and "tools" in template)

    def request(self, record: dict) -> ToolRequest | None:
        if record.get(TOOLS_COLUMN) is None and record.get(TOOL_CHOICE_COLUMN) is None:
            return None
        found = tool_request(record.get(TOOLS_COLUMN), record.get(TOOL_CHOICE_COLUMN), record.get(PARALLEL_COLUMN))
        if found is not None and not self.renders_tools:
            raise ToolRowError("tools: the chat template does not render tools (it never reads `tools`); give a "
                               "template that does (--chat-template)")
        return found

    def constrain(self, params: SamplingParams, request: ToolRequest | None) -> SamplingParams:
        """A row's parameters with its call grammar: where tool_choice forces a call, its syntax; for auto, free text
        or calls constrained from their opening tag (hermes, mistral; a row with its own grammar or a thinking budget
        keeps it, its calls parsed as written)."""
        if request is None or request.choice == "none":
            return params
        if request.choice == "auto":
            if self.parser not in AUTO_CONSTRAINED or params.structured_outputs is not None \
                    or params.max_reasoning_tokens is not None:
                return params
            grammar = auto_grammar(self.parser, request.tools, not request.parallel, self.token_id)
            return dataclasses.replace(params, structured_outputs=StructuredOutputs(kind="grammar", text=grammar))
        if self.parser not in CONSTRAINED:
            raise ToolRowError(f"tool_choice {request.choice!r}: the {self.parser} parser's calls cannot be "
                               "constrained yet; use tool_choice auto")
        if params.structured_outputs is not None or params.max_reasoning_tokens is not None:
            raise ToolRowError(f"tool_choice {request.choice!r}: a forced call with structured outputs or a thinking "
                               "budget on one row is not supported yet")
        single = request.choice != "required" or not request.parallel
        grammar = call_grammar(self.parser, request.forced, single, self.token_id)
        return dataclasses.replace(params, structured_outputs=StructuredOutputs(kind="grammar", text=grammar))


def tools_refused(record: dict) -> str | None:
    """Why a row with tools cannot run in a job without a tool parser, or None. A job whose input carries tools
    reads them with `auto` (job/inputs.py); this is a row whose tools its input's first lines did not show (a JSONL
    file's columns are learned from them), or a Ray Data batch's."""
    if not carries_tools(record):
        return None
    return ("tools: this job parses no tool calls (its input showed no tools when it started); run it with "
            f"--tool-parser ({', '.join(PARSERS)}, or auto)")
