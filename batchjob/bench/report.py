"""Turns worker output into result rows (throughput, latency percentiles, roofline share), checks the
issue-7 targets, and writes the terminal table, `bench/results-<date>.json` and the PNG chart."""
from __future__ import annotations

import json
from pathlib import Path

# Measured in the project's notes (W1, SmolLM2-135M, this machine) for when vLLM is not installed here.
VLLM_REFERENCE = {"tok_s": 443.0, "process_tok_s": 194.0, "source": "shared/notes/models-and-peers.md (W1, SmolLM2, bf16)"}
HEADLINE = ("smollm2", "W1")  # the model and workload the peer targets are stated on


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {f"p{p}": s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] for p in ps}


def summarize(raw: dict, spec=None, roofline_tables: dict | None = None) -> dict:
    """One worker result -> one result row (per-token times reduced to per-row TTFT / TPOT and percentiles)."""
    times = raw.get("token_times") or []
    counted = raw["counted"]
    out_tokens = sum(counted)
    ttft = [t[0] for t in times if t]
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    gen_s = raw["gen_s"]
    process_s = raw["startup_s"] + gen_s
    row = {
        "system": raw["system"], "model": raw["model"], "workload": raw["workload"], "status": "ok",
        "dtype": raw.get("dtype"), "kernels": raw.get("kernels"), "threads": raw.get("threads"), "rows": raw["rows"],
        "useful_tokens": raw["useful_tokens"], "output_tokens": out_tokens, "tokens_ok": out_tokens == raw["useful_tokens"],
        "computed_tokens": raw.get("computed_tokens"),
        "gen_s": gen_s, "tok_s": out_tokens / gen_s if gen_s else None,
        "load_s": raw.get("load_s"), "startup_s": raw["startup_s"], "process_s": process_s,
        "process_tok_s": out_tokens / process_s if process_s else None,
        "peak_rss_mb": raw.get("peak_rss_mb"),
        "ttft_s": percentiles(ttft), "itl_s": percentiles(gaps), "tpot_s": percentiles(tpot),
        "per_row": {"ttft_s": [round(x, 4) for x in ttft], "tpot_s": [round(x, 5) for x in tpot]},
    }
    extra = raw.get("extra") or {}
    if "step_histogram" in extra:
        row["engine"] = extra
        if spec is not None and roofline_tables:
            from batchjob.bench import roofline

            table = roofline_tables.get(f"{spec.name}/{row['dtype']}")
            if table:
                c = roofline.ceiling(table, spec, out_tokens, extra)
                c["fraction"] = row["tok_s"] / c["at_mean_batch_tok_s"] if c["at_mean_batch_tok_s"] else None
                c["fraction_per_step"] = row["tok_s"] / c["per_step_tok_s"] if c["per_step_tok_s"] else None
                row["roofline"] = c
    elif extra:
        row["extra"] = extra
    return row


def failed_row(system: str, model: str, workload: str, status: str) -> dict:
    return {"system": system, "model": model, "workload": workload, "status": status}


# ---- targets ---------------------------------------------------------------------------------------


def _find(rows: list[dict], system: str, model: str, workload: str) -> dict | None:
    for r in rows:
        if (r["system"], r["model"], r["workload"]) == (system, model, workload) and r["status"] == "ok":
            return r
    return None


def targets(rows: list[dict], pipeline: dict | None, profiles: list[dict] | None = None) -> list[dict]:
    """The issue's targets as measured ratios; `met` is None when the run lacks what a target needs."""
    out = []

    def add(name, value, goal, basis, higher=True):
        met = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "value": value, "goal": goal, "higher_is_better": higher, "met": met, "basis": basis})

    model, wl = HEADLINE
    bj = _find(rows, "batchjob", model, wl)
    if bj is None:  # a run without SmolLM2 still reports the ratios on what it has
        bj = next((r for r in rows if r["system"] == "batchjob" and r["workload"] == "W1" and r["status"] == "ok"), None)
        model = bj["model"] if bj else model
    vllm = _find(rows, "vllm", model, wl)
    if vllm is not None:
        v_gen, v_proc, vbasis = vllm["tok_s"], vllm["process_tok_s"], f"vLLM-CPU measured in this run ({model}, W1)"
    elif model == "smollm2":
        v_gen, v_proc, vbasis = VLLM_REFERENCE["tok_s"], VLLM_REFERENCE["process_tok_s"], \
            f"vLLM not installed here: reference {VLLM_REFERENCE['tok_s']:.0f} / {VLLM_REFERENCE['process_tok_s']:.0f} tok/s from {VLLM_REFERENCE['source']}"
    else:
        v_gen = v_proc = None
        vbasis = "vLLM not measured"
    add("batchjob / vLLM-CPU, generation only", bj["tok_s"] / v_gen if bj and v_gen else None, 2.0, vbasis)
    add("batchjob / vLLM-CPU, whole process", bj["process_tok_s"] / v_proc if bj and v_proc else None, 2.0, vbasis)
    hf16 = _find(rows, "hf-static16", model, wl)
    add("batchjob / HF generate static 16", bj["tok_s"] / hf16["tok_s"] if bj and hf16 else None, 5.0,
        f"{model}, W1, HF fp32")
    roof = (bj or {}).get("roofline") or {}
    add("batchjob share of the matmul-only ceiling", roof.get("fraction"), 0.5,
        f"{model}, W1, bf16 matmul FLOP/s at the run's mean {roof.get('mean_rows_per_step', 0):.1f} rows/step"
        f" (per-step ceiling incl. prefill: {roof.get('fraction_per_step') or 0:.0%})")
    for m in dict.fromkeys(r["model"] for r in rows):
        c, s = _find(rows, "batchjob", m, "W2"), _find(rows, "batchjob-static16", m, "W2")
        if c and s:
            add(f"batchjob continuous / static 16 on W2 ({m})", c["tok_s"] / s["tok_s"], 3.0, f"{m}, W2")
    for m in dict.fromkeys(r["model"] for r in rows):
        r64 = _find(rows, "batchjob", m, "W1")
        share = ((r64 or {}).get("engine") or {}).get("share_at_64")
        if share:
            add(f"outside-the-forward share at 64 running rows ({m})", share["outside_model_forward"], 0.10,
                f"{m}, W1, {share['steps']} steps with 64 rows; the engine's own StepStats.forward_s view "
                f"(runner incl. input prep + sampling): {share['outside_runner']:.1%}", higher=False)
    for m in dict.fromkeys(r["model"] for r in rows):  # issue 10: native vs torch kernels, same workload
        nat, ref = _find(rows, "batchjob", m, "W1"), _find(rows, "batchjob-torch", m, "W1")
        if nat and ref:
            add(f"native / torch kernels, W1 generation ({m})", nat["tok_s"] / ref["tok_s"], 1.0,
                f"{m}, W1, {nat.get('kernels') or 'auto'} vs torch kernels, continuous batching")
    for p in profiles or []:
        if p["kernels"] == "native":
            add(f"attention share of a 64-row decode step ({p['model']}, mean context {p['mean_context']:.0f})",
                p["shares"]["attention"], 0.15, f"torch.profiler over op groups, {p['dtype']}, step {p['step_ms']:.1f} ms "
                f"({p['warm_steps']} tokens after the W1 prompts)", higher=False)
    if pipeline and pipeline.get("runs"):
        runs = pipeline["runs"]
        n = 100_000 if "100000" in runs else max(int(k) for k in runs)  # the size for the rate
        big = runs[str(n)]
        add(f"pipeline overhead rows/s ({n:,} rows)", big.get("overhead_rows_s"), 20_000,
            f"{pipeline['format']}, max_tokens 1, tiny model: job rows / (job time - model forward time); "
            f"end to end {big.get('job_rows_s') or 0:,.0f} rows/s in the job, {big.get('rows_s') or 0:,.0f} whole process")
        growth = pipeline.get("rss_growth")
        add(f"peak RSS growth {min(int(k) for k in runs):,} -> {max(int(k) for k in runs):,} rows", growth, 0.10,
            "child process peak RSS (wait4)", higher=False)
        parts = [p for p in pipeline.get("resume_parts") or [] if p.get("resume")]
        if len(parts) >= 2:
            lo, hi = parts[0], parts[-1]
            add(f"resume start at {hi['parts']:,} vs {lo['parts']:,} committed parts (ratio)",
                hi["resume"]["first_row_s"] / lo["resume"]["first_row_s"], 1.25,
                f"seconds from process start to the first new row: {lo['resume']['first_row_s']} vs "
                f"{hi['resume']['first_row_s']}", higher=False)
    return out


# ---- output ----------------------------------------------------------------------------------------


def _ms(p: dict | None, key: str) -> str:
    return f"{p[key] * 1000:.0f}" if p and p.get(key) is not None else "-"


def table(rows: list[dict]) -> str:
    head = ["model", "wl", "system", "dtype", "tok/s", "gen s", "proc s", "proc tok/s", "TTFT p50/p99 ms",
            "ITL p50/p99 ms", "RSS MB", "roofline", "outside fwd"]
    lines = [head]
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["model"], r["workload"], r["system"], "", r["status"]] + [""] * (len(head) - 5))
            continue
        eng = r.get("engine") or {}
        share = (eng.get("share") or {}).get("outside_model_forward")
        roof = (r.get("roofline") or {}).get("fraction")
        lines.append([
            r["model"], r["workload"], r["system"], r["dtype"] or "", f"{r['tok_s']:.0f}" + ("" if r["tokens_ok"] else "!"),
            f"{r['gen_s']:.1f}", f"{r['process_s']:.1f}", f"{r['process_tok_s']:.0f}",
            f"{_ms(r['ttft_s'], 'p50')}/{_ms(r['ttft_s'], 'p99')}", f"{_ms(r['itl_s'], 'p50')}/{_ms(r['itl_s'], 'p99')}",
            f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-",
            f"{roof:.0%}" if roof is not None else "", f"{share:.0%}" if share is not None else "",
        ])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def targets_text(tgts: list[dict]) -> str:
    lines = []
    for t in tgts:
        v, g = t["value"], t["goal"]
        if v is None:
            shown = "n/a"
        elif g < 1:
            shown = f"{v:.1%} (goal {'>=' if t['higher_is_better'] else '<='} {g:.0%})"
        elif g >= 1000:
            shown = f"{v:,.0f} (goal >= {g:,.0f})"
        else:
            shown = f"{v:.2f}x (goal {'>=' if t['higher_is_better'] else '<='} {g:g}x)"
        mark = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"  {t['target']}: {shown}  [{mark}]  -- {t['basis']}")
    return "\n".join(lines)


def pipeline_text(p: dict | None) -> str:
    if not p:
        return "  (not run)"
    lines = []
    for n, r in p["runs"].items():
        lines.append(f"  {int(n):>7,} rows ({p['format']}): rc {r['rc']}, {r.get('rows_s') or 0:,.0f} rows/s whole process "
                     f"({r['process_s']:.1f} s), {r.get('job_rows_s') or 0:,.0f} rows/s in the job, "
                     f"{r.get('overhead_rows_s') or 0:,.0f} rows/s without the model's forward "
                     f"({r.get('model_s') or 0:.1f} of {r.get('job_s') or 0:.1f} s), peak RSS {r['peak_rss_mb']:.0f} MB")
        if r.get("error"):
            lines.append("    error: " + r["error"].strip().splitlines()[-1])
    if p.get("rss_growth") is not None:
        sizes = sorted(int(k) for k in p["runs"])
        lines.append(f"  peak RSS growth {sizes[0]:,} -> {sizes[-1]:,} rows: {p['rss_growth']:+.1%}")
    for r in p.get("resume_parts") or []:
        lines.append(f"  resume after {r['parts']:,} committed parts: first new row {r['resume']['first_row_s']}s after "
                     f"start (finished after {r['resume']['done_s']}s), peak RSS {r['resume']['peak_rss_mb']} MB")
    res = p.get("resume") or {}
    if res.get("status") == "ok":
        lines.append(f"  resume of a {res['done_before'] / res['total_rows']:.0%}-done job ({res['done_before']:,}/"
                     f"{res['total_rows']:,} rows committed): first new row {res['first_row_s']:.2f} s after start, "
                     f"finished in {res['process_s']:.2f} s, {res['rows_written']:,} rows redone, peak RSS {res['peak_rss_mb']:.0f} MB")
    elif res:
        lines.append(f"  resume: {res.get('status')}")
    return "\n".join(lines)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))


def json_out(report: dict, path: Path | None) -> None:
    """A bench's `--json FILE`: the report written there, else printed."""
    if path:
        path.write_text(json.dumps(report, indent=1))
    else:
        print(json.dumps(report, indent=1))


def chart(path: Path, rows: list[dict]) -> str | None:
    """Throughput per system and workload (one panel per model), and latency CDFs for the headline run.
    Returns None, or why no chart was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no results"
    models = list(dict.fromkeys(r["model"] for r in ok))
    fig, axes = plt.subplots(2, max(2, len(models)), figsize=(7 * max(2, len(models)), 10), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for r in ok))
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(systems)}
    for ax, model in zip(axes[0], models):
        mine = [r for r in ok if r["model"] == model]
        wls = list(dict.fromkeys(r["workload"] for r in mine))
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, ys = [], []
            for i, w in enumerate(wls):
                r = _find(mine, s, model, w)
                if r:
                    xs.append(i + j * width)
                    ys.append(r["tok_s"])
            if xs:
                ax.bar(xs, ys, width, label=s, color=colors[s])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wls))], wls)
        speeds = [r["tok_s"] for r in mine if r["tok_s"]]
        if speeds and max(speeds) > 20 * min(speeds):
            ax.set_yscale("log")
        ax.set_ylabel("output tokens/s (useful tokens)")
        ax.set_title(f"throughput, {model}")
        ax.legend(fontsize=8)
    for ax in axes[0][len(models):]:
        ax.axis("off")
    model, wl = HEADLINE if any(r["model"] == HEADLINE[0] for r in ok) else (models[0], "W1")
    for ax, key, label in ((axes[1][0], "ttft_s", "time to first token (s)"), (axes[1][1], "tpot_s", "per-row mean time per output token (s)")):
        for r in ok:
            if r["model"] == model and r["workload"] == wl and r["per_row"][key]:
                xs = sorted(r["per_row"][key])
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["system"], color=colors[r["system"]])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of rows")
        ax.set_title(f"latency CDF, {model} {wl}")
        ax.legend(fontsize=8)
    for ax in axes[1][2:]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
