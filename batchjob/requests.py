"""Turns an input record into prompt token ids: a plain prompt, a prompt wrapped as a chat message,
or a `messages` list rendered with the chat template. Problems are per-row errors (RowError)."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.config import JobConfig


class RowError(ValueError):
    pass


@dataclass(slots=True)
class PromptBuilder:
    config: JobConfig
    tokenizer: object  # batchjob.models.tokenizer.Tokenizer
    use_messages: bool  # the input has the messages column
    chat_template: str | None = None

    def messages(self, record: dict) -> list[dict] | None:
        cfg = self.config
        msgs = record.get(cfg.messages_column) if self.use_messages else None
        if msgs is None:
            if not cfg.chat:
                return None
            msgs = [{"role": "user", "content": self._prompt_text(record)}]
        if not isinstance(msgs, list) or not msgs:
            raise RowError(f"column {cfg.messages_column!r}: expected a non-empty list of {{role, content}} messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError(f"column {cfg.messages_column!r}: message {i} needs string 'role' and 'content'")
        if cfg.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": cfg.system_prompt}] + msgs
        return msgs

    def _prompt_text(self, record: dict) -> str:
        col = self.config.prompt_column
        value = record.get(col)
        if value is None:
            raise RowError(f"column {col!r} is null")
        if not isinstance(value, str):
            raise RowError(f"column {col!r}: expected a string, got {type(value).__name__}")
        if not value.strip():
            raise RowError(f"column {col!r} is empty")
        return value

    def token_ids(self, record: dict) -> list[int]:
        msgs = self.messages(record)
        tok = self.tokenizer
        if msgs is None:
            return tok.encode(self._prompt_text(record))
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, chat_template=self.chat_template)
        except Exception as e:  # template errors are the row's problem, not the job's
            raise RowError(f"chat template failed: {e}") from None
        # the template writes the special tokens itself (bos included)
        return tok.encode(text, add_special_tokens=False)
