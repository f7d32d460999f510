"""`make bench`'s speculative workload: SmolLM2 rewriting given texts (jobs/data/rewrite.jsonl, chat,
greedy, 96 tokens), where prompt lookup should help, at several batch sizes, with speculation off,
forced on at every batch size (speculative_max_rows large) and as shipped (default max rows). Reports
generated tokens/s, speed-up over off, acceptance rate, tokens per row forward, and whether the text
matched the run without speculation. `--draft-layers N` adds a draft-model run: SmolLM2's first N layers
as the draft (bench/draft_model.py; no smaller model of the family ships here).

    python -m batchjob.bench.speculative [--batches 1,4,16,64] [--max-tokens 96] [--draft-layers N]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from batchjob.bench.paths import CACHE, ROOT

MODES = {"off": dict(speculative="none"), "forced": dict(speculative="ngram", speculative_max_rows=1 << 20),
         "default": dict(speculative="ngram")}


def prompts(rows: int) -> list[str]:
    texts = [json.loads(line)["prompt"] for line in (ROOT / "jobs/data/rewrite.jsonl").read_text().splitlines()]
    return [texts[i % len(texts)] for i in range(rows)]


def run_one(batch: int, mode: str, max_tokens: int, model: str = "smollm2") -> dict:
    from batchjob.api import LLM

    llm = LLM(model, max_num_seqs=batch, prefix_caching=False, **MODES[mode])
    rows = prompts(max(8, batch))
    llm.generate(rows[:1], chat=True, max_tokens=4)  # warm: kernels compiled, first-call costs paid
    engine = llm.engine
    before = (engine.proposer.proposed, engine.proposer.accepted) if engine.proposer else (0, 0)
    t0 = time.perf_counter()
    results = llm.generate(rows, chat=True, max_tokens=max_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    proposed, accepted = ((engine.proposer.proposed - before[0], engine.proposer.accepted - before[1])
                          if engine.proposer else (0, 0))
    return {"batch": batch, "mode": mode, "rows": len(rows), "tokens": tokens, "seconds": round(wall, 3),
            "tokens_s": round(tokens / wall, 1), "proposed": proposed, "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "tokens_per_row_forward": round(tokens / (tokens - accepted), 3) if tokens else None,
            "texts": [r.text for r in results]}


def measure(batches: list[int], max_tokens: int = 96, log=print) -> list[dict]:
    out = []
    for b in batches:
        runs = [run_one(b, mode, max_tokens) for mode in MODES]
        off = runs[0]
        for r in runs:
            r["speedup"] = round(r["tokens_s"] / off["tokens_s"], 3)
            r["same_text"] = r["texts"] == off["texts"]
        for r in runs:
            del r["texts"]
        log(text(runs))
        out.extend(runs)
    return out


def text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        acc = "" if r["acceptance_rate"] is None else f", acceptance {r['acceptance_rate']:.0%}, {r['tokens_per_row_forward']} tok/row-forward"
        lines.append(f"  batch {r['batch']:3} {r['mode']:8} {r['tokens_s']:7.1f} tok/s  x{r['speedup']:.2f}{acc}"
                     f"{'' if r['same_text'] else '  TEXT DIFFERS'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, help="write the rows here (default: print them)")
    ap.add_argument("--draft-layers", type=int, default=0, help="also run a draft model: SmolLM2's first N layers")
    ap.add_argument("--cache-dir", type=Path, default=CACHE, help="where the draft model is built")
    args = ap.parse_args(argv)
    if args.draft_layers:
        from batchjob.bench.draft_model import truncated_smollm2

        folder = truncated_smollm2(args.draft_layers, args.cache_dir / f"smollm2-first-{args.draft_layers}-layers")
        MODES["draft"] = dict(speculative="draft", draft_model=str(folder), speculative_max_rows=1 << 20)
    rows = measure([int(b) for b in args.batches.split(",")], args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    else:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
