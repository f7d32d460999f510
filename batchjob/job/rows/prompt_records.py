"""The prompts `generate()` takes (a string, token ids, a conversation, or a dict of a job row's fields, or a
list of these), and the conversations `chat()` takes, as the input records of a job; an item that is no
prompt becomes its Result's message."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from batchjob.job.rows.prompt_builder import SAMPLING_COLUMN, SAMPLING_FIELDS, TEMPLATE_KWARGS_COLUMN

# the keys of a prompt given as a dict: what an input row of a job may carry (vLLM's prompt_token_ids too)
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "messages", SAMPLING_COLUMN, TEMPLATE_KWARGS_COLUMN,
                         "tools", "tool_choice", "parallel_tool_calls", "lora", *SAMPLING_FIELDS})


def prompt_records(prompts: Any) -> list[dict | str]:
    """One input record per prompt (the shape of a job's input row), or for an item that is not a
    prompt, the message of its Result. A single prompt counts as a list of one, as in vLLM."""
    if _is_single(prompts):
        return [_record(0, prompts)]
    if isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray)):
        return [_record(i, p) for i, p in enumerate(prompts)]
    raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")


def conversation_records(conversations: Any) -> list[dict | str]:
    """`LLM.chat`'s argument as input records: one conversation (a list of {role, content} messages) or a
    list of them, as vLLM's `LLM.chat` takes; an item that is no conversation becomes its Result's message."""
    if _is_conversation(conversations):
        return [{"messages": [dict(m) for m in conversations]}]
    if not isinstance(conversations, (list, tuple)):
        raise ValueError(f"conversations: expected a conversation (a list of {{role, content}} messages) or a "
                         f"list of conversations, got {type(conversations).__name__}")
    return [{"messages": [dict(m) for m in c]} if _is_conversation(c) else
            f"conversation {i}: expected a non-empty list of {{role, content}} messages, got {type(c).__name__}"
            for i, c in enumerate(conversations)]


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, (str, Mapping)):
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        ids = is_token_ids(prompts)
        # token ids, or one conversation (a prompt dict never has role or content)
        return ids or all(isinstance(m, Mapping) for m in prompts) and any("role" in m or "content" in m for m in prompts)
    return False


def is_token_ids(value: Any) -> bool:
    """A non-empty list (or tuple) of ints: a prompt given as token ids."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                    for t in value)


def _record(index: int, prompt: Any) -> dict | str:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, Mapping) for m in prompt):
            return {"messages": [dict(m) for m in prompt]}
        return {"prompt": list(prompt)}  # token ids, checked by the PromptBuilder
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompts[{index}]: unknown key {unknown[0]!r}; a prompt dict has {', '.join(sorted(PROMPT_KEYS))}")
        record = dict(prompt)
        if "prompt_token_ids" in record:
            if record.get("prompt") is not None:
                raise ValueError(f"prompts[{index}]: give prompt or prompt_token_ids, not both")
            record["prompt"] = record.pop("prompt_token_ids")
        return record
    return (f"prompt {index}: expected a string, a list of token ids, a list of {{role, content}} messages "
            f"or a dict, got {type(prompt).__name__}")
