"""OpenAI Batch lines, both ways: a request line -> a record (`request_record`), a result row -> a
response line (`response_line`, `openai_batch_lines`). Pure: no files (`sources/openai_batch.py` reads
request files, `export.py` writes response files).

In: a line {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}
becomes a record {custom_id, endpoint, messages | prompt, sampling}; the body's fields map to the
sampling parameters (docs/guide/openai-batch.md). A "/v1/embeddings" line (a job with task = "embed")
becomes {custom_id, endpoint, input: its texts, encoding_format, sampling: {dimensions}}.
Out: one response line per result row (the Arrow output's columns), in input order; `export.py` sends
a line with an error to the errors file too, and a line without a custom_id to the errors file only.
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"  # run with task = "embed"; `input` is one or more texts (or token id lists)
COLUMNS = ["custom_id", "endpoint", "messages", "prompt", "sampling", "input", "encoding_format", "chat_template_kwargs",
           "tools", "tool_choice", "parallel_tool_calls", "model"]
MAX_INPUTS = 2048  # inputs per embeddings request, as OpenAI's limit
ENCODING_FORMATS = ("float", "base64")

# accepted and without effect on a batch run
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "modalities"}
# OpenAI's request fields that batchjob does not honour: refused when set (left off: false, null or empty)
_UNSUPPORTED = {"stream", "functions", "function_call", "logit_bias", "audio", "prediction",
                "reasoning_effort", "web_search_options", "best_of", "echo", "suffix"}
# read here, not passed on as sampling parameters (the rest of a body is: OpenAI's sampling fields, which are named
# as ours, and vLLM's extra ones, each checked by the job as a row's sampling parameter)
_READ_HERE = {"messages", "prompt", "logprobs", "top_logprobs", "max_completion_tokens", "response_format",
              "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls"}


REQUEST_FIELDS = frozenset({"custom_id", "method", "url", "body"})


def is_request_shaped(value) -> bool:
    """Auto-detection, one line: an object with three of a request line's four fields (so one misspelt or
    left out still counts), or with custom_id and body. Whether it is a valid request is `request_record`'s."""
    if not isinstance(value, dict):
        return False
    keys = value.keys()
    return len(REQUEST_FIELDS & keys) >= 3 or {"custom_id", "body"} <= keys


def request_record(line) -> dict:
    """A parsed request line -> {custom_id, endpoint, messages, prompt, sampling}; ValueError names the field."""
    if not isinstance(line, dict):
        raise ValueError(f"expected a JSON object, got {type(line).__name__}")
    cid = line.get("custom_id")
    if "custom_id" not in line:
        unknown = sorted(k for k in line if k not in REQUEST_FIELDS)
        instead = f" (the line has {', '.join(map(repr, unknown))} instead?)" if unknown else ""
        raise ValueError(f"custom_id: missing{instead}; each line needs a unique non-empty string custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"custom_id: a non-empty string is required, got {cid!r}")
    if line.get("method") != "POST":
        raise ValueError(f"method: expected \"POST\", got {line.get('method')!r}")
    url = line.get("url")
    if url not in (CHAT, COMPLETIONS, EMBEDDINGS):
        raise ValueError(f"url: {url!r} is not supported; use {CHAT}, {COMPLETIONS} or {EMBEDDINGS}")
    body = line.get("body")
    if body is None:
        raise ValueError("body: missing; the request's parameters go in \"body\"")
    if not isinstance(body, dict):
        raise ValueError(f"body: expected an object, got {type(body).__name__}")
    if url == EMBEDDINGS:
        return _embeddings_record(cid, body)
    chat = url == CHAT
    sampling, unsupported = {}, []
    for key, value in body.items():
        if key == "response_format" and value not in (None, {"type": "text"}):
            sampling["response_format"] = value  # json_schema / json_object / text: read as structured outputs
        elif key in _IGNORED or key in _READ_HERE:
            continue
        elif key in _UNSUPPORTED:
            if value not in (None, False, [], {}) and not (key == "best_of" and value == body.get("n", 1)):
                unsupported.append(key)
        elif value is not None:
            sampling[key] = value
    if unsupported:
        raise ValueError(f"body.{unsupported[0]}: not supported by batchjob")
    record = {"custom_id": cid, "endpoint": url, "messages": None, "prompt": None, "sampling": sampling,
              "chat_template_kwargs": body.get("chat_template_kwargs") if chat else None,  # vLLM's extra field
              "tools": body.get("tools") if chat else None, "tool_choice": body.get("tool_choice") if chat else None,
              "parallel_tool_calls": body.get("parallel_tool_calls") if chat else None,
              "model": body.get("model")}  # a LoRA adapter's name picks it (as vLLM's server does)
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise ValueError(f"body.tools: tool calls are {CHAT} requests")
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


def _embeddings_record(cid: str, body: dict) -> dict:
    """An embeddings request: `input` a string, token ids, or a list of either (each embedded on its own);
    `encoding_format` float (default) or base64; `dimensions` (Matryoshka, as --dimensions)."""
    unsupported = [k for k, v in body.items()
                   if k not in ("input", "encoding_format", "dimensions", *_IGNORED) and v not in (None, False, [], {})]
    if unsupported:
        raise ValueError(f"body.{unsupported[0]}: not supported by batchjob for {EMBEDDINGS}")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise ValueError(f"body.encoding_format: {fmt!r} is not one of {', '.join(ENCODING_FORMATS)}")
    value = body.get("input")
    if isinstance(value, str) or _ids(value):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or _ids(v) for v in value):
        inputs = list(value)
    else:
        raise ValueError("body.input: expected a string, a list of token ids, or a non-empty list of either")
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"body.input: {len(inputs)} inputs; at most {MAX_INPUTS} per request")
    sampling = {} if body.get("dimensions") is None else {"dimensions": body["dimensions"]}
    return {"custom_id": cid, "endpoint": EMBEDDINGS, "messages": None, "prompt": None, "sampling": sampling,
            "input": inputs, "encoding_format": fmt}


def _ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages: a non-empty list of messages is required")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"body.messages[{i}]: expected an object")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text joined as vLLM does; with images, kept as parts
            images = False
            for k, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind in ("image_url", "input_image"):
                    ref = p.get("image_url")
                    if not isinstance(ref.get("url") if isinstance(ref, dict) else ref, str):
                        raise ValueError(f"body.messages[{i}].content[{k}].image_url.url: a string is required (a data: "
                                         "URI, a path or an http(s) URL)")
                    images = True  # read, and refused for a text-only model, by the job (job/rows/images.py)
                elif kind != "text" or not isinstance(p.get("text"), str):
                    raise ValueError(f"body.messages[{i}].content[{k}]: only text and image_url parts are supported")
            if not images:
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
    if _ids(value):
        return value  # token ids
    raise ValueError("body.prompt: expected one prompt per line: a string or a list of token ids")


# ---- out --------------------------------------------------------------------------------------------


def openai_batch_lines(rows: pa.Table | Iterable[dict], *, model: str = "batchjob", created: int | None = None) -> Iterator[str]:
    """`response_lines` as JSON text, no newline."""
    for line in response_lines(rows, model=model, created=created):
        yield json.dumps(line, ensure_ascii=False)


def response_lines(rows: pa.Table | Iterable[dict], *, model: str = "batchjob", created: int | None = None) -> Iterator[dict]:
    """Result rows (the Arrow output's columns, in input order) -> OpenAI Batch response lines. Rows
    without custom_id/endpoint columns (a plain input) get "row-<row_index>" and the completions endpoint."""
    created = int(time.time()) if created is None else created
    if isinstance(rows, pa.Table):
        rows = (row for batch in rows.to_batches() for row in batch.to_pylist())
    for row in rows:
        yield response_line(row, model, created)


def response_line(row: dict, model: str, created: int) -> dict:
    # an OpenAI input's line without a usable custom_id gets null (its line goes to the errors file only);
    # a plain input's rows get one
    custom_id = row["custom_id"] if "custom_id" in row else f"row-{row['row_index']}"
    rid = hashlib.sha256(f"{row['row_index']}\0{custom_id}".encode()).hexdigest()[:24]
    line = {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": None, "error": None}
    if row["finish_reason"] == "error":
        # the row's error_code column (an older output without it: invalid_request)
        line["error"] = {"code": row.get("error_code") or "invalid_request", "message": row.get("error") or "error"}
        return line
    if row.get("endpoint") == EMBEDDINGS:
        line["response"] = {"status_code": 200, "request_id": f"req_{rid}", "body": _embeddings_body(row, model)}
        return line
    chat = row.get("endpoint") == CHAT
    completions = row.get("completions") or [
        {"index": 0, "text": row["generated_text"], "finish_reason": row["finish_reason"], "logprobs": row.get("logprobs")}]
    choices = [_chat_choice(c) if chat else _text_choice(c) for c in completions]
    usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
             "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}
    if "reasoning_tokens" in row:  # a reasoning parser's job: the thinking beside the answer (vLLM's field name)
        usage["completion_tokens_details"] = {"reasoning_tokens": row["reasoning_tokens"] or 0}
        if chat:
            choices[0]["message"]["reasoning_content"] = row.get("reasoning")
    if chat and row.get("tool_calls"):  # a tool parser's job: the calls, and what is left of the answer (or null)
        choices[0]["message"]["tool_calls"] = row["tool_calls"]
        choices[0]["message"]["content"] = row["generated_text"] or None
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage}
    line["response"] = {"status_code": 200, "request_id": f"req_{rid}", "body": body}
    return line


def _embeddings_body(row: dict, model: str) -> dict:
    """OpenAI's embeddings response: one entry per input, the vector as floats or as base64 of its
    little-endian float32 bytes (`encoding_format`)."""
    b64 = row.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": j,
             "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if b64 else v}
            for j, v in enumerate(row["embeddings"])]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": row["prompt_tokens"], "total_tokens": row["prompt_tokens"]}}


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

