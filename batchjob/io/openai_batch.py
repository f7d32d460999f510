"""OpenAI Batch API files: request lines in (`OpenAIBatchSource`), response lines out (`openai_batch_lines`).

In: a line {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}
becomes a record {custom_id, endpoint, messages | prompt, sampling}; the body's fields map to the
sampling parameters (README, "OpenAI Batch JSONL"). A bad line, or a repeated custom_id, becomes a
per-row error that still carries its custom_id, so the response file has a line for it.
Out: one response line per result row, from the Arrow results, in input order.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from batchjob.io.sources import InputRow, JsonlSource, _narrow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
COLUMNS = ["custom_id", "endpoint", "messages", "prompt", "sampling"]
RESULTS_FILE = "results.jsonl"

# body field -> sampling parameter, for both endpoints (vLLM's extra sampling fields included)
_SAMPLING = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
    "stop": "stop", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# accepted and without effect on a batch run
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls", "modalities"}


def is_openai_batch_line(value) -> bool:
    """Auto-detection: a first line with custom_id, url and body is a batch request file."""
    return isinstance(value, dict) and {"custom_id", "url", "body"} <= value.keys()


class OpenAIBatchSource(JsonlSource):
    format_name = "OpenAI batch"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.columns = list(COLUMNS)
        self.duplicates, self.num_rows = self._scan_custom_ids()

    def _parse(self, row_index: int, line: bytes, where: str, columns: list[str] | None) -> InputRow:
        try:
            value = json.loads(line)
        except ValueError as e:
            return InputRow(row_index, None, f"{where}: invalid JSON: {e}")
        ids = {"custom_id": None, "endpoint": None}
        if isinstance(value, dict):
            cid, url = value.get("custom_id"), value.get("url")
            ids = {"custom_id": cid if isinstance(cid, str) else None, "endpoint": url if url in (CHAT, COMPLETIONS) else None}
        try:
            record = request_record(value)
        except ValueError as e:
            return InputRow(row_index, ids, f"{where}: {e}")
        first = self.duplicates.get(row_index)
        if first is not None:
            return InputRow(row_index, ids, f"{where}: duplicate custom_id {record['custom_id']!r} "
                                            f"(first used by row {first}); custom_id must be unique")
        return InputRow(row_index, _narrow(record, columns))

    def _scan_custom_ids(self) -> tuple[dict[int, int], int]:
        """One pass over the whole file, so a repeat is caught even when a resume skips the first use:
        {row index of a repeated custom_id: row index of its first use}, and the number of rows."""
        first: dict[str, int] = {}
        duplicates: dict[int, int] = {}
        row = 0
        with open(self.path, "rb") as f:
            for line, _, _ in self._lines(f, 0):
                if not line.strip():
                    continue
                try:
                    cid = json.loads(line).get("custom_id")
                except (ValueError, AttributeError):
                    cid = None
                if isinstance(cid, str):
                    if cid in first:
                        duplicates[row] = first[cid]
                    else:
                        first[cid] = row
                row += 1
        self.peak_buffer_bytes = 0
        return duplicates, row


def request_record(line) -> dict:
    """A parsed request line -> {custom_id, endpoint, messages, prompt, sampling}; ValueError names the field."""
    if not isinstance(line, dict):
        raise ValueError(f"expected a JSON object, got {type(line).__name__}")
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError("custom_id: a non-empty string is required")
    if line.get("method") != "POST":
        raise ValueError(f"method: expected \"POST\", got {line.get('method')!r}")
    url = line.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise ValueError(f"url: {url!r} is not supported; use {CHAT} or {COMPLETIONS}")
    body = line.get("body")
    if body is None:
        raise ValueError("body: missing; the request's parameters go in \"body\"")
    if not isinstance(body, dict):
        raise ValueError(f"body: expected an object, got {type(body).__name__}")
    chat = url == CHAT
    sampling, unsupported = {}, []
    for key, value in body.items():
        if key in _SAMPLING:
            sampling[_SAMPLING[key]] = value
        elif key in _IGNORED or key in ("messages", "prompt", "logprobs", "top_logprobs", "max_completion_tokens"):
            continue
        elif value in (None, False, [], {}) or (key == "response_format" and value == {"type": "text"}):
            continue  # an unsupported feature left off
        elif key == "best_of" and value == body.get("n", 1):
            continue
        else:
            unsupported.append(key)
    if unsupported:
        raise ValueError(f"body.{unsupported[0]}: not supported by batchjob")
    record = {"custom_id": cid, "endpoint": url, "messages": None, "prompt": None, "sampling": sampling}
    if chat:
        if body.get("max_completion_tokens") is not None:
            sampling["max_tokens"] = body["max_completion_tokens"]
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp not in (None, True, False):
            raise ValueError(f"body.logprobs: expected true or false, got {lp!r}")
        if top is not None and not lp:
            raise ValueError("body.top_logprobs: needs \"logprobs\": true")
        if lp:
            sampling["logprobs"] = 0 if top is None else top
        record["messages"] = _messages(body.get("messages"))
    else:
        if body.get("logprobs") is not None:
            sampling["logprobs"] = body["logprobs"]
        record["prompt"] = _prompt(body.get("prompt"))
    return record


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages: a non-empty list of messages is required")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"body.messages[{i}]: expected an object")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only, joined as vLLM does
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts are supported")
            m["content"] = "\n".join(p["text"] for p in content)
        if m.get("role") == "developer":  # OpenAI's newer name for the system role
            m["role"] = "system"
        out.append(m)
    return out


def _prompt(value):
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value  # token ids
    raise ValueError("body.prompt: expected one prompt per line: a string or a list of token ids")


# ---- out --------------------------------------------------------------------------------------------


def openai_batch_lines(rows: pa.Table | Iterable[dict], *, model: str = "batchjob", created: int | None = None) -> Iterator[str]:
    """Result rows (the Arrow output's columns, in input order) -> OpenAI Batch response lines (JSON text,
    no newline). Rows without custom_id/endpoint columns (a plain input) get "row-<row_index>" and the
    completions endpoint."""
    created = int(time.time()) if created is None else created
    if isinstance(rows, pa.Table):
        rows = (row for batch in rows.to_batches() for row in batch.to_pylist())
    for row in rows:
        yield json.dumps(response_line(row, model, created), ensure_ascii=False)


def response_line(row: dict, model: str, created: int) -> dict:
    # an OpenAI input's line that did not parse has no custom_id (null); a plain input's rows get one
    custom_id = row["custom_id"] if "custom_id" in row else f"row-{row['row_index']}"
    rid = hashlib.sha256(f"{row['row_index']}\0{custom_id}".encode()).hexdigest()[:24]
    line = {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": None, "error": None}
    if row["finish_reason"] == "error":
        message = row.get("error") or "error"
        code = "context_length_exceeded" if "fit (the model's context" in message else "invalid_request"
        line["error"] = {"code": code, "message": message}
        return line
    chat = row.get("endpoint") == CHAT
    completions = row.get("completions") or [
        {"index": 0, "text": row["generated_text"], "finish_reason": row["finish_reason"], "logprobs": row.get("logprobs")}]
    choices = [_chat_choice(c) if chat else _text_choice(c) for c in completions]
    usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
             "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage}
    line["response"] = {"status_code": 200, "request_id": f"req_{rid}", "body": body}
    return line


def _token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _chat_choice(c: dict) -> dict:
    lps = c.get("logprobs")
    logprobs = None if lps is None else {"content": [
        {**_token(t["token"], t["logprob"]), "top_logprobs": [_token(x["token"], x["logprob"]) for x in t["top_logprobs"]]}
        for t in lps]}
    return {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
            "logprobs": logprobs, "finish_reason": c["finish_reason"]}


def _text_choice(c: dict) -> dict:
    lps = c.get("logprobs")
    logprobs = None
    if lps is not None:
        offsets, at = [], 0
        for t in lps:
            offsets.append(at)
            at += len(t["token"])
        # as vLLM: each position's top entries plus the chosen token
        tops = [{**{x["token"]: x["logprob"] for x in t["top_logprobs"]}, t["token"]: t["logprob"]} for t in lps]
        logprobs = {"tokens": [t["token"] for t in lps], "token_logprobs": [t["logprob"] for t in lps],
                    "top_logprobs": tops, "text_offset": offsets}
    return {"index": c["index"], "text": c["text"], "logprobs": logprobs, "finish_reason": c["finish_reason"]}


def model_name(out_dir: str | Path) -> str:
    """The model an output folder was made with, as its file or folder name (for the response bodies)."""
    from batchjob.io.manifest import Manifest

    manifest = Manifest.load(Path(out_dir))
    path = ((manifest.fingerprint if manifest else {}).get("model") or {}).get("path")
    if not path:
        return "batchjob"
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


class ExportError(Exception):
    """The folder cannot give one response line per input line (rows missing)."""


def write_openai_batch(out_dir: str | Path, to: str | Path | None = None, *, created: int | None = None) -> Path:
    """Write the committed rows of one output folder as an OpenAI Batch response file (default
    OUTPUT/results.jsonl)."""
    out_dir = Path(out_dir)
    target = Path(to) if to is not None else out_dir / RESULTS_FILE
    _write([out_dir], target, created)
    return target


def export_openai_batch(out: str | Path, to: str | Path, *, created: int | None = None) -> int:
    """`batchjob export OUT --format openai-batch --to FILE`: OUT is one output folder or a sharded job
    folder (its shards in order). Refuses when input rows are missing. Returns the lines written."""
    from batchjob.io.manifest import Manifest
    from batchjob.shard import is_sharded, shard_states

    out = Path(out)
    if is_sharded(out):
        from batchjob.sharded import incomplete_message

        _, states = shard_states(out)
        problem = incomplete_message(out, states)
        if problem:
            raise ExportError(problem)
        folders = [s.folder for s in states if s.range.num_rows]
    else:
        manifest = Manifest.load(out)
        if manifest is None:
            raise ExportError(f"{out} has no manifest.json; it is not a batchjob output folder (or nothing ran yet)")
        done = manifest.num_rows()
        if manifest.total_rows is not None and done < manifest.total_rows:
            raise ExportError(f"{out} holds {done} of {manifest.total_rows} rows; rerun the job to finish it "
                              "(a response file has one line per input line)")
        folders = [out]
    return _write(folders, Path(to), created)


def _write(folders: list[Path], target: Path, created: int | None) -> int:
    """Atomically: a temp file, fsynced, then renamed. One folder's rows in memory at a time."""
    from batchjob.io.parts import read_results

    created = int(time.time()) if created is None else created
    model = model_name(folders[0]) if folders else "batchjob"
    tmp = target.with_name(f".{target.name}.tmp")
    written = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for folder in folders:
                for text in openai_batch_lines(read_results(folder), model=model, created=created):
                    f.write(text + "\n")
                    written += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return written
