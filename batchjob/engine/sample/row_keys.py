"""Per-row random keys: a row's key from (job seed, row index, completion) or from its own seed, and the
uniform draw at each output position, a pure function of (key, position) (splitmix64, no RNG state)."""
from __future__ import annotations

from batchjob.engine.params import SamplingParams

_MASK64 = (1 << 64) - 1
SEEDED_ROW = _MASK64  # the row index a row's own seed is hashed with: no input row has it


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, row_index: int, sample_index: int = 0) -> int:
    return splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ row_index) ^ sample_index)


def sequence_key(params: SamplingParams, job_seed: int, row_index: int, sample_index: int = 0) -> int:
    """The key of completion `sample_index` of a row: from the row's own seed when it has one (the same
    seed and prompt give the same text in any row, as in vLLM), else from (job seed, row index)."""
    if params.seed is not None:
        return row_key(params.seed, SEEDED_ROW, sample_index)
    return row_key(job_seed, row_index, sample_index)


def uniform(key: int, position: int) -> float:
    """A float in [0, 1) with 53 random bits."""
    return (splitmix64(key ^ splitmix64(position)) >> 11) * (1.0 / (1 << 53))
