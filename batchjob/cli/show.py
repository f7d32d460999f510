"""`batchjob show OUT_DIR [-n 5]` (also `python -m batchjob.cli.show`): where a job's results are, their schema, the first rows in input
order, each with its prompt (from the output when a column holds it, else read from the job's input by row
index: nothing needs copying into the output to read results against their inputs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.parts import read_results
from batchjob.io.sink import INPUT_PATH
from batchjob.io.sources import SourceError, open_source

PROMPT_COLUMNS = ("prompt", "messages", "question", "instruction", "input", "text")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchjob.cli.show", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("-n", type=int, default=5, help="rows to print (default 5)")
    parser.add_argument("--width", type=int, default=100, help="trim text to this many characters")
    args = parser.parse_args(argv)
    try:
        print(show(args.out_dir, args.n, args.width))
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def show(out_dir: Path, n: int = 5, width: int = 100) -> str:
    """What `batchjob show` prints: the summary, a blank line, the first `n` rows; ManifestError when OUT_DIR
    holds no committed results."""
    out_dir = Path(out_dir)
    manifest = Manifest.load(out_dir)
    if manifest is None:
        raise ManifestError(f"{out_dir} has no manifest.json; run a job into it first")
    table = read_results(out_dir)
    shown = table.sort_by("row_index").slice(0, n)
    return f"{summary(out_dir, manifest, table)}\n\n{preview(shown, n, width, input_prompts(manifest, shown))}"


def summary(out_dir: Path, manifest: Manifest, table) -> str:
    of_total = f" of {manifest.total_rows}" if manifest.total_rows is not None else ""
    reasons = table.column("finish_reason").value_counts().to_pylist() if table.num_rows else []
    counts = ", ".join(f"{r['counts']} {r['values']}" for r in reasons)
    lines = [
        f"results: {out_dir.resolve()}",
        f"  {len(manifest.parts)} part files (.arrow: Arrow IPC, pyarrow.ipc.open_file or pandas.read_feather; "
        f".parquet: any Parquet reader), "
        f"{table.num_rows} rows{of_total}" + (f" ({counts})" if counts else ""),
        "  read them all, sorted: batchjob.io.parts.read_results(out_dir)",
        "schema:",
        *(f"  {field.name}: {field.type}" for field in table.schema),
    ]
    return "\n".join(lines)


def input_prompts(manifest: Manifest, table) -> tuple[str, dict[int, object]] | None:
    """(column, {row index: its prompt}) for the rows of `table`, read from the job's input (recorded in the
    manifest) when the output holds no prompt column; None when there is nothing to read."""
    if any(c in table.schema.names for c in PROMPT_COLUMNS) or not table.num_rows:
        return None
    path = manifest.extra.get(INPUT_PATH)
    params = manifest.fingerprint.get("params") or {}
    if not path or not Path(path).exists():
        return None
    wanted = set(table.column("row_index").to_pylist())
    columns = [params.get("messages_column") or "messages", params.get("prompt_column") or "prompt"]
    found: dict[int, object] = {}
    name = columns[1]
    try:
        source = open_source(path)
        for row in source.rows():
            if row.row_index in wanted and row.record:
                col = next((c for c in columns if row.record.get(c) is not None), None)
                if col is not None:
                    name, found[row.row_index] = col, row.record[col]
            if row.row_index >= max(wanted):
                break
    except (SourceError, OSError):
        return None  # the input moved or changed: the results still show
    return name, found


def preview(table, n: int, width: int, prompts: tuple[str, dict[int, object]] | None = None) -> str:
    prompt_col = next((c for c in PROMPT_COLUMNS if c in table.schema.names), None)
    lines = [f"first {min(n, table.num_rows)} rows (input order):"]
    for row in table.slice(0, n).to_pylist():
        lines.append(f"[{row['row_index']}]")
        if prompt_col:
            lines.append(f"  {prompt_col}: {trim(prompt_text(row[prompt_col]), width)}")
        elif prompts is not None and row["row_index"] in prompts[1]:
            lines.append(f"  {prompts[0]}: {trim(prompt_text(prompts[1][row['row_index']]), width)}")
        if row.get("reasoning"):  # a reasoning parser's: the thinking, before the answer it led to
            lines.append(f"  reasoning: {trim(row['reasoning'], width)}")
        calls = row.get("tool_calls") or []
        if row["error"]:
            lines.append(f"  error: {trim(row['error'], width)}")
        elif row["generated_text"] or not calls:  # a row of calls alone has no text to show
            lines.append(f"  -> {trim(row['generated_text'] or '', width)}")
        for call in calls:  # a tool parser's: each call as name(arguments)
            function = call.get("function") or {}
            called = f"{function.get('name')}({function.get('arguments') or ''})"
            lines.append(f"  tool call: {trim(called, width)}")
        if row.get("tool_call_error"):
            lines.append(f"  tool call error: {trim(row['tool_call_error'], width)}")
        lines.append(f"  ({row['finish_reason']}, {row['prompt_tokens']} prompt + "
                     f"{row['completion_tokens']} completion tokens)")
    return "\n".join(lines)


def prompt_text(value) -> str:
    if isinstance(value, list):  # chat messages: show the last user turn
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return f"({len(value)} messages) {users[-1] if users else ''}"
    return "" if value is None else str(value)


def trim(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
