"""What speculative decoding runs with (`--speculative none|ngram|draft`, `--num-speculative-tokens`,
`--speculative-max-rows`, `--draft-model`), checked once when the job starts."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SpeculativeMethod(StrEnum):
    """`--speculative`: none, ngram (prompt lookup: ngram.py) or draft (a draft model: draft.py)."""
    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"


METHODS = tuple(SpeculativeMethod)


class SpeculativeError(ValueError):
    pass


@dataclass(slots=True)
class SpeculativeConfig:
    method: SpeculativeMethod = SpeculativeMethod.NONE
    num_tokens: int = 4  # k: tokens proposed per row and step
    ngram_max: int = 4  # the longest suffix looked up
    ngram_min: int = 2  # the shortest
    max_rows: int = 32  # no proposals in a step with more decoding rows than this
    draft_model: str | None = None

    def check(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeError(f"speculative: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == SpeculativeMethod.DRAFT and not self.draft_model:
            raise SpeculativeError("speculative: 'draft' needs a draft model: --draft-model PATH (a smaller model "
                                   "with the target's tokenizer)")
        if not 1 <= self.num_tokens <= 16:
            raise SpeculativeError(f"num_speculative_tokens: must be in 1..16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpeculativeError(f"speculative ngram sizes: need 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")


def speculative_config(method: str, num_tokens: int, max_rows: int, draft_model: str | None = None) -> SpeculativeConfig | None:
    """The engine's config for a job's speculative fields (None: off); raises SpeculativeError when invalid."""
    if method == SpeculativeMethod.NONE:
        return None
    spec = SpeculativeConfig(method, num_tokens=num_tokens, max_rows=max_rows, draft_model=draft_model)
    spec.check()
    return spec
