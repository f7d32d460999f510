"""`batchjob status` as text: one output folder (io/folder_status.py) or a sharded job (sharding/sharded_output.py)
from the status dicts that `--json` prints as they are."""
from __future__ import annotations

import time

from batchjob.io.durations import format_duration
from batchjob.io.ranges import RowRanges
from batchjob.io.sizes import format_bytes


def format_status(st: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"{st['output']}: {st['state']}, {_rows(st)}, {st['errors']} errors"]
    lines.append(f"  tokens: {st['prompt_tokens']} prompt + {st['completion_tokens']} completion"
                 + (f"; {st['rows_per_s']:.1f} rows/s, {st['tokens_per_s'] or 0:.0f} tokens/s "
                    f"{'now' if st['state'] == 'running' else 'in the last run'}" if st["rows_per_s"] else "")
                 + (f"; ETA {format_duration(st['eta_s'])}" if st["eta_s"] is not None else ""))
    if st["last_commit"]:
        lines.append(f"  last commit: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st['last_commit']))} "
                     f"({format_duration(now - st['last_commit'])} ago)")
    if st.get("peak_rss_bytes"):  # none for a job whose runs predate it
        lines.append(f"  peak RSS: {format_bytes(st['peak_rss_bytes'])} "
                     + ("so far (as of the last commit)" if st["state"] == "running" else "in the last run"))
    folders = st["folders"]
    if len(folders) == 1:
        f = folders[0]
        if f["pid"]:
            lines.append(f"  lock held by process {f['pid']}" + (f" on {f['host']}" if f["host"] else ""))
        if f["note"]:
            lines.append(f"  {f['note']}")
        if f["missing"] and f["state"] != "running":
            lines.append(f"  missing rows: {RowRanges(map(tuple, f['missing'])).describe()}")
    else:
        lines.append(f"  {'folder':<24} {'state':<9} {'rows':>15} {'errors':>7} {'rows/s':>8}  ETA")
        for f in folders:
            rate = f"{f['rows_per_s']:.1f}" if f["rows_per_s"] else "-"
            eta = format_duration(f["eta_s"]) if f["eta_s"] is not None else "-"
            lines.append(f"  {f['folder']:<24} {f['state']:<9} {_rows(f):>15} {f['errors']:>7} {rate:>8}  {eta}")
            if f["note"] and f["state"] != "finished":
                lines.append(f"    {f['note']}")
    if st["lanes"]:
        lines.append("  lanes: " + ", ".join(f"{name} {c['rows']} rows ({c['errors']} errors)"
                                              for name, c in sorted(st["lanes"].items())))
    return "\n".join(lines)


def _rows(st: dict) -> str:
    total = st["total_rows"]
    if total is None:
        guess = f", about {st['total_estimate']} in all" if st.get("total_estimate") else ""
        return f"{st['rows_done']} rows done (total not known until the input is read to its end{guess})"
    pct = 100.0 * st["rows_done"] / total if total else 100.0
    return f"{st['rows_done']}/{total} rows ({pct:.1f}%)"


def format_sharded_status(st: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    by_state: dict[str, int] = {}
    for f in st["shard_states"]:
        by_state[f["state"]] = by_state.get(f["state"], 0) + 1
    total = st["total_rows"]
    rows = "rows not known until a shard starts" if total is None else \
        f"{st['rows_done']}/{total} rows ({100.0 * st['rows_done'] / total if total else 100.0:.1f}%)"
    lines = [f"{st['output']}: {st['state']}, {rows}, {st['errors']} errors; {st['shards']} shards: "
             + ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))]
    line = f"  tokens: {st['prompt_tokens']} prompt + {st['completion_tokens']} completion"
    if st["rows_per_s"]:
        line += f"; {st['rows_per_s']:.1f} rows/s, {st['tokens_per_s'] or 0:.0f} tokens/s now"
    if st["eta_s"] is not None:
        line += f"; ETA {format_duration(st['eta_s'])}"
    lines.append(line)
    if st["last_commit"]:
        lines.append(f"  last commit: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st['last_commit']))} "
                     f"({format_duration(now - st['last_commit'])} ago)")
    if st["slurm_job"]:
        lines.append(f"  slurm job {st['slurm_job']}" + ("" if st["squeue"] else " (no squeue here: task states unknown)"))
    # each shard's last run's process (as of its last commit while it runs); "-": not run, or run before it was kept
    lines.append(f"  {'shard':>5}  {'rows':<15} {'done':>13} {'errors':>6}  {'state':<11} {'rows/s':>7} {'ETA':>8} "
                 f"{'peak RSS':>10}  slurm")
    for f in st["shard_states"]:
        span = "?" if f["start"] is None else f"{f['start']}-{f['end'] - 1}" if f["end"] > f["start"] else "(none)"
        of = "?" if f["total_rows"] is None else f["total_rows"]
        rate = f"{f['rows_per_s']:.1f}" if f["rows_per_s"] else "-"
        eta = format_duration(f["eta_s"]) if f["eta_s"] is not None else "-"
        rss = format_bytes(f["peak_rss_bytes"]) if f.get("peak_rss_bytes") else "-"
        lines.append(f"  {f['shard']:>5}  {span:<15} {f['rows_done']:>6}/{of:<6} {f['errors']:>6}  {f['state']:<11} "
                     f"{rate:>7} {eta:>8} {rss:>10}  {f['slurm_state'] or '-'}")
        if f["note"] and f["state"] not in ("finished", "running"):
            lines.append(f"         {f['note']}")
    return "\n".join(lines)
