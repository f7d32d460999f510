"""`python -m batchjob.cli.show OUT_DIR [-n 5]`: where a job's results are, their schema, the first rows."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.parts import read_results

PROMPT_COLUMNS = ("prompt", "messages", "question", "instruction", "input", "text")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchjob.cli.show", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("-n", type=int, default=5, help="rows to print (default 5)")
    parser.add_argument("--width", type=int, default=100, help="trim text to this many characters")
    args = parser.parse_args(argv)
    try:
        manifest = Manifest.load(args.out_dir)
        if manifest is None:
            raise ManifestError(f"{args.out_dir} has no manifest.json; run a job into it first")
        table = read_results(args.out_dir)
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(args.out_dir, manifest, table))
    print()
    print(preview(table, args.n, args.width))
    return 0


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


def preview(table, n: int, width: int) -> str:
    prompt_col = next((c for c in PROMPT_COLUMNS if c in table.schema.names), None)
    lines = [f"first {min(n, table.num_rows)} rows:"]
    for row in table.slice(0, n).to_pylist():
        lines.append(f"[{row['row_index']}]")
        if prompt_col:
            lines.append(f"  {prompt_col}: {trim(prompt_text(row[prompt_col]), width)}")
        if row["error"]:
            lines.append(f"  error: {trim(row['error'], width)}")
        else:
            lines.append(f"  -> {trim(row['generated_text'] or '', width)}")
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
