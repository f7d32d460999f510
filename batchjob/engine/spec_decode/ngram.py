"""Speculative decoding by prompt lookup (`--speculative ngram`): a decoding row whose last n tokens
occurred earlier in its own prompt or output proposes the k tokens that followed there. The step runs
the row's last token and the k proposals as one extend (the target verifies them in the normal mixed
batch); ModelRunner samples every position with the row's own random key at that output position, and
the engine keeps proposals while they equal what was sampled, plus the first token that differs (or one
past the last). Every kept token is the one the row would have drawn without speculation, so greedy and
sampled text are the same as without it, in any batch (the row keys of engine/sample/row_keys.py make the
verification exact: a point-mass proposal accepted with probability p(token), as rejection sampling does).

Rows that use penalties, banned tokens, logprobs or an unmet min_tokens do not speculate (their sampling depends on the
tokens before each position in ways the verification does not replay). A row whose proposals keep
failing backs off (it stops proposing for a while, doubling), and no row proposes in a step with more
decoding rows than `max_rows`: there the batch already fills the machine and extra tokens cost more than
they save (make bench: the speculative workload)."""
from __future__ import annotations

import weakref

from batchjob.engine.core.sequence import Sequence
from batchjob.engine.spec_decode.config import SpeculativeConfig
from batchjob.engine.spec_decode.row_index import RowIndex


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposed = 0  # tokens proposed, summed over the run
        self.accepted = 0  # of them, kept
        self._rows: weakref.WeakKeyDictionary[Sequence, RowIndex] = weakref.WeakKeyDictionary()  # a row's, while it lives

    def state(self, seq: Sequence) -> RowIndex:
        """The row's index and back-off state, made at its first proposal."""
        state = self._rows.get(seq)
        if state is None:
            state = self._rows[seq] = RowIndex()
        return state

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return not p.reads_output and p.logprobs is None and seq.num_output >= p.min_tokens

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Sets `seq.draft` on the decoding rows that propose this step (and clears it on the others)."""
        cfg = self.config
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        allowed = len(decoding) <= cfg.max_rows
        for seq in decoding:
            seq.draft = None
            if not allowed or not self.eligible(seq):
                continue
            state = self.state(seq)
            if state.skip:
                state.skip -= 1
                continue
            room = min(cfg.num_tokens, seq.params.max_tokens - seq.num_output - 1, max_model_len - seq.num_tokens)
            if room > 0:
                seq.draft = self._lookup(seq.token_ids, state, room) or None

    def fill(self, step) -> None:
        """After scheduling: proposals that need the step (a draft model's) are made here; lookups need none."""

    def _lookup(self, tokens: list[int], state: RowIndex, k: int) -> list[int]:
        cfg, ends, n_tokens = self.config, state.ends, len(tokens)
        # index every n-gram that ends before the current suffix's end (the suffix must match an earlier one)
        for end in range(max(state.indexed, cfg.ngram_min), n_tokens):
            for n in range(cfg.ngram_min, min(cfg.ngram_max, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        state.indexed = max(state.indexed, n_tokens)
        for n in range(min(cfg.ngram_max, n_tokens - 1), cfg.ngram_min - 1, -1):
            end = ends.get(tuple(tokens[n_tokens - n:]))
            if end is not None and end < n_tokens:
                return tokens[end:end + k]
        return []

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A row's verified proposal: count it, and back off a row whose proposals keep failing."""
        self.proposed += proposed
        self.accepted += accepted
        state = self.state(seq)
        state.proposed += proposed
        state.accepted += accepted
        if state.proposed >= 4 * self.config.num_tokens:
            if state.accepted < 0.25 * state.proposed:
                state.skip, state.backoff = state.backoff, min(2 * state.backoff, 256)
            else:
                state.backoff = 4
            state.proposed = state.accepted = 0
