"""Turns an input record into a request: prompt token ids (a plain prompt, a list of token ids, a prompt
wrapped as a chat message, or a `messages` list rendered with the chat template) and the row's sampling
parameters (the job's, overridden by a `sampling` column and by columns named like the parameters).
Messages are read as the OpenAI API writes them too (text content parts, the `developer` role), and
values that come as text (CSV) as JSON. Problems are per-row errors (RowError)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from batchjob.job.options.config import JobConfig, template_kwargs
from batchjob.job.options.modes import Task
from batchjob.job.options.options import TEXT_LISTS  # parameters whose value may be plain text
from batchjob.engine.requests import PoolingParams, SamplingParams, StructuredOutputsError, from_response_format
from batchjob.io.openai_batch import CHAT, COMPLETIONS, EMBEDDINGS
from batchjob.images.sources import Fetched, ImageError, column_count, from_column
from batchjob.job.rows.images import ImageRows, image_part, part_url
from batchjob.job.rows.chat_messages import chat_message
from batchjob.job.rows.row_error import RowError
from batchjob.job.rows.tool_rows import ToolRows, tools_refused
from batchjob.reasoning.budget import with_budget
from batchjob.tool_calls.requests import ToolRequest

ENDPOINT_COLUMN, INPUT_COLUMN = "endpoint", "input"  # an OpenAI Batch record's (io/openai_batch.py)

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "pooling")  # pooling: the job's task
SAMPLING_COLUMN = "sampling"
TEMPLATE_KWARGS_COLUMN = "chat_template_kwargs"  # a row's chat template variables (over the job's)


@dataclass(frozen=True, slots=True)
class RowReading:
    """What one walk over a record reads, for everything after it: its chat messages as the template takes them (None:
    a plain prompt), its image parts in order (message index, part index, part), its tools (None: it has none)."""
    messages: list[dict] | None = None
    image_parts: tuple = ()
    tools: ToolRequest | None = None


PLAIN = RowReading()  # a plain prompt's (an OpenAI embeddings line's inputs)


@dataclass(slots=True)
class PromptBuilder:
    config: JobConfig
    tokenizer: object  # batchjob.models.tokenizer.Tokenizer
    use_messages: bool  # the input has the messages column
    chat_template: str | None = None
    in_memory: bool = False  # the Python API: messages name a prompt's key (`prompt`), not an input column
    images: ImageRows | None = None  # a vision-language model's image facts; None: a text-only model
    image_base: Path | None = None  # where an image's relative path starts: the input file's folder
    model_name: str = "this model"  # as errors name it
    tool_rows: ToolRows | None = None  # the job's tool parser (tool_parser); None: rows with tools fail
    adapters: dict[str, int] | None = None  # the job's LoRA adapters: name -> slot on the model

    def _named(self, key: str) -> str:
        return named(key, self.in_memory)

    def read(self, record: dict) -> RowReading:
        """The record's one reading: its messages walked once (JSON text decoded once, image parts noted on the way),
        its tools parsed once; RowError says what is wrong with it."""
        image_parts: list = []
        messages = self._messages(record, image_parts)
        return RowReading(messages, tuple(image_parts), self.tool_request(record))

    def messages(self, record: dict) -> list[dict] | None:
        """The record's chat messages as the template takes them (None: a plain prompt)."""
        return self._messages(record, None)

    def _messages(self, record: dict, image_parts: list | None) -> list[dict] | None:
        cfg = self.config
        msgs = record.get(cfg.messages_column) if self.use_messages else None
        if cfg.task != Task.GENERATE:  # no chat template for an embed or score row: its prompt's text as it is
            if msgs is not None and record.get(cfg.prompt_column) is None:
                raise RowError(f"{self._named(cfg.messages_column)}: an {cfg.task} row takes a prompt (text or token "
                               f"ids), not chat messages; chat templates are not applied to {cfg.task} rows")
            return None
        if msgs is None:
            if cfg.image_column is not None:
                return [*self._system(), self._image_column_message(record)]
            if not cfg.chat:
                return None
            msgs = [{"role": "user", "content": self._prompt_text(record)}]
        elif isinstance(msgs, str):  # a JSON list in a text column (CSV)
            try:
                msgs = json.loads(msgs)
            except ValueError as e:
                raise RowError(f"{self._named(cfg.messages_column)}: invalid JSON: {e}") from None
        if not isinstance(msgs, list) or not msgs:
            raise RowError(f"{self._named(cfg.messages_column)}: expected a non-empty list of {{role, content}} messages")
        msgs = [chat_message(m, i, self._named(cfg.messages_column), self.images is not None, self.model_name, image_parts)
                for i, m in enumerate(msgs)]
        if cfg.image_column is not None and record.get(cfg.image_column) is not None:
            raise RowError(f"{self._named(cfg.image_column)}: a row with chat messages carries its images in their "
                           "parts; leave the image column null on it")
        return msgs if msgs[0]["role"] == "system" else [*self._system(), *msgs]

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []

    def _image_column_message(self, record: dict) -> dict:
        """An image column's row as a user message: its images, then its prompt text (no image: the text alone)."""
        text = self._prompt_text(record)
        count = column_count(record.get(self.config.image_column))
        return {"role": "user", "content": [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]
                if count else text}

    def image_urls(self, record: dict, reading: RowReading) -> list:
        """Where a row's images are (its image parts' urls, its image column's values), read without fetching: the
        feed fetches a batch's http(s) images together (sources.fetch_many)."""
        cfg = self.config
        if cfg.image_column is not None and record.get(cfg.image_column) is not None:
            value = record[cfg.image_column]
            return list(value) if isinstance(value, (list, tuple)) else [value]
        return [part_url(part) for _, _, part in reading.image_parts]

    def with_images(self, record: dict, reading: RowReading, ids: list[int],
                    fetched: Fetched | None = None) -> tuple[list[int], tuple]:
        """A chat row's prompt ids with each image token expanded to its placeholders, and its images' slots
        (engine ImageSlots), read from the row's image parts in order; (ids, ()) for a row without images.
        `fetched`: the batch's http(s) images, fetched already."""
        cfg = self.config
        if cfg.image_column is not None and record.get(cfg.image_column) is not None:
            return self._column_images(record, ids, fetched)
        found, limit = [], cfg.limit_images_per_prompt
        for i, k, part in reading.image_parts:
            if limit is not None and len(found) == limit:
                raise RowError(f"{self._named(cfg.messages_column)}: message {i}: content part {k}: more than "
                               f"{limit} images (limit_images_per_prompt)")
            try:
                found.append(image_part(part, self.image_base, fetched))
            except ImageError as e:
                raise RowError(f"{self._named(cfg.messages_column)}: message {i}: content part {k}: {e}") from None
        if not found:
            return ids, ()
        try:
            return self.images.expand(ids, found)
        except ImageError as e:
            raise RowError(str(e)) from None

    def _column_images(self, record: dict, ids: list[int], fetched: Fetched | None) -> tuple[list[int], tuple]:
        col, limit = self._named(self.config.image_column), self.config.limit_images_per_prompt
        value = record[self.config.image_column]
        if limit is not None and column_count(value) > limit:
            raise RowError(f"{col}: {column_count(value)} images, more than {limit} (limit_images_per_prompt)")
        try:
            found = from_column(value, self.image_base, fetched)
            return self.images.expand(ids, found) if found else (ids, ())
        except ImageError as e:
            raise RowError(f"{col}: {e}") from None

    def _prompt_text(self, record: dict) -> str:
        col = self.config.prompt_column
        value = record.get(col)
        if value is None:
            raise RowError(f"{self._named(col)} is null")
        if not isinstance(value, str):
            raise RowError(f"{self._named(col)}: expected a string, got {type(value).__name__}")
        if not value.strip():
            raise RowError(f"{self._named(col)} is empty")
        return value

    def prompts_many(self, records: list[dict], readings: list[RowReading | RowError]) -> list[list[list[int]] | RowError]:
        """Each record's prompts' ids (one prompt; an OpenAI embeddings line: one per input), or the RowError
        that fails it; the texts are tokenized in one batch. `readings`: each record's (`read`), or the RowError
        its reading raised (the row's error unless its endpoint is wrong: nothing of it is tokenized)."""
        cfg, flat, flat_readings, owner, out = self.config, [], [], [], [None] * len(records)
        for i, (record, reading) in enumerate(zip(records, readings)):
            endpoint = record.get(ENDPOINT_COLUMN)
            if endpoint == EMBEDDINGS and cfg.task != Task.EMBED:
                out[i] = RowError(f"url: {EMBEDDINGS} requests need task = \"embed\" (this job's task is {cfg.task}); "
                                  "run the job with --task embed")
            elif endpoint in (CHAT, COMPLETIONS) and cfg.task == Task.EMBED:
                out[i] = RowError(f"url: {endpoint} requests generate text; this job's task is embed (give "
                                  f"{EMBEDDINGS} requests, or run it without --task embed)")
            elif endpoint == EMBEDDINGS:
                for value in record[INPUT_COLUMN]:
                    flat.append({cfg.prompt_column: value})
                    flat_readings.append(PLAIN)
                    owner.append(i)
                out[i] = []
            elif isinstance(reading, RowError):
                out[i] = reading
            else:
                flat.append(record)
                flat_readings.append(reading)
                owner.append(i)
        for j, (i, ids) in enumerate(zip(owner, self.token_ids_many(flat, flat_readings))):
            if isinstance(out[i], RowError):
                continue
            if isinstance(ids, RowError):
                many = records[i].get(ENDPOINT_COLUMN) == EMBEDDINGS
                out[i] = RowError(f"input[{len(out[i])}]: {ids}") if many else ids
                continue
            if out[i] is None:
                out[i] = []
            out[i].append(ids)
        return out

    def token_ids(self, record: dict) -> list[int]:
        result = self.token_ids_many([record])[0]
        if isinstance(result, RowError):
            raise result
        return result

    def token_ids_many(self, records: list[dict], readings: list[RowReading] | None = None) -> list[list[int] | RowError]:
        """Each record's prompt ids, or the RowError that fails it; the texts are tokenized in one batch. `readings`:
        each record's (`read`), or None to read them here."""
        out: list = [None] * len(records)
        plain: list[tuple[int, str]] = []  # prompts: the tokenizer adds BOS where the model wants it
        chat: list[tuple[int, str]] = []  # rendered templates: they write their special tokens themselves
        for i, record in enumerate(records):
            try:
                kind, value = self._text(record, self.read(record) if readings is None else readings[i])
            except RowError as e:
                out[i] = e
                continue
            if kind == "ids":
                out[i] = value
            else:
                (plain if kind == "prompt" else chat).append((i, value))
        for group, special in ((plain, True), (chat, False)):
            for (i, _), ids in zip(group, self.tokenizer.encode_batch([t for _, t in group], add_special_tokens=special)):
                out[i] = ids
        return out

    def _text(self, record: dict, reading: RowReading) -> tuple[str, object]:
        """("ids", token ids given as they are) | ("prompt", text) | ("chat", the rendered template)."""
        msgs = reading.messages
        if msgs is None:
            if record.get(TEMPLATE_KWARGS_COLUMN) is not None and self.config.task == Task.GENERATE:
                chat = "pass chat=True" if self.in_memory else "run the job with --chat"
                raise RowError(f"{self._named(TEMPLATE_KWARGS_COLUMN)}: this row is a plain prompt, which no chat "
                               f"template renders, so its variables would be ignored; give the row as messages (or "
                               f"{chat})")
            value = record.get(self.config.prompt_column)
            pair = self._scored_pair(record)
            if pair is not None:
                context, continuation = pair
                return ("ids", context + continuation) if isinstance(context, list) else ("prompt", context + continuation)
            if isinstance(value, list):
                return "ids", self._given_ids(value)
            return "prompt", self.config.embed_prefix + self._prompt_text(record)
        variables = self.template_variables(record, reading.tools)
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, chat_template=self.chat_template,
                                                      **variables)
        except Exception as e:  # template errors are the row's problem, not the job's
            raise RowError(f"chat template failed: {e}") from None
        return "chat", text if self.images is None else self.images.layout.template_text(text)

    def template_variables(self, record: dict, request: ToolRequest | None) -> dict:
        """The chat template's variables for a row: the job's chat_template_kwargs, then the row's own column's, and
        the row's tools (`request`, from its reading)."""
        own = record.get(TEMPLATE_KWARGS_COLUMN)
        variables = self.config.chat_template_kwargs or {}
        if own is not None:
            variables = {**variables, **template_kwargs(own, self._named(TEMPLATE_KWARGS_COLUMN), RowError)}
        if request is not None:
            variables = {**variables, "tools": [t.definition for t in request.tools]}
        return variables

    def lora_slot(self, record: dict) -> int:
        """The slot of the adapter the row names (its lora column; an OpenAI request's `model` naming one, as vLLM's
        server reads it), -1 for the base model; RowError for an adapter the job has not loaded."""
        col = self.config.lora_column
        name = record.get(col)
        if name is None and record.get("model") is not None and self.adapters and record["model"] in self.adapters:
            name = record["model"]
        if name is None or name == "":
            return -1
        slot = (self.adapters or {}).get(name)
        if slot is None:
            have = ", ".join(self.adapters) if self.adapters else "none: load them with --lora NAME=PATH"
            raise RowError(f"{self._named(col)}: {name!r} is not one of the job's LoRA adapters ({have})")
        return slot

    def constrained(self, params: SamplingParams, request: ToolRequest | None) -> SamplingParams:
        """A row's parameters with its call grammar where its tool_choice forces a call (job/rows/tool_rows.py)."""
        if self.tool_rows is None or request is None:
            return params
        try:
            return self.tool_rows.constrain(params, request)
        except ValueError as e:
            raise RowError(str(e)) from None

    def tool_request(self, record: dict) -> ToolRequest | None:
        """The row's tools and tool_choice (None: it has none); RowError says why they cannot run."""
        if self.tool_rows is None:
            refused = tools_refused(record)
            if refused:
                raise RowError(refused)
            return None
        try:
            return self.tool_rows.request(record)
        except ValueError as e:
            raise RowError(str(e)) from None

    def continuation_starts(self, records: list[dict], ids: list[list[int] | RowError]) -> list[int | None | RowError]:
        """Score rows with a continuation: where it starts in the row's token ids, as lm-evaluation-harness
        finds it (the context's trailing spaces move to the continuation; the whole text is tokenized once,
        the context alone once, and the continuation is what follows the context's tokens). None: no
        continuation (the whole prompt is scored)."""
        out: list = [None] * len(records)
        texts: list[tuple[int, str]] = []
        for i, (record, row_ids) in enumerate(zip(records, ids)):
            if isinstance(row_ids, RowError):
                continue
            pair = self._scored_pair(record)
            if pair is None:
                continue
            if isinstance(pair[0], list):
                out[i] = len(pair[0])
            else:
                texts.append((i, pair[0]))
        contexts = self.tokenizer.encode_batch([t for _, t in texts], add_special_tokens=True)
        for (i, _), context in zip(texts, contexts):
            out[i] = len(context)
        for i, start in enumerate(out):
            if isinstance(start, int) and start >= len(ids[i]):
                out[i] = RowError(f"{self._named(self.config.continuation_column)}: no tokens of its own once the "
                                  "prompt and the continuation are tokenized together")
            elif start == 0:
                out[i] = RowError(f"{self._named(self.config.prompt_column)}: empty: the first token of a continuation "
                                  "has nothing to be scored after; give a prompt (at least one token)")
        return out

    def _scored_pair(self, record: dict) -> tuple[str, str] | tuple[list[int], list[int]] | None:
        """A score row's (context, continuation), both text or both token ids; None when it has none."""
        cfg = self.config
        if cfg.task != Task.SCORE or record.get(cfg.continuation_column) is None:
            return None
        continuation, where = record[cfg.continuation_column], self._named(cfg.continuation_column)
        value = record.get(cfg.prompt_column)
        if isinstance(continuation, list):
            if not isinstance(value, list):
                raise RowError(f"{where}: token ids need the prompt as token ids too ({self._named(cfg.prompt_column)})")
            return self._given_ids(value), self._given_ids(continuation, where)
        if not isinstance(continuation, str) or not continuation:
            raise RowError(f"{where}: expected a non-empty string or a list of token ids, got {continuation!r:.40}")
        if value is None or value == "":
            raise RowError(f"{self._named(cfg.prompt_column)}: a continuation is scored after a prompt; this row has "
                           "none (to score a whole text, put it in the prompt alone)")
        if not isinstance(value, str):
            raise RowError(f"{self._named(cfg.prompt_column)}: expected a string like the continuation, got "
                           f"{type(value).__name__}")
        spaces = len(value) - len(value.rstrip())
        if spaces:
            value, continuation = value[:-spaces], value[-spaces:] + continuation
        return value, continuation

    def _given_ids(self, value: list, where: str | None = None) -> list[int]:
        """A prompt given as token ids (vLLM's prompt_token_ids, OpenAI's token prompts): used as is."""
        where, vocab = where or self._named(self.config.prompt_column), self.tokenizer.vocab_size
        if not value:
            raise RowError(f"{where}: the token id list is empty")
        bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RowError(f"{where}: expected a string or a list of token ids in [0, {vocab}), found {bad[0]!r}")
        return list(value)


def named(key: str, in_memory: bool = False) -> str:
    """How a message names where a value came from: a job's input column, or a key of the API's prompt."""
    return key if in_memory else f"column {key!r}"


def row_sampling(record: dict, base: SamplingParams, in_memory: bool = False) -> SamplingParams:
    """`base` (the job's or the lane's parameters) overridden by the row: first its `sampling` column (a
    struct, a JSON object or a JSON string of one), then columns named like a parameter. Nulls keep base."""
    values: dict = {}
    given = record.get(SAMPLING_COLUMN)
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError as e:
            raise RowError(f"{named(SAMPLING_COLUMN, in_memory)}: invalid JSON: {e}") from None
    if given is not None:
        if not isinstance(given, dict):
            raise RowError(f"{named(SAMPLING_COLUMN, in_memory)}: expected an object of sampling parameters, got {type(given).__name__}")
        values.update(given)
    for name in SAMPLING_FIELDS:
        if record.get(name) is not None:
            values[name] = _from_text(name, record[name])
    if not values:
        return base
    dimensions = values.pop("dimensions", None)  # an OpenAI embeddings request's own Matryoshka size
    if dimensions is not None:
        if base.pooling is None:
            raise RowError("dimensions: applies to embed rows only")
        values["pooling"] = PoolingParams(base.pooling.pooling, base.pooling.normalize, dimensions)
    try:
        if "response_format" in values:  # OpenAI's name (its Batch and chat requests) for a JSON constraint
            values["structured_outputs"] = from_response_format(values.pop("response_format"))
        return SamplingParams.parse(values, base)
    except StructuredOutputsError as e:
        raise RowError(str(e)) from None
    except ValueError as e:
        raise RowError(f"sampling parameter {e}") from None


def budgeted(params: SamplingParams, reasoning, prompt_ids: list[int]) -> SamplingParams:
    """A row's parameters with its thinking budget made its grammar (reasoning/budget.py); RowError says why not."""
    try:
        return with_budget(params, reasoning, prompt_ids)
    except ValueError as e:
        raise RowError(str(e)) from None


def _from_text(name: str, value):
    """A parameter given as text (every CSV value is) is read as JSON: "0.7" -> 0.7, "[2, 5]" -> [2, 5].
    `stop` takes text as it is (a stop string); text that is not JSON is left for the check to name."""
    if not isinstance(value, str) or name in TEXT_LISTS:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def has_row_sampling(columns) -> bool:
    """Whether rows of an input with these columns can carry their own sampling parameters."""
    return SAMPLING_COLUMN in columns or any(name in columns for name in SAMPLING_FIELDS)
