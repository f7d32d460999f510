"""Compiled grammars: llguidance's view of the model's vocabulary (`GrammarTokenizer`), and `GrammarCache`, which
compiles each distinct spec once on a background thread and answers pending / ready / failed(message).

A compiled grammar is a pristine `LLMatcher` (the template) whose first mask was computed on the compile thread,
so its lexer states are warm; every completion gets a deep copy of it (matcher.py), which costs microseconds.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import llguidance
import tokenizers
import torch

from batchjob.engine.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    from batchjob.models.tokenizer import Tokenizer


class GrammarTokenizer:
    """The vocabulary grammars are compiled against: a `tokenizers.Tokenizer`, the EOS ids (allowed where a
    grammar may end) and the model's logits width. Ids the model has beyond the tokenizer's vocabulary exist for
    llguidance as tokens of no text, so every mask disallows them. Building one costs ~0.5-1 s on a 49k
    vocabulary: one per model."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: Sequence[int], logits_width: int | None = None):
        if not eos_token_ids:
            raise ValueError("structured outputs need the model's EOS token id(s): none given")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.logits_width: int = logits_width if logits_width is not None else self.vocab_size
        # llguidance refuses a vocabulary smaller than the tokenizer's; ids past the logits are never sampled
        self.mask_vocab: int = max(self.vocab_size, self.logits_width)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.mask_vocab, eos_token=list(self.eos_token_ids))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, logits_width: int | None = None) -> GrammarTokenizer:
        """From our `batchjob.models.tokenizer.Tokenizer` (its `.backend`, `.eos_token_ids`)."""
        return cls(tokenizer.backend, tokenizer.eos_token_ids, logits_width)

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: bit t % 32 of word t // 32 says whether token t is allowed."""
        return (self.mask_vocab + 31) // 32

    def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
        """An all-allowed int32 bitmask [rows, bitmask_words] (pinned: for a copy to the GPU that overlaps)."""
        return torch.full((rows, self.bitmask_words), -1, dtype=torch.int32, pin_memory=pin_memory)


class GrammarState(Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A ready grammar: `template` is never advanced; matchers are its deep copies."""

    spec: StructuredOutputs
    tokenizer: GrammarTokenizer
    template: llguidance.LLMatcher
    compile_s: float


@dataclass(frozen=True, slots=True)
class GrammarStatus:
    state: GrammarState
    grammar: CompiledGrammar | None = None
    error: str | None = None  # FAILED: the compiler's message


_PENDING = GrammarStatus(GrammarState.PENDING)


def compile_grammar(spec: StructuredOutputs, tokenizer: GrammarTokenizer,
                    limits: llguidance.LLParserLimits | None = None) -> GrammarStatus:
    """Compile one spec now (on the calling thread): READY with the grammar, or FAILED with the compiler's
    message (a schema, regex or grammar that does not compile; a GBNF grammar that does not convert)."""
    start = time.perf_counter()
    try:
        text = spec.to_llguidance()
    except ValueError as e:
        return GrammarStatus(GrammarState.FAILED, error=str(e))
    template = llguidance.LLMatcher(tokenizer.ll, text, log_level=0, limits=limits)
    if template.is_error():
        return GrammarStatus(GrammarState.FAILED, error=template.get_error().strip())
    # the first mask builds the lexer states every copy starts from: paid here, not in a decode step
    scratch = torch.empty(tokenizer.bitmask_words, dtype=torch.int32)
    template.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
    if template.is_error():  # a resource limit hit by the first step
        return GrammarStatus(GrammarState.FAILED, error=template.get_error().strip())
    return GrammarStatus(GrammarState.READY, CompiledGrammar(spec, tokenizer, template, time.perf_counter() - start))


class GrammarCache:
    """Each distinct spec (`spec.key`) compiled once, off the caller's thread: `status(spec)` starts a compile
    the first time it sees a spec and answers PENDING until it is done, then READY or FAILED for good. Failed
    specs are cached too, so a bad schema shared by many rows compiles once. At most `max_entries` finished
    grammars are kept (least recently asked first out); matchers made from an evicted grammar keep working."""

    def __init__(self, tokenizer: GrammarTokenizer, *, max_entries: int = 1024, workers: int = 1,
                 limits: llguidance.LLParserLimits | None = None):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._limits = limits
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._entries: OrderedDict[str, Future[GrammarStatus] | GrammarStatus] = OrderedDict()
        self._lock = threading.Lock()

    def status(self, spec: StructuredOutputs) -> GrammarStatus:
        with self._lock:
            entry = self._entries.get(spec.key)
            if entry is None:
                entry = self._pool.submit(compile_grammar, spec, self.tokenizer, self._limits)
                self._entries[spec.key] = entry
            self._entries.move_to_end(spec.key)
            if isinstance(entry, Future):
                if not entry.done():
                    return _PENDING
                entry = self._done(spec.key, entry)
            self._evict()
            return entry

    def wait(self, spec: StructuredOutputs, timeout: float | None = None) -> GrammarStatus:
        """`status`, blocking until the compile is done (tests, a synchronous caller)."""
        with self._lock:
            entry = self._entries.get(spec.key)
        if entry is None:
            self.status(spec)
            with self._lock:
                entry = self._entries[spec.key]
        if isinstance(entry, Future):
            futures.wait([entry], timeout)
        return self.status(spec)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, key: str, future: Future[GrammarStatus]) -> GrammarStatus:
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 - a library bug must fail the rows, not the engine
            result = GrammarStatus(GrammarState.FAILED, error=f"grammar compile crashed: {type(e).__name__}: {e}")
        self._entries[key] = result
        return result

    def _evict(self) -> None:
        over = len(self._entries) - self.max_entries
        if over <= 0:
            return
        for key in list(self._entries):
            if over <= 0:
                break
            if not isinstance(self._entries[key], Future):  # a compile in flight stays
                del self._entries[key]
                over -= 1
