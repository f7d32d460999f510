"""Chat messages as templates read them: OpenAI's forms (content parts, the `developer` role, an assistant turn's
`tool_calls` with JSON-string arguments) normalised the way vLLM's chat path does; a bad message is its row's error."""
from __future__ import annotations

import json

from batchjob.job.rows.images import IMAGE_PARTS
from batchjob.job.rows.row_error import RowError


def chat_message(message, index: int, where: str, images: bool = False, model: str = "this model",
                 image_parts: list | None = None) -> dict:
    """One message as the chat template expects it: string `role` and `content`. OpenAI's forms are
    accepted as its Batch path reads them: content parts (text only, joined with newlines, as vLLM
    does) and the `developer` role (its newer name for `system`). The other keys are kept. `where`: the
    column (or the API's key) the messages came from. `images`: the model takes images: a content with image
    parts stays a list of parts, each image as `{"type": "image"}` (as transformers' processors give templates), and
    `image_parts` (when given) gains (index, part index, part) for each, in order: the row's one walk over its parts."""
    where = f"{where}: message {index}"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RowError(f"{where} needs string 'role' and 'content'")
    if message.get("tool_calls"):  # an assistant turn that called tools: content may be null
        message = {**message, "tool_calls": template_calls(message["tool_calls"], where),
                   "content": message.get("content") or ""}
    content = message.get("content")
    if isinstance(content, list):
        has_image = False
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                if not images:
                    raise RowError(f"{where}: content part {k} is an image ({kind}): {model} is a text-only model; "
                                   "images need a vision-language model (docs/reference/models.md)")
                has_image = True
                if image_parts is not None:
                    image_parts.append((index, k, part))
            elif kind != "text" or not isinstance(part.get("text"), str):
                got = f"type {kind!r}" if isinstance(kind, str) else "no text"
                raise RowError(f"{where}: content part {k} has {got}; only text and image parts are supported")
        if has_image:
            content = [{"type": "image"} if part["type"] in IMAGE_PARTS else {"type": "text", "text": part["text"]}
                       for part in content]
        else:
            content = "\n".join(part["text"] for part in content)
    if not isinstance(content, (str, list)):
        raise RowError(f"{where} needs string 'role' and 'content'")
    role = "system" if message["role"] == "developer" else message["role"]
    return {**message, "role": role, "content": content}


def template_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: each call's `arguments` a mapping (OpenAI sends a
    JSON string; Qwen's and Hermes' templates write `arguments | tojson`), as vLLM passes them."""
    if not isinstance(calls, list):
        raise RowError(f"{where}: tool_calls: expected a list of calls")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(f"{where}: tool_calls[{k}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise RowError(f"{where}: tool_calls[{k}].function.arguments: invalid JSON: {e}") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
