"""The engine's surface for its callers: one `EngineRequest` in per completion, one `RequestOutput` out per
finished request. The engine makes a request's Sequence, its incremental detokenizer (for stop strings) and its
random key (from the caller's seed, row and completion), checks that it can ever run (`Engine.submit`,
`Engine.never_fits`: a `Refusal`, its code as data), and hands back plain outputs (`Engine.run_step`); so the job and the API build and read no
engine internals. The request's parameters are `SamplingParams` and `PoolingParams` (engine/params.py) and
a structured output (engine/structured/spec.py), named here for callers; what the engine itself is built with is
in engine/config.py."""
from __future__ import annotations

from typing import NamedTuple

from batchjob.engine.params import ImageSlot, Pooling, PoolingParams, Refusal, RefusalCode, SamplingParams, invalid
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.structured.spec import StructuredOutputs, StructuredOutputsError, from_response_format

__all__ = ["EngineRequest", "ImageSlot", "Pooling", "PoolingParams", "Refusal", "RefusalCode", "RequestOutput", "SamplingParams",
           "StructuredOutputs", "StructuredOutputsError", "from_response_format", "invalid"]


class EngineRequest(NamedTuple):  # NamedTuples: immutable, and cheap to make (one per row of a job)
    prompt_ids: list[int]  # kept as given (the engine never changes it; nor may the caller while it runs)
    params: SamplingParams
    seed: int  # the job's seed: with row_index and completion, the request's own random stream
    row_index: int
    completion: int = 0  # which of the row's n completions (or of an embeddings line's inputs)
    lane: str = "default"
    images: tuple[ImageSlot, ...] = ()  # the prompt's images: their placeholder runs, digests and pixel values
    lora: int = -1  # the LoRA adapter's slot on the model (batchjob/lora/apply.py); -1: the base model


class RequestOutput(NamedTuple):
    """A finished request: its tokens, why it ended, and what it asked for besides (logprobs, an embedding)."""
    request_id: int  # what Engine.submit returned
    params: SamplingParams
    prompt_ids: list[int]  # the request's own list, handed back
    output_ids: tuple[int, ...]
    finish_reason: str
    stop_text: str | None  # the text cut at the stop string that ended it; None: decode output_ids
    logprobs: list | None  # params.logprobs set: one (token id, logprob, top) per output token
    prompt_logprobs: list | None
    embedding: list[float] | None
    error: str | None  # finish_reason "error": why
    lane: str
    queued_s: float | None  # from entering the queue to its first step (None: it never ran)

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        det = seq.detokenizer
        return cls(seq.seq_id, seq.params, seq.prompt_ids, tuple(seq.output_ids), seq.finish_reason,
                   det.text if det is not None and det.stop_string is not None else None,
                   (seq.logprobs or []) if seq.params.logprobs is not None else None, seq.prompt_logprobs,
                   seq.embedding, seq.error, seq.lane,
                   None if seq.first_scheduled_at is None else seq.first_scheduled_at - seq.enqueued_at)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)
