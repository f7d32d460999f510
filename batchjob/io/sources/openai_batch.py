"""The OpenAI Batch source: a request file (one uncompressed .jsonl) whose lines become records through
the codec's `request_record`, and telling such a file from plain JSONL by its first lines. A bad line,
or a repeated custom_id, becomes a per-row error that still carries its custom_id when it has one."""
from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

from batchjob.io.openai_batch import CHAT, COLUMNS, COMPLETIONS, EMBEDDINGS, is_request_shaped, request_record
from batchjob.io.sources.base import InputRow, SourceError, narrow
from batchjob.io.sources.jsonl import JsonlSource, codec_of

DETECT_LINES = 20  # non-blank lines read to tell a request file from plain JSONL


def open_openai_batch(path: Path) -> OpenAIBatchSource:
    if path.is_dir() or codec_of(path) is not None:
        raise SourceError(f"{path}: an OpenAI Batch input must be one uncompressed .jsonl file")
    return OpenAIBatchSource(path)


def is_openai_batch_file(path: Path) -> bool:
    """Auto-detection of a .jsonl input: one uncompressed file where at least half of the objects among
    its first DETECT_LINES non-blank lines are request-shaped (`is_request_shaped`). So one bad or
    misspelt line (it becomes that row's error) does not make a request file plain JSONL, and a plain
    file with a stray request-like line stays plain; lines that are not JSON do not count."""
    if not path.is_file() or codec_of(path) is not None:
        return False
    objects = requests = 0
    with open(path, "rb") as f:
        for line in islice((x for x in f if x.strip()), DETECT_LINES):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                objects += 1
                requests += is_request_shaped(value)
    return requests > 0 and 2 * requests >= objects


class OpenAIBatchSource(JsonlSource):
    format_name = "OpenAI batch"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.columns = list(COLUMNS)
        self.kinds: dict[bool, int] = {}  # whether embeddings -> the first row of that kind (a job runs one kind)
        self.models: Counter[str] = Counter()  # body.model -> lines naming it
        self.tool_rows = 0  # chat lines whose body carries tools
        self.duplicates, self.num_rows = self._scan_custom_ids()

    def check_task(self, task: str) -> None:
        """A request file runs as one job of one kind: embeddings lines with task = "embed", chat and completions
        lines without it (so does OpenAI's Batch API: one endpoint per batch). Raises SourceError, at start."""
        embed, generate = self.kinds.get(True), self.kinds.get(False)
        if embed is not None and generate is not None:
            raise SourceError(f"{self.path}: mixes {EMBEDDINGS} lines (the first is row {embed}) with {CHAT} or "
                              f"{COMPLETIONS} lines (the first is row {generate}); a job runs one kind: split the file "
                              f"by `url` and run the {EMBEDDINGS} lines with --task embed, the others without it")
        if embed is not None and task != "embed":
            raise SourceError(f"{self.path}: its lines are {EMBEDDINGS} requests; run them with --task embed")
        if generate is not None and task == "embed":
            raise SourceError(f"{self.path}: its lines are {CHAT} or {COMPLETIONS} requests, which generate text; run "
                              f"them without --task embed")

    def carries_tools(self, column: str) -> bool:
        return self.tool_rows > 0

    def other_models(self, served: set[str]) -> Counter[str]:
        """The `model` names of the lines that name none of `served` (answered by the job's model all the same,
        as vLLM's run_batch does): name -> lines."""
        return Counter({name: n for name, n in self.models.items() if name not in served})

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
        return InputRow(row_index, narrow(record, columns), where=where)

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
                    value = json.loads(line)
                    cid = value.get("custom_id")
                    url, body = value.get("url"), value.get("body")
                except (ValueError, AttributeError):
                    cid = url = body = None
                if url in (CHAT, COMPLETIONS, EMBEDDINGS):
                    self.kinds.setdefault(url == EMBEDDINGS, row)
                    model = body.get("model") if isinstance(body, dict) else None
                    if isinstance(model, str):
                        self.models[model] += 1
                    self.tool_rows += url == CHAT and isinstance(body, dict) and body.get("tools") not in (None, [])
                if isinstance(cid, str):
                    if cid in first:
                        duplicates[row] = first[cid]
                    else:
                        first[cid] = row
                row += 1
        self.peak_buffer_bytes = 0
        return duplicates, row


