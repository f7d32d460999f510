"""One completion's place in its grammar (`Matcher`) and the batch fill of next-token bitmasks (`MaskFiller`).

A matcher is advanced with every token the row keeps and fills the row's bitmask for the next position; its
state is a function of the row's own tokens only, so the mask is too (batch invariance), and after a
preemption or a resume `Matcher(grammar, tokens)` rebuilds it by re-feeding them.

Threads: filling drops the GIL, so the engine may fill step N+1's masks on a thread while the forward runs, as
long as no matcher is filled and advanced at the same time (llguidance refuses a second borrow of one matcher).
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from batchjob.engine.structured.grammar import CompiledGrammar

ALL_ALLOWED = -1  # an int32 word with every bit set


class Matcher:
    """A copy of a compiled grammar's template, advanced token by token. A token that does not fit leaves the
    matcher where it was (`consume` answers False); it never enters llguidance's sticky error state through
    `consume`, `validate_prefix` or `rollback`. EOS ids (the tokenizer's) are allowed exactly where the grammar
    may end (`can_end`); once the grammar is complete (`is_finished`), EOS is the only token allowed."""

    __slots__ = ("grammar", "num_tokens", "_m", "_eos")

    def __init__(self, grammar: CompiledGrammar, tokens: Sequence[int] = ()):
        self.grammar = grammar
        self._eos = frozenset(grammar.tokenizer.eos_token_ids)
        self._m: llguidance.LLMatcher = grammar.template.deep_copy()
        self.num_tokens = 0  # tokens consumed (EOS included), the most `rollback` can undo
        if tokens and not self.consume(tokens):
            raise ValueError(f"the row's tokens do not match its grammar (valid prefix: "
                             f"{self.validate_prefix(tokens)} of {len(tokens)} tokens)")

    def consume(self, token_ids: int | Sequence[int]) -> bool:
        """Advance by these tokens, all or none: False (and no change) when one of them is not allowed."""
        tokens = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if not tokens:
            return True
        if self._m.is_stopped():  # llguidance's try/validate refuse EOS here, though consuming it is legal
            if self._m.is_error() or tokens[0] not in self._eos or len(tokens) > 1:
                return False
            ok = self._m.consume_token(tokens[0])
            self.num_tokens += ok
            return ok
        n = self._m.try_consume_tokens(tokens)
        if n == len(tokens) - 1 and tokens[n] in self._eos and self._m.is_stopped() and not self._m.is_error():
            n += self._m.consume_token(tokens[n])  # EOS right after the token that completed the grammar
        if n < len(tokens):
            if n and not self._m.rollback(n):
                raise RuntimeError(f"grammar matcher: rollback of {n} tokens failed: {self._m.get_error()}")
            return False
        self.num_tokens += n
        return True

    def validate_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (say, a speculative proposal) fit, from the front; the matcher does not move."""
        tokens = list(tokens)
        if not tokens:
            return 0
        if self._m.is_stopped():
            return int(not self._m.is_error() and tokens[0] in self._eos)
        return self._m.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (a rejected speculative suffix)."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"rollback of {n} tokens: the matcher has consumed {self.num_tokens}")
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher: rollback of {n} tokens failed: {self._m.get_error()}")
        self.num_tokens -= n

    def reset(self) -> None:
        """Back to the grammar's start, as if no token was consumed."""
        self._m = self.grammar.template.deep_copy()
        self.num_tokens = 0

    def fill(self, row: torch.Tensor) -> None:
        """Write the next-token mask into `row`: a contiguous CPU int32 view of `bitmask_words` words."""
        _check_row(row, self.grammar.tokenizer.bitmask_words)
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def fill_draft(self, rows: torch.Tensor, draft: Sequence[int]) -> int:
        """Masks for verifying a speculative proposal: `rows[j]` (j = 0..len(draft)) gets the mask after the
        row's tokens plus draft[:j]. Returns how many draft tokens fit (n); rows past n are all-allowed (their
        positions are rejected anyway, since draft[n] is masked at row n). The matcher does not move."""
        draft = list(draft)
        if rows.shape[0] < len(draft) + 1:
            raise ValueError(f"fill_draft: {len(draft)} draft tokens need {len(draft) + 1} rows, got {rows.shape[0]}")
        # on a copy, token by token: llguidance's validate_tokens does not count a rule's max_tokens, nor can it roll
        # back past one (a thinking budget: reasoning/budget.py)
        walker = self._copy()
        n = 0
        for j in range(len(draft) + 1):
            walker.fill(rows[j])
            if j == len(draft) or not walker.consume(draft[j]):
                break
            n += 1
        rows[n + 1:len(draft) + 1].fill_(ALL_ALLOWED)
        return n

    def _copy(self) -> Matcher:
        twin = Matcher.__new__(Matcher)
        twin.grammar, twin._eos, twin._m, twin.num_tokens = self.grammar, self._eos, self._m.deep_copy(), self.num_tokens
        return twin

    def can_end(self) -> bool:
        """EOS is allowed now: the tokens so far are a complete match."""
        return self._m.is_accepting()

    def is_finished(self) -> bool:
        """The grammar is complete: no token but EOS may follow, so the row is done."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a parser resource limit hit while filling), else None."""
        if not self._m.is_error():
            return None
        return self._m.get_error().strip() or "grammar matcher error"


class MaskFiller:
    """Fills a batch's int32 bitmask [rows, bitmask_words], one matcher per row (None: an unconstrained row,
    all allowed). threads=1 fills serially on the calling thread; threads > 1 spreads the rows over llguidance's
    own thread pool (worth it with idle cores, e.g. while a GPU runs the forward; on a CPU whose cores run the
    forward, the serial fill on one helper thread competes less)."""

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ValueError(f"MaskFiller threads: must be >= 1, got {threads}")
        self.threads = threads
        self._executor = llguidance.LLExecutor(num_threads=threads) if threads > 1 else None

    def fill(self, bitmask: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() or bitmask.is_cuda:
            raise ValueError(f"bitmask: need a contiguous CPU int32 [rows, words] tensor, got {bitmask.dtype} "
                             f"{tuple(bitmask.shape)} on {bitmask.device}")
        if len(matchers) > bitmask.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {len(matchers)} matchers")
        live = [(m._m, i) for i, m in enumerate(matchers) if m is not None]
        words = bitmask.shape[1]
        if live:
            _check_row(bitmask[0], matchers[live[0][1]].grammar.tokenizer.bitmask_words)
        for i, m in enumerate(matchers):
            if m is None:
                bitmask[i].fill_(ALL_ALLOWED)
        if self._executor is not None and len(live) > 1:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), words * 4, bitmask.shape[0])
        else:
            base = bitmask.data_ptr()
            for m, i in live:
                m.unsafe_compute_mask_ptr(base + i * words * 4, words * 4)


def _check_row(row: torch.Tensor, words: int) -> None:
    if row.dtype != torch.int32 or row.dim() != 1 or row.numel() != words or not row.is_contiguous() or row.is_cuda:
        raise ValueError(f"bitmask row: need a contiguous CPU int32 vector of {words} words, got {row.dtype} "
                         f"{tuple(row.shape)} on {row.device}")
