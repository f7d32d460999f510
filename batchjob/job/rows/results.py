"""Result rows: a row's finished completions (text, finish reason, token logprobs) -> its output columns.

A row with n > 1 runs as n engine requests; `PendingRow` gathers them and gives the row's fields once the
last one finishes. Which optional columns an output has is fixed when the job starts (`OutputColumns`),
so every part of one output folder has the same columns."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchjob.engine.requests import Refusal, RequestOutput, SamplingParams, invalid
from batchjob.job.rows.prompt_builder import RowError, has_row_sampling
from batchjob.tool_calls.cut_calls import complete_calls
from batchjob.tool_calls.parsers import PARSE, parse, tag_decoder
from batchjob.tool_calls.requests import ToolRequest

LOGPROBS = "logprobs"  # list<struct{token_id, token, logprob, top_logprobs: list<struct{token_id, token, logprob}>}>
EMBEDDING = "embedding"  # list<float32>; task = "embed" only
EMBEDDINGS = "embeddings"  # list<list<float32>>: an OpenAI Batch embed job's, one per input of the line
# task = "score": each prompt token's logprob given the ones before it (null for the first), their sum; rows with a
# continuation: its summed logprob, its token count and whether each of its tokens is the argmax (lm-eval's
# loglikelihood); prompt_logprobs > 0: the top alternatives per position (null for the first)
PROMPT_LOGPROBS = "prompt_logprobs"  # score: list<float64>; generate rows asking for it: like LOGPROBS, null first
PROMPT_LOGPROB_SUM = "prompt_logprob_sum"
CONTINUATION_LOGPROB = "continuation_logprob"
CONTINUATION_TOKENS = "continuation_tokens"
IS_GREEDY = "is_greedy"
PROMPT_TOP_LOGPROBS = "prompt_top_logprobs"  # score with prompt_logprobs > 0: list<list<struct{token_id, token, logprob}>>
SCORE_COLUMNS = (PROMPT_LOGPROBS, PROMPT_LOGPROB_SUM, CONTINUATION_LOGPROB, CONTINUATION_TOKENS, IS_GREEDY)
COMPLETIONS = "completions"  # list<struct{index, text, finish_reason, completion_tokens, logprobs}>; n > 1 only
OPENAI_COLUMNS = ("custom_id", "endpoint")  # carried from an OpenAI Batch input for the JSONL output
ENCODING_FORMAT = "encoding_format"  # and an embeddings request's (float | base64)
TOOL_CALLS, TOOL_CALL_ERROR = "tool_calls", "tool_call_error"  # a tool parser's: OpenAI's calls, or why a call did
# not parse (generated_text then keeps the raw answer)
ERROR_CODE = "error_code"  # a job's rows: an error row's kind (engine/params.py RefusalCode: context_length_exceeded,
# invalid_request), null for the others; the OpenAI Batch export's error code
REASONING, REASONING_TOKENS = "reasoning", "reasoning_tokens"  # a reasoning parser's: the thinking (string, null when
# the row did not think) and its tokens (generated_text is then the answer alone)


@dataclass(slots=True, frozen=True)
class OutputColumns:
    """The optional columns of one output folder, after the result columns."""
    keep: tuple[str, ...] = ()  # input columns copied as they are (--keep-columns, the OpenAI request's ids)
    error_code: bool = False  # ERROR_CODE (a job's output; the API's Result has its field)
    logprobs: bool = False
    completions: bool = False
    embedding: bool = False
    embeddings: bool = False  # an OpenAI Batch input with task = "embed": EMBEDDINGS instead of EMBEDDING
    score: bool = False  # task = "score": SCORE_COLUMNS
    top_logprobs: bool = False  # score rows with prompt_logprobs > 0: PROMPT_TOP_LOGPROBS
    prompt_logprobs: bool = False  # generate rows: PROMPT_LOGPROBS as token entries
    reasoning: bool = False  # a reasoning parser splits the thinking out: REASONING and REASONING_TOKENS
    tools: bool = False  # a tool parser reads calls: TOOL_CALLS and TOOL_CALL_ERROR

    @property
    def types(self) -> dict:
        """The columns of a fixed Arrow type."""
        import pyarrow as pa

        types = {EMBEDDING: pa.list_(pa.float32())} if self.embedding else {}
        if self.error_code:
            types[ERROR_CODE] = pa.string()
        if self.reasoning:
            types.update({REASONING: pa.string(), REASONING_TOKENS: pa.int32()})
        if self.tools:
            function = pa.struct([("name", pa.string()), ("arguments", pa.string())])
            call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", function)])
            types.update({TOOL_CALLS: pa.list_(call), TOOL_CALL_ERROR: pa.string()})
        if self.embeddings:
            types[EMBEDDINGS] = pa.list_(pa.list_(pa.float32()))
        if self.score:
            types.update({PROMPT_LOGPROBS: pa.list_(pa.float64()), PROMPT_LOGPROB_SUM: pa.float64(),
                          CONTINUATION_LOGPROB: pa.float64(), CONTINUATION_TOKENS: pa.int64(), IS_GREEDY: pa.bool_()})
        return types

    @property
    def names(self) -> list[str]:
        return [*self.keep, *([ERROR_CODE] if self.error_code else []), *([REASONING, REASONING_TOKENS] if self.reasoning else []),
                *([TOOL_CALLS, TOOL_CALL_ERROR] if self.tools else []), *([LOGPROBS] if self.logprobs else []), *([COMPLETIONS] if self.completions else []),
                *([EMBEDDING] if self.embedding else []), *([EMBEDDINGS] if self.embeddings else []),
                *([PROMPT_LOGPROBS] if self.prompt_logprobs else []),
                *(SCORE_COLUMNS if self.score else ()), *([PROMPT_TOP_LOGPROBS] if self.top_logprobs else [])]

    def check(self, params: SamplingParams) -> None:
        """A row may ask for what its output folder has no column for only where JSONL rows differ from
        the first lines the columns were learned from."""
        if params.logprobs is not None and not self.logprobs:
            raise RowError("logprobs: this output has no logprobs column (the job sets no logprobs and the input "
                           "had no sampling/logprobs column in its first lines); set logprobs in the job")
        if self.score and params.max_tokens != 0:
            raise RowError("max_tokens: a score job's rows generate nothing (max_tokens 0); run generate rows in a "
                           "generate job")
        if params.prompt_logprobs and self.score and not self.top_logprobs:
            raise RowError("prompt_logprobs: this output has no prompt_top_logprobs column (the job's prompt_logprobs "
                           "is 0); set prompt_logprobs in the job")
        if params.prompt_logprobs is not None and not self.score and not self.prompt_logprobs:
            raise RowError("prompt_logprobs: this output has no prompt_logprobs column (the job sets no "
                           "prompt_logprobs and the input had no sampling column in its first lines); set "
                           "prompt_logprobs in the job")
        if params.n > 1 and not self.completions:
            raise RowError("n: this output has no completions column (the job sets n = 1 and the input had no "
                           "sampling/n column in its first lines); set n in the job")


def output_columns(keep: list[str], defaults: SamplingParams, input_columns: list[str], openai: bool,
                   reasoning: bool = False, tools: bool = False) -> OutputColumns:
    per_row = openai or has_row_sampling(input_columns)
    embed, score = defaults.pooling is not None, defaults.max_tokens == 0
    openai_keep = (*OPENAI_COLUMNS, ENCODING_FORMAT) if embed else OPENAI_COLUMNS
    keep = list(keep) + [c for c in (openai_keep if openai else ()) if c not in keep]
    generate = not (embed or score)
    cols = OutputColumns(tuple(keep), error_code=True, logprobs=generate and (per_row or defaults.logprobs is not None),
                         completions=generate and (per_row or defaults.n > 1), embedding=embed and not openai,
                         embeddings=embed and openai, score=score,
                         top_logprobs=score and bool(defaults.prompt_logprobs),
                         prompt_logprobs=generate and (per_row or defaults.prompt_logprobs is not None),
                         reasoning=generate and reasoning, tools=generate and tools)
    clash = set(keep) & set(cols.names[len(keep):])
    if clash:
        from batchjob.job.options.config import ConfigError

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
        return [{"token_id": t, "token": self(t), "logprob": lp, "top_logprobs": self.top(top)} for t, lp, top in entries]

    def top(self, top: list[tuple[int, float]]) -> list[dict]:
        return [{"token_id": i, "token": self(i), "logprob": v} for i, v in top]


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
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs: (logprob, argmax, top) per prompt token from the second
    reasoning: str | None = None  # a reasoning parser's split: the thinking (text is then the answer alone)
    reasoning_tokens: int = 0
    tool_calls: list[dict] | None = None  # a tool parser's: the answer's calls (text is then what is left of it)
    tool_call_error: str | None = None  # why the answer's call did not parse (text is then the raw answer)


@dataclass(frozen=True, slots=True)
class ResultRow:
    """A row's result, one shape from the finished completions to every consumer: the job's sink takes its `columns`,
    the API makes its `Result` of it. A row that never ran is `ResultRow.failed(refusal)`."""
    generated_text: str = ""
    finish_reason: str = "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of all n completions
    error: Refusal | None = None  # why it failed: the message (column `error`) and its code (ERROR_CODE)
    extra: dict = field(default_factory=dict)  # the output's optional columns, by name (OutputColumns.names)

    @classmethod
    def failed(cls, error: Refusal, prompt_tokens: int = 0) -> ResultRow:
        """A row the engine refused or that never became a request (prompt_tokens: its prompt's, when it had one)."""
        return cls(prompt_tokens=prompt_tokens, error=error)

    def columns(self, row_index: int, kept: dict) -> dict:
        """The output row by column name: the result columns, the kept input columns, then the optional ones."""
        return {"row_index": row_index, "generated_text": self.generated_text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "error": None if self.error is None else self.error.message,
                ERROR_CODE: None if self.error is None else self.error.code.value, **kept, **self.extra}


@dataclass(slots=True, eq=False)
class PendingRow:
    n: int
    columns: OutputColumns
    done: list[Completion | None] = field(default_factory=list)
    prompt_tokens: int = 0
    continuation_start: int | None = None  # a score row's continuation: its first token's position
    several_prompts: bool = False  # an OpenAI embeddings line: one request per input (prompt_tokens: all of them)
    prompt_ids: tuple[int, ...] = ()
    token_text: TokenText | None = None
    tools: ToolRequest | None = None  # the row's tools and tool_choice (a tool parser's job)

    def __post_init__(self) -> None:
        self.done = [None] * self.n

    def add(self, index: int, out: RequestOutput, tokenizer, token_text: TokenText, reasoning=None,
            tool_parser: str | None = None) -> bool:
        """Record completion `index`; True once all n are in. `reasoning`: the job's reasoning parser
        (batchjob/reasoning/parsers.py), which splits the thinking from the answer; `tool_parser`: the job's tool
        parser (batchjob/tool_calls/parsers.py), which reads the answer's calls where the row has tools."""
        lps = token_text.logprobs(out.logprobs) if out.logprobs is not None else None
        thought, thought_tokens, addressed = None, 0, None
        parses = tool_parser is not None and self.tools is not None and self.tools.choice != "none"
        decode = tag_decoder(tool_parser, tokenizer.token_id, tokenizer.decode) if parses else tokenizer.decode
        if reasoning is not None and out.finish_reason != "error":
            split = reasoning.split(out.output_ids, decode, reasoning.opened_by(out.prompt_ids), out.stop_text)
            text, thought, thought_tokens = split.content, split.reasoning, split.reasoning_tokens
            addressed = split.calls  # harmony's messages to tools: the openai tool parser's calls
        else:
            text = out.stop_text if out.stop_text is not None else decode(list(out.output_ids))
        calls = error = None
        reason = out.finish_reason
        if parses and reason != "error":
            parsed = parse(tool_parser, text, out.output_ids, addressed)
            if reason == "length" and parsed.error is not None and not parsed.calls and tool_parser != "openai":
                parsed = complete_calls(PARSE[tool_parser], text, out.output_ids, parsed)  # cut inside a call
            calls, error = parsed.calls, parsed.error
            if calls is not None:
                text, reason = parsed.content, "tool_calls" if reason == "stop" else reason
            elif error is None and self.tools.forced:
                error = f"tool_choice {self.tools.choice!r}: the answer has no tool call"
        self.done[index] = Completion(index, text, reason, out.num_output, lps, out.output_ids, out.error,
                                      out.embedding, out.prompt_logprobs, thought, thought_tokens, calls, error)
        self.prompt_tokens = self.prompt_tokens + out.num_prompt if self.several_prompts else out.num_prompt
        self.prompt_ids, self.token_text = out.prompt_ids, token_text
        return all(c is not None for c in self.done)

    def result(self) -> ResultRow:
        """The row's result: the first completion's text, reason and logprobs; tokens of all completions."""
        first = self.done[0]
        extra: dict = {}
        if self.columns.reasoning:
            extra.update({REASONING: first.reasoning, REASONING_TOKENS: first.reasoning_tokens})
        if self.columns.tools:
            extra.update({TOOL_CALLS: first.tool_calls, TOOL_CALL_ERROR: first.tool_call_error})
        if self.columns.logprobs:
            extra[LOGPROBS] = first.logprobs
        if self.columns.embedding:
            extra[EMBEDDING] = first.embedding
        if self.columns.embeddings:
            extra[EMBEDDINGS] = [c.embedding for c in self.done]
        if first.prompt_logprobs is not None and first.finish_reason != "error":
            extra.update(self._prompt_fields(first.prompt_logprobs))
        if self.columns.completions and self.n > 1:
            extra[COMPLETIONS] = [
                {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                 "completion_tokens": c.completion_tokens, "logprobs": c.logprobs} for c in self.done]
        error = next((c.error for c in self.done if c.error), None)  # a grammar that failed once queued: invalid
        return ResultRow(first.text, first.finish_reason, self.prompt_tokens, sum(c.completion_tokens for c in self.done),
                         None if error is None else invalid(error), extra)

    def _prompt_fields(self, entries: list) -> dict:
        """A score row's columns, or a generate row's prompt_logprobs entries, from its (logprob, argmax, top)
        per prompt token from the second."""
        ids, text = self.prompt_ids, self.token_text
        if not self.columns.score:
            return {PROMPT_LOGPROBS: [None, *({"token_id": t, "token": text(t), "logprob": lp, "top_logprobs": text.top(top)}
                                              for t, (lp, _, top) in zip(ids[1:], entries))]}
        lps = [lp for lp, _, _ in entries]
        out = {PROMPT_LOGPROBS: [None, *lps], PROMPT_LOGPROB_SUM: sum(lps)}
        start = self.continuation_start
        if start is not None:  # entry j scores token j + 1
            cont = entries[start - 1:]
            out.update({CONTINUATION_LOGPROB: sum(lp for lp, _, _ in cont), CONTINUATION_TOKENS: len(cont),
                        IS_GREEDY: all(a == t for (_, a, _), t in zip(cont, ids[start:]))})
        if self.columns.top_logprobs:
            out[PROMPT_TOP_LOGPROBS] = [None, *(text.top(top) for _, _, top in entries)]
        return out
