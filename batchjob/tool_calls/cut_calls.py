"""An answer that the length limit (max_tokens, max_model_len) cut inside a call: the complete calls before the cut are
kept, the cut one is reported. A model asked for `required` with parallel calls allowed may repeat calls until
max_tokens; a parser reads a whole answer and refuses one with a call cut in half, which would lose every valid call
before it."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from batchjob.tool_calls.parsers import ParsedCalls

CLOSERS = frozenset(">}])")  # the last character of every call syntax's end: a tag, an object, a call, a list
LIST_ENDS = ("", "]")  # a prefix as it is, or closed as a list of calls (mistral's, pythonic's)


def complete_calls(parse: Callable[[str, Sequence[int]], ParsedCalls], text: str, output_ids: Sequence[int],
                   parsed: ParsedCalls) -> ParsedCalls:
    """`parsed` (`parse(text)`, which failed) as the calls of the longest prefix of `text` that parses into calls
    without an error, the rest kept in the content and named in the error; `parsed` with the cut said in its error
    where no prefix holds a complete call. The prefixes tried end at a closing character, from the longest."""
    for end in range(len(text), 0, -1):
        if text[end - 1] not in CLOSERS:
            continue
        for close in LIST_ENDS:
            found = parse(text[:end] + close, output_ids)
            if found.calls and found.error is None:
                rest = text[end:].strip()
                content = "\n".join(part for part in (found.content.strip(), rest) if part)
                kept = f"{len(found.calls)} complete call" + ("s (kept)" if len(found.calls) > 1 else " (kept)")
                return ParsedCalls(found.calls, content, f"the length limit cut the answer after {kept}; the rest does "
                                   f"not parse ({parsed.error}): {rest[:80]!r}")
    return ParsedCalls(parsed.calls, parsed.content, f"{parsed.error} (the answer was cut: finish_reason length)")
