"""What a reasoning parser makes of a completion."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AddressedMessage:
    """A harmony message the model addressed to a tool (`to=functions.get_weather`): a call for the `openai` tool
    parser (tool_calls/parsers.py), not part of the answer."""
    recipient: str  # functions.get_weather, or a built-in tool's (browser.search)
    content_type: str  # json (`<|constrain|>json`), or "" where the header names none
    body: str  # the arguments as written


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str | None  # None: the completion did not think
    content: str  # the answer (may be empty: it thought until max_tokens)
    reasoning_tokens: int  # tokens of the thinking, tags left out
    calls: tuple[AddressedMessage, ...] | None = None  # harmony's messages to tools; None: a format without them
