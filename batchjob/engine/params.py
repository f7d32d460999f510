"""What a row asks of the engine: its sampling parameters (vLLM's meanings), an embed row's pooling, the images in its
prompt; and, back, why the engine refuses a row (`Refusal`: a code as data beside the message). Plain values, read
by the scheduler, the worker and the sampler alike: they live beside the engine's parts, not inside one of them, so no
part imports another for them."""
from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from batchjob.engine.structured.spec import StructuredOutputs, parse_structured_outputs

MAX_LOGPROBS = 20  # top-n logprobs per token, as vLLM's default max_logprobs
MAX_N = 128  # completions per row, as the OpenAI API


class RefusalCode(enum.StrEnum):
    """Why a row can never run, as data (the OpenAI API's error codes): callers map it, never the message's words."""
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt (+ 1 generated token) exceeds the context, the cap or the KV cache
    INVALID_REQUEST = "invalid_request"  # anything else: an empty prompt, images on a text model, a grammar that fails...


@dataclass(slots=True, frozen=True)
class Refusal:
    """A row the engine will not run: its code and the message a user reads (its str)."""
    code: RefusalCode
    message: str

    def __str__(self) -> str:
        return self.message

    def within(self, where: str) -> Refusal:
        """The same refusal, its message placed (`input[2]: ...`)."""
        return Refusal(self.code, f"{where}: {self.message}")


def invalid(message: str) -> Refusal:
    return Refusal(RefusalCode.INVALID_REQUEST, message)


class Pooling(enum.StrEnum):
    """An embed row's pooling: the last prompt position, the mean over the prompt (in fp32), or the first."""
    LAST = "last"
    MEAN = "mean"
    CLS = "cls"


POOLINGS = tuple(Pooling)


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """An embed row (`--task embed`): prefill only, no LM head; the final normed hidden states of its prompt
    pooled into one vector (docs/guide/embeddings.md)."""
    pooling: Pooling = Pooling.LAST
    normalize: bool = True  # L2, after the truncation to `dimensions`
    dimensions: int | None = None  # Matryoshka: keep the first N values; None = all

    def check(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling: must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions: must be an integer >= 1 (or unset = all), got {self.dimensions!r}")

    @property
    def reads_prefix_cache(self) -> bool:
        # last pooling computes at least the last prompt token whatever the cache holds; mean and cls
        # need every position (or the first) computed in this row
        return self.pooling == Pooling.LAST


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What a row asks of the sampler and of the stop checks; the meanings are vLLM's (docs/guide/sampling.md, "Sampling
    parameters"). Build from untrusted values with `SamplingParams.parse`, which names the bad field."""
    max_tokens: int = 256
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings unmatched, until this many tokens
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off (-1 is accepted as off, like vLLM)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled (vLLM's); () = any
    bad_words: tuple[str, ...] = ()  # vLLM's: words whose token sequences are never completed
    # their token sequences (each word alone and after a space, as vLLM), made by the row planner from the row's
    # tokenizer (job/rows/row_plan.py); the sampler bans a sequence's last token once the output ends with the rest
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: the chosen token's only); None = off
    # the logprob of each prompt token given the ones before it, with the top-n alternatives (0: none); None =
    # off. With max_tokens = 0 the row is a scoring row (`--task score`): prefill only, nothing generated
    prompt_logprobs: int | None = None
    n: int = 1  # completions per row; the job runs each as its own Sequence
    seed: int | None = None  # a row's own seed: replaces the key derived from (job seed, row index)
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must match (engine/structured/)
    # a reasoning model's thinking budget, in tokens: the job turns it into the row's grammar once the prompt is known
    # (batchjob/reasoning/budget.py); the engine runs that grammar and never reads this field
    max_reasoning_tokens: int | None = None
    pooling: PoolingParams | None = None  # an embed row: prefill only, pooled hidden states instead of tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def prefill_only(self) -> bool:
        """An embed row or a scoring row: one prefill over the prompt, no token sampled."""
        return self.pooling is not None or self.max_tokens == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def bans_tokens(self) -> bool:
        """Whether `banned_next` may ban a token for this row."""
        return bool(self.bad_words_token_ids)

    def banned_next(self, output: Seq[int]) -> Iterator[int]:
        """The tokens this row may not take after `output` (its generated tokens so far): the sampler gives each -inf,
        beside the tokens an unmet min_tokens holds back. A parameter that bans tokens says so here (and in
        `bans_tokens`); the sampler needs no part of its own.

        bad_words, as vLLM: a word's last token is banned when the output ends with the word's other tokens (the
        output only: a word begun in the prompt is not)."""
        for word in self.bad_words_token_ids:
            before = len(word) - 1
            if before == 0 or (len(output) >= before and tuple(output[len(output) - before:]) == word[:-1]):
                yield word[-1]

    @property
    def reads_output(self) -> bool:
        """Whether the row's next token depends on the tokens it generated before (penalties count them, bans match
        them): its steps run one after another (no overlapped step, no speculative proposal)."""
        return self.penalized or self.bans_tokens

    @classmethod
    def parse(cls, values: dict, base: SamplingParams | None = None) -> SamplingParams:
        """`base` with the non-null `values` replaced, coerced and checked. Raises ValueError("field: why")."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown sampling parameter; known: {', '.join(known)}")
        changes = {k: _coerce(k, v) for k, v in values.items() if v is not None}
        params = dataclasses.replace(base or cls(), **changes)
        params.check()
        return params

    def check(self) -> None:
        """Raises ValueError("field: why") for a value vLLM would refuse."""
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens: must be >= 1 (0 only with prompt_logprobs: a row that scores its prompt), "
                             f"got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be >= 0 (0 or -1 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty: must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words: words must not be empty")
        if self.bad_words_token_ids and not self.bad_words:
            raise ValueError("bad_words_token_ids: made from bad_words by the job; give the words instead")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t < 0 for t in getattr(self, name)):
                raise ValueError(f"{name}: token ids must be >= 0, got {list(getattr(self, name))}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}] (or null = off), got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}] (or null = off), got {self.prompt_logprobs}")
        if self.max_reasoning_tokens is not None and self.max_reasoning_tokens < 1:
            raise ValueError(f"max_reasoning_tokens: must be >= 1 (or null = no budget), got {self.max_reasoning_tokens}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        if self.pooling is not None:
            self.pooling.check()
            if (self.n != 1 or self.logprobs is not None or self.structured_outputs is not None
                    or self.prompt_logprobs is not None):
                raise ValueError("pooling: an embed row generates nothing: n, logprobs, prompt_logprobs and "
                                 "structured_outputs do not apply")
        elif self.max_tokens == 0 and (self.n != 1 or self.logprobs is not None or self.structured_outputs is not None):
            raise ValueError("max_tokens: a scoring row (max_tokens 0) generates nothing: n, logprobs and "
                             "structured_outputs do not apply")


_INTS = ("max_tokens", "min_tokens", "top_k", "n", "seed", "logprobs", "prompt_logprobs", "max_reasoning_tokens")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOLS = ("include_stop_str_in_output", "ignore_eos")
_TEXTS = ("stop", "bad_words")  # a string is one item


def _coerce(name: str, value):
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        return value
    if name in _INTS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        if name == "top_k" and value == -1:
            return 0
        return value
    if name in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if name in _TEXTS:
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"{name}: expected a string or a list of strings, got {value!r}")
        return tuple(value)
    if name == "bad_words_token_ids":
        raise ValueError("bad_words_token_ids: made from bad_words by the job; give the words instead")
    if name == "structured_outputs":
        return value if isinstance(value, StructuredOutputs) else parse_structured_outputs(value)
    if name == "pooling":
        if not isinstance(value, PoolingParams):
            raise ValueError("pooling: set by the job's task (--task embed), not per row")
        return value
    if name in ("stop_token_ids", "allowed_token_ids"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError(f"{name}: expected a list of integers, got {value!r}")
        return tuple(value)
    return value


@dataclass(frozen=True, slots=True)
class ImageSlot:
    """An image in a row's prompt: its placeholder tokens' run, the content digest that keys the prefix cache, and
    the pixel values its family's image encoder takes (the processor's array, [3, H, W]: the worker's to run)."""
    offset: int  # the first placeholder's position in the prompt
    length: int  # placeholder tokens: one per row of the encoder's output
    digest: str  # SHA-256 of the image (batchjob/images/sources.py)
    pixel_values: object  # numpy float32 [3, H, W]; this module stays numpy-free
    # the run's tokens attend to each other both ways (Gemma 3): the scheduler computes the run in one step, never
    # split by chunked prefill, and its tokens see the whole run (AttentionMetadata.key_ends)
    bidirectional: bool = False
