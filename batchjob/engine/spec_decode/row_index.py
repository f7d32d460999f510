"""A speculating row's state, kept by its proposer (weakly keyed by the row: gone with it): the n-gram index of prompt lookup (ngram.py), its
back-off, and how far a draft model's cache has caught up with the row (draft.py)."""
from __future__ import annotations


class RowIndex:
    """Per row: the latest end of each n-gram seen so far (n in ngram_min..ngram_max), kept up to date as
    tokens arrive, so a lookup is a few dict reads whatever the row's length; and the back-off state."""

    __slots__ = ("ends", "indexed", "proposed", "accepted", "skip", "backoff", "computed", "preemptions")

    def __init__(self):
        self.ends: dict[tuple, int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.proposed = self.accepted = 0  # since the last back-off decision
        self.skip = 0  # steps left without proposing
        self.backoff = 4
        self.computed = 0  # a draft model: positions whose K/V its cache holds (engine/spec_decode/draft.py)
        self.preemptions = -1  # ... as of the row's preemption count then
