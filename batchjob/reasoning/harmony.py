"""gpt-oss's harmony format (`--reasoning-parser gpt_oss`): an answer is a run of messages, each
`<|channel|>NAME<|message|>TEXT` ended by `<|end|>` (then `<|start|>assistant` and the next), `<|return|>` or
`<|call|>`. The `analysis` channel is the thinking; `final` is the answer (`commentary`, a tool-call preamble, is kept
with the answer). The thinking budget closes the analysis message and opens the final one."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.reasoning.split import Split

TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    start_id: int
    end_id: int
    message_id: int
    channel_id: int
    return_id: int
    call_id: int
    name: str = "gpt_oss"

    @classmethod
    def of(cls, ids: dict[str, int]) -> HarmonyParser:
        return cls(*(ids[t] for t in TOKENS))

    def _messages(self, ids: list[int], decode):
        """(channel name, body ids) of each message; a body runs to its end token or to the end of `ids`."""
        stops = {self.end_id, self.return_id, self.call_id, self.start_id}
        i = 0
        while i < len(ids):
            if ids[i] != self.channel_id:
                i += 1
                continue
            j = ids.index(self.message_id, i) if self.message_id in ids[i:] else len(ids)
            k = j + 1
            while k < len(ids) and ids[k] not in stops:
                k += 1
            yield decode(ids[i + 1:j]).strip(), ids[j + 1:k]
            i = k

    def opened_by(self, prompt_ids) -> bool:
        """Whether the prompt ends inside an analysis message (a template that opens the thinking itself)."""
        ids = list(prompt_ids)
        if self.channel_id not in ids:
            return False
        last = len(ids) - 1 - ids[::-1].index(self.channel_id)
        rest = ids[last:]
        return self.message_id in rest and not ({self.end_id, self.return_id, self.start_id} & set(rest))

    def split(self, output_ids, decode, opened: bool, stop_text: str | None = None) -> Split:
        ids = list(output_ids)
        if opened:  # the prompt opened the analysis message: the answer starts inside it (a nameless message here)
            ids = [self.channel_id, self.message_id] + ids
        thinking, answer, tokens, found = [], [], 0, False
        for channel, body in self._messages(ids, decode):
            found = True
            if channel.startswith("analysis") or (opened and not channel and not thinking):
                thinking.append(decode(body))
                tokens += len(body)
            else:
                answer.append(decode(body))
        if not found:
            return Split(None, decode(ids) if stop_text is None else stop_text, 0)
        return Split("".join(thinking) if thinking else None, "".join(answer).strip(), tokens)

    def budget_lark(self, budget: int, opened: bool) -> str:
        close = f'<[{self.end_id}]> <[{self.start_id}]> "assistant" final'
        think = f"think[max_tokens={budget}]: /(.|\\n)*/\n"
        final = f'final: <[{self.channel_id}]> "final" <[{self.message_id}]> answer\nanswer: /(.|\\n)*/\n'
        if opened:
            return f"start: think {close}\n{think}{final}"
        analysis = f'analysis: <[{self.channel_id}]> "analysis" <[{self.message_id}]> think {close}\n'
        return f"start: analysis | final\n{analysis}{think}{final}"
