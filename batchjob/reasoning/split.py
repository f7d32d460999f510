"""What a reasoning parser makes of a completion."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str | None  # None: the completion did not think
    content: str  # the answer (may be empty: it thought until max_tokens)
    reasoning_tokens: int  # tokens of the thinking, tags left out
