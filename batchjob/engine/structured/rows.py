"""StructuredRows: the engine's side of structured outputs. It admits a row once its grammar is compiled
(compiles run on their own thread: a row whose grammar is pending waits, the others run), gives each
completion its matcher, fills the next step's token bitmask (on a thread while the forward runs, or before it
on a CPU), and counts what it cost (rows, compile time, mask time)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from batchjob.engine.core.sequence import Sequence
from batchjob.engine.structured.grammar import GrammarCache, GrammarState, GrammarTokenizer
from batchjob.engine.structured.matcher import Matcher


@dataclass(slots=True)
class StructuredStats:
    rows: int = 0  # completions admitted with a grammar
    failed: int = 0  # completions whose grammar did not compile
    compile_s: float = 0.0  # summed over distinct grammars
    mask_steps: int = 0  # steps that filled a mask
    mask_s: float = 0.0  # filling the masks, summed (applying them is the sampler's)


@dataclass(slots=True)
class StepMask:
    """A step's bitmask: `rows` are the logits rows it constrains; `filling` while the helper thread fills it."""
    bitmask: torch.Tensor  # int32 [len(rows), words]
    rows: torch.Tensor  # int64 indices into the step's logits rows
    filling: Future | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.filling is not None:
            self.filling.result()
        return self.bitmask, self.rows


class StructuredRows:
    def __init__(self, tokenizer, logits_width: int, overlap: bool = True):
        """`tokenizer`: the model's (batchjob.models.tokenizer.Tokenizer); the grammar vocabulary is built at
        the first structured row (0.5-1 s on a 49k vocabulary), never for a job without one. `overlap`: fill
        the masks on a helper thread while the forward runs (a GPU's forward leaves the cores idle); False
        fills them before the forward, on the caller's thread (a CPU forward uses every core, and a thread
        beside it stalls the matmuls more than the fill costs)."""
        self._tokenizer, self._width, self._overlap = tokenizer, logits_width, overlap
        self._cache: GrammarCache | None = None
        self._compiled: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.stats = StructuredStats()

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if self._tokenizer is None:
                raise ValueError("structured_outputs: this engine was built without the model's tokenizer")
            self._cache = GrammarCache(GrammarTokenizer.from_tokenizer(self._tokenizer, self._width))
        return self._cache

    def admit(self, seq: Sequence) -> GrammarState:
        """The row's grammar: PENDING while it compiles; READY once the row's matcher is set (it may run);
        FAILED with the compiler's message in `seq.error` (the row fails)."""
        spec = seq.params.structured_outputs
        status = self.cache.status(spec)
        if status.state is GrammarState.PENDING:
            return status.state
        if status.state is GrammarState.FAILED:
            self.stats.failed += 1
            seq.error = f"structured_outputs: {status.error}"
            return status.state
        if spec.key not in self._compiled:
            self._compiled.add(spec.key)
            self.stats.compile_s += status.grammar.compile_s
        seq.matcher = Matcher(status.grammar, seq.output_ids)  # a resumed or re-added row: its own tokens again
        self.stats.rows += 1
        return status.state

    def wait_compile(self, seqs: list[Sequence], timeout: float) -> None:
        """Block up to `timeout` for the first pending grammar (the engine has nothing else to run)."""
        if seqs:
            self.cache.wait(seqs[0].params.structured_outputs, timeout)

    def start_mask(self, seqs: list[Sequence], spans: list[int] | None) -> StepMask | None:
        """The bitmask for the step's sampling rows (one per row, or `spans[i]` rows for a speculating row:
        its last token and each proposal), filled on the helper thread. None when no row is structured."""
        spans = spans or [1] * len(seqs)
        if not any(s.matcher is not None for s in seqs):
            return None
        t0 = time.perf_counter()
        rows, starts, at = [], [], 0
        for s, span in zip(seqs, spans):
            if s.matcher is not None:
                starts.append((s, len(rows), span))
                rows.extend(range(at, at + span))
            at += span
        bitmask = self.cache.tokenizer.allocate_bitmask(len(rows))
        self.stats.mask_steps += 1

        def fill() -> None:
            for s, r, span in starts:
                if span == 1:
                    s.matcher.fill(bitmask[r])
                else:  # verification rows: the mask after each prefix of the proposal
                    s.matcher.fill_draft(bitmask[r:r + span], s.draft[:span - 1])
            self.stats.mask_s += time.perf_counter() - t0

        rows = torch.tensor(rows, dtype=torch.long)
        if self._overlap:
            return StepMask(bitmask, rows, self._pool.submit(fill))
        fill()
        return StepMask(bitmask, rows)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._cache is not None:
            self._cache.close()
