"""gpt-oss's harmony format (`--reasoning-parser gpt_oss`): an answer is a run of messages, each a header, `<|message|>`
and a body ended by `<|end|>` (then `<|start|>` and the next), `<|return|>` or `<|call|>`. A header is
`assistant<|channel|>NAME`, and may name a recipient (`to=functions.get_weather`, before or after the channel) and a
content type (`json`, `<|constrain|>json`). As vLLM reads them: `analysis` messages are the thinking; messages to a
tool are calls (`Split.calls`, read by the `openai` tool parser), in neither the thinking nor the answer; the others
(`final`, and `commentary` without a recipient, a preamble shown to the user) are the answer, joined by newlines, as
are several analysis messages. The thinking budget closes the analysis message and opens the final one."""
from __future__ import annotations

from dataclasses import dataclass

from batchjob.reasoning.split import AddressedMessage, Split

TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
CONSTRAIN = "<|constrain|>"  # before a content type; optional: the header's words are read either way


@dataclass(frozen=True, slots=True)
class Header:
    channel: str  # analysis, final, commentary; "" where the header has none
    recipient: str | None  # functions.get_weather
    content_type: str


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    start_id: int
    end_id: int
    message_id: int
    channel_id: int
    return_id: int
    call_id: int
    name: str = "gpt_oss"
    constrain_id: int | None = None

    @classmethod
    def of(cls, ids: dict[str, int | None]) -> HarmonyParser:
        return cls(*(ids[t] for t in TOKENS), constrain_id=ids.get(CONSTRAIN))

    def _messages(self, ids: list[int], decode):
        """(header, body ids) of each message: a header runs from the message's start (the completion's, or after the
        last message's end token and `<|start|>`) to `<|message|>`; a body to its end token or to the end of `ids`."""
        stops = {self.end_id, self.return_id, self.call_id, self.start_id}
        i = 0
        while i < len(ids):
            try:
                j = ids.index(self.message_id, i)
            except ValueError:
                return  # a header without its body (max_tokens cut it)
            k = j + 1
            while k < len(ids) and ids[k] not in stops:
                k += 1
            yield self._header(ids[i:j], decode), ids[j + 1:k]
            i = k
            while i < len(ids) and ids[i] in stops:
                i += 1

    def _header(self, ids: list[int], decode) -> Header:
        """A header's channel, recipient and content type, from its words (the channel is the first word after
        `<|channel|>`; `to=` names the recipient wherever it stands)."""
        role, channel = ids, []
        if self.channel_id in ids:
            at = ids.index(self.channel_id)
            role, channel = ids[:at], ids[at + 1:]
        words = self._words(role, decode), self._words(channel, decode)
        recipient = next((w[3:] for part in words for w in part if w.startswith("to=")), None)
        rest = [w for w in words[1] if not w.startswith("to=")]
        return Header(rest[0] if rest else "", recipient, " ".join(rest[1:]))

    def _words(self, ids: list[int], decode) -> list[str]:
        """The words of a header part; `<|constrain|>` separates them whether `decode` keeps special tokens or not."""
        parts, start = [], 0
        for at, t in enumerate(ids):
            if t == self.constrain_id:
                parts.append(ids[start:at])
                start = at + 1
        parts.append(ids[start:])
        return " ".join(decode(p) for p in parts).replace(CONSTRAIN, " ").split()

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
        thinking, answer, calls, tokens, found = [], [], [], 0, False
        for n, (header, body) in enumerate(self._messages(ids, decode)):
            found = True
            if header.channel == "analysis" or (opened and n == 0):
                thinking.append(decode(body))
                tokens += len(body)
            elif header.recipient is not None:
                calls.append(AddressedMessage(header.recipient, header.content_type, decode(body)))
            else:
                answer.append(decode(body))
        if not found:
            return Split(None, decode(ids) if stop_text is None else stop_text, 0, ())
        return Split("\n".join(thinking) if thinking else None, "\n".join(answer).strip(), tokens, tuple(calls))

    def budget_lark(self, budget: int, opened: bool) -> str:
        close = f'<[{self.end_id}]> <[{self.start_id}]> "assistant" final'
        think = f"think[max_tokens={budget}]: /(.|\\n)*/\n"
        final = f'final: <[{self.channel_id}]> "final" <[{self.message_id}]> answer\nanswer: /(.|\\n)*/\n'
        if opened:
            return f"start: think {close}\n{think}{final}"
        analysis = f'analysis: <[{self.channel_id}]> "analysis" <[{self.message_id}]> think {close}\n'
        return f"start: analysis | final\n{analysis}{think}{final}"
