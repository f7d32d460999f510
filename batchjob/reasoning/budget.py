"""The thinking budget (`max_reasoning_tokens`): a row that has thought N tokens is made to close its thinking and
answer, as llama.cpp's `--reasoning-budget` and vLLM's thinking budget do. It is a grammar the structured-output
engine runs (engine/structured/): the thinking is a rule of at most N tokens (llguidance's `max_tokens`), then the
family's end of thinking (`</think>` and a blank line) is the only way on, then the answer is free. A grammar's state
is a function of the row's own tokens, so the budget holds exactly across resume, preemption, speculative decoding
and any batch. Where the prompt leaves the completion inside `<think>` (a template that opens it) the completion
starts in the budgeted rule; elsewhere the model may open `<think>` itself, and the budget applies from there."""
from __future__ import annotations

import dataclasses

from batchjob.engine.requests import SamplingParams, StructuredOutputs
from batchjob.reasoning.parsers import ReasoningParser


def with_budget(params: SamplingParams, parser: ReasoningParser | None, prompt_ids) -> SamplingParams:
    """A row's parameters with its thinking budget as its grammar (unchanged without a budget). ValueError
    ("field: why") for a budget the row cannot have."""
    if params.max_reasoning_tokens is None:
        return params
    if parser is None:
        raise ValueError("max_reasoning_tokens: needs a reasoning parser (reasoning_parser), which knows where the "
                         "model's thinking ends")
    if params.structured_outputs is not None:
        raise ValueError("max_reasoning_tokens: a thinking budget and structured outputs on one row are not "
                         "supported yet")
    grammar = parser.budget_lark(params.max_reasoning_tokens, parser.opened_by(prompt_ids))
    return dataclasses.replace(params, structured_outputs=StructuredOutputs(kind="grammar", text=grammar))
