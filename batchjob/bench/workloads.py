"""Seeded synthetic workloads of token ids (W1, W2, W3). EOS is ignored, so each row generates exactly
its own `max_tokens`; the same rows go to every system."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Token ids are drawn from [TOKEN_LOW, TOKEN_HIGH): clear of the special ids at the bottom of both
# vocabularies (SmolLM2 keeps its specials below 17) and inside the smaller one (tiny Llama: 32,000).
TOKEN_LOW, TOKEN_HIGH = 100, 32000
W3_PREFIX_LEN = 200


@dataclass(slots=True, frozen=True)
class Row:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    rows: list[Row]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def useful_tokens(self) -> int:
        """Output tokens that count: each row's own max_tokens (a static batch's padding steps do not)."""
        return sum(r.max_tokens for r in self.rows)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.rows)

    def head(self, n: int) -> "Workload":
        return Workload(self.name, f"{self.description} (first {n} rows)", self.rows[:n])

    def summary(self) -> dict:
        outs = [r.max_tokens for r in self.rows]
        lens = [len(r.prompt) for r in self.rows]
        return {"name": self.name, "description": self.description, "rows": self.num_rows,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.useful_tokens,
                "prompt_len": [min(lens), max(lens)], "output_len": [min(outs), max(outs)]}


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


def w1(seed: int = 1) -> Workload:
    """64 rows, prompt 16-256 tokens, output 16-256 tokens (uniform)."""
    rng = np.random.default_rng(seed)
    rows = [Row(_ids(rng, int(rng.integers(16, 257))), int(rng.integers(16, 257))) for _ in range(64)]
    return Workload("W1", "64 rows, prompt U[16,256], output U[16,256]", rows)


def w2(seed: int = 2) -> Workload:
    """256 rows, prompt 32-512 (uniform), output exponential with mean 64, rounded, clipped to [1, 512]."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(256):
        prompt = _ids(rng, int(rng.integers(32, 513)))
        out = int(min(512, max(1, round(rng.exponential(64.0)))))
        rows.append(Row(prompt, out))
    return Workload("W2", "256 rows, prompt U[32,512], output Exp(mean 64) in [1,512]", rows)


def w3(seed: int = 3) -> Workload:
    """256 rows: one shared 200-token system prefix + a distinct 8-32-token suffix; output 16-64 (uniform).
    Short outputs keep prefill a large share of the work, which is what prefix caching saves."""
    rng = np.random.default_rng(seed)
    prefix = _ids(rng, W3_PREFIX_LEN)
    rows = [Row(prefix + _ids(rng, int(rng.integers(8, 33))), int(rng.integers(16, 65))) for _ in range(256)]
    return Workload("W3", f"256 rows, shared {W3_PREFIX_LEN}-token prefix + suffix U[8,32], output U[16,64]", rows)


WORKLOADS = {"W1": w1, "W2": w2, "W3": w3}


def make(name: str) -> Workload:
    try:
        return WORKLOADS[name]()
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
