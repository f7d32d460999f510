"""What a caller hands the engine: one `EngineRequest` per completion. The engine makes its Sequence, its
incremental detokenizer (for stop strings) and its random key (from the caller's seed, row and completion) and
checks that it can ever run (`Engine.submit`, `Engine.never_fits`); so the job and the API build no engine
internals. Outputs still leave `Engine.step` as the engine's finished Sequences (docs/design/index.md)."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine.core.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the job's seed: with row_index and completion, the request's own random stream
    row_index: int
    completion: int = 0  # which of the row's n completions (or of an embeddings line's inputs)
    lane: str = "default"
