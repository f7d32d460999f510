"""Result rows: a row's finished completions (text, finish reason, token logprobs) -> its output columns.

A row with n > 1 runs as n Sequences; `PendingRow` gathers them and gives the row's fields once the
last one finishes. Which optional columns an output has is fixed when the job starts (`OutputColumns`),
so every part of one output folder has the same columns."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchjob.engine.core.sequence import SamplingParams, Sequence
from batchjob.job.prompt_builder import RowError, has_row_sampling

LOGPROBS = "logprobs"  # list<struct{token_id, token, logprob, top_logprobs: list<struct{token_id, token, logprob}>}>
EMBEDDING = "embedding"  # list<float32>; task = "embed" only
COMPLETIONS = "completions"  # list<struct{index, text, finish_reason, completion_tokens, logprobs}>; n > 1 only
OPENAI_COLUMNS = ("custom_id", "endpoint")  # carried from an OpenAI Batch input for the JSONL output


@dataclass(slots=True, frozen=True)
class OutputColumns:
    """The optional columns of one output folder, after the result columns."""
    keep: tuple[str, ...] = ()  # input columns copied as they are (--keep-columns, the OpenAI request's ids)
    logprobs: bool = False
    completions: bool = False
    embedding: bool = False

    @property
    def types(self) -> dict:
        """The columns of a fixed Arrow type."""
        import pyarrow as pa

        return {EMBEDDING: pa.list_(pa.float32())} if self.embedding else {}

    @property
    def names(self) -> list[str]:
        return [*self.keep, *([LOGPROBS] if self.logprobs else []), *([COMPLETIONS] if self.completions else []),
                *([EMBEDDING] if self.embedding else [])]

    def check(self, params: SamplingParams) -> None:
        """A row may ask for what its output folder has no column for only where JSONL rows differ from
        the first lines the columns were learned from."""
        if params.logprobs is not None and not self.logprobs:
            raise RowError("logprobs: this output has no logprobs column (the job sets no logprobs and the input "
                           "had no sampling/logprobs column in its first lines); set logprobs in the job")
        if params.n > 1 and not self.completions:
            raise RowError("n: this output has no completions column (the job sets n = 1 and the input had no "
                           "sampling/n column in its first lines); set n in the job")


def output_columns(keep: list[str], defaults: SamplingParams, input_columns: list[str], openai: bool) -> OutputColumns:
    per_row = openai or has_row_sampling(input_columns)
    keep = list(keep) + [c for c in (OPENAI_COLUMNS if openai else ()) if c not in keep]
    embed = defaults.pooling is not None
    cols = OutputColumns(tuple(keep), logprobs=not embed and (per_row or defaults.logprobs is not None),
                         completions=not embed and (per_row or defaults.n > 1), embedding=embed)
    clash = {LOGPROBS, COMPLETIONS, EMBEDDING} & set(keep) & set(cols.names[len(keep):])
    if clash:
        from batchjob.job.config import ConfigError

        raise ConfigError(f"keep_columns: {', '.join(sorted(clash))} would collide with the result column of that name")
    return cols


class TokenText:
    """Token id -> its text alone (as vLLM shows logprob tokens: a byte fragment of a character is U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def logprobs(self, entries: list) -> list[dict]:
        return [{"token_id": t, "token": self(t), "logprob": lp,
                 "top_logprobs": [{"token_id": i, "token": self(i), "logprob": v} for i, v in top]}
                for t, lp, top in entries]


@dataclass(frozen=True, slots=True)
class Completion:
    """One of a row's n completions: the output's `completions` column entry, plus its token ids."""
    index: int
    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: list[dict] | None
    token_ids: tuple[int, ...] = ()
    error: str | None = None  # finish_reason "error": why (a structured row's grammar that did not compile)
    embedding: list[float] | None = None  # an embed row's vector


@dataclass(slots=True, eq=False)
class PendingRow:
    n: int
    columns: OutputColumns
    done: list[Completion | None] = field(default_factory=list)
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.done = [None] * self.n

    def add(self, index: int, seq: Sequence, tokenizer, token_text: TokenText) -> bool:
        """Record completion `index`; True once all n are in."""
        det = seq.detokenizer
        if det is not None and det.stop_string is not None:
            text = det.text  # cut at the stop string
        else:
            text = tokenizer.decode(seq.output_ids)
        lps = token_text.logprobs(seq.logprobs or []) if seq.params.logprobs is not None else None
        self.done[index] = Completion(index, text, seq.finish_reason, seq.num_output, lps, tuple(seq.output_ids), seq.error,
                                      seq.embedding)
        self.prompt_tokens = seq.num_prompt
        return all(c is not None for c in self.done)

    def fields(self) -> dict:
        """The row's output fields: the first completion's text, reason and logprobs; tokens of all completions."""
        first = self.done[0]
        out = {"text": first.text, "reason": first.finish_reason, "prompt_tokens": self.prompt_tokens,
               "completion_tokens": sum(c.completion_tokens for c in self.done), "extra": {},
               "error": next((c.error for c in self.done if c.error), None)}
        if self.columns.logprobs:
            out["extra"][LOGPROBS] = first.logprobs
        if self.columns.embedding:
            out["extra"][EMBEDDING] = first.embedding
        if self.columns.completions and self.n > 1:
            out["extra"][COMPLETIONS] = [
                {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                 "completion_tokens": c.completion_tokens, "logprobs": c.logprobs} for c in self.done]
        return out
