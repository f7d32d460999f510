"""`make bench`'s quantized-KV speed (issue 14), on the native CPU kernels, unquantized vs int8 vs int4:

- attention alone: ms per layer call, SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, bf16),
  decode rows over random contexts, 30 distinct layers' caches (DRAM-resident, as in a real step);
- jobs: SmolLM2 on the sample prompts (chat: short, 64 tokens), on questions about a ~500-token text
  (long: 128 tokens) and, with `--workloads ...,long-decode`, on half as many of those for 512 tokens
  past EOS; greedy, generated tokens/s (the dtypes taking turns, best of 2), and how many tokens the pool
  holds per GiB.

    python -m batchjob.bench.kv_speed [--rows 64] [--max-tokens 64] [--workloads chat,long,long-decode] [--no-attention]
                                    [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from batchjob.bench.paths import PERPLEXITY_TEXT, PROMPTS
from batchjob.bench.report import json_out

KV = ("auto", "int8", "int4")
CASES = [(8, 50, 500), (64, 50, 500), (128, 50, 500), (64, 500, 2000), (128, 500, 2000)]  # rows, context range


def attention_ms(rows: int, lo: int, hi: int, layers: int = 30, reps: int = 15, dtype=torch.bfloat16,
                 seed: int = 0) -> dict[str, float]:
    """Mean ms per layer of a decode step's attention for each KV dtype: the best of `reps` rounds, the
    dtypes taking turns in every round (this machine's speed drifts by tens of percent between seconds)."""
    from batchjob.kernels import AttentionMetadata, select_kernels

    d, g, hkv, bs = 64, 3, 3, 16
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(rows)]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 1
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    bt = torch.zeros(rows, max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        bt[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    meta = AttentionMetadata(bt, torch.tensor(lens, dtype=torch.int32), torch.arange(rows + 1, dtype=torch.int32),
                             torch.zeros(rows, dtype=torch.long), rows)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, hkv * g, d, generator=gen).to(dtype)
    setups = {}
    for kv in KV:
        kern = select_kernels("native", "cpu", dtype, d, g, bs, kv_cache_dtype=kv)
        caches = []
        for _ in range(layers):  # distinct layers: DRAM-resident, as in a real step
            if kv == "auto":
                ks, vs = kern.kv_cache_shapes(nb, bs, hkv, d)
                kc, vc = torch.zeros(ks, dtype=dtype), torch.zeros(vs, dtype=dtype)
            else:
                kc, vc = kern.quantized_kv_caches(int(kv[3]), nb, bs, hkv, d, lambda s, t: torch.zeros(s, dtype=t))
            x = torch.randn(2, nb * bs, hkv, d, generator=gen).to(dtype)
            kern.store_kv(x[0], x[1], kc, vc, torch.arange(nb * bs))
            caches.append((kc, vc))
        setups[kv] = (kern, caches)
    best = {kv: float("inf") for kv in KV}
    for rep in range(reps + 1):  # round 0 warms up
        for kv, (kern, caches) in setups.items():
            t0 = time.perf_counter()
            for kc, vc in caches:
                kern.attention(q, kc, vc, meta, d ** -0.5)
            if rep:
                best[kv] = min(best[kv], (time.perf_counter() - t0) / layers * 1e3)
    return best


ASKS = ["Summarize the text above in three sentences.", "List the main claims of the text above.",
        "Write a title for the text above, then explain it.", "What questions does the text above leave open?"]


def workload(name: str, rows: int) -> list[str]:
    """chat: the sample prompts (short); long: ~500 tokens of given text (jobs/data/perplexity.txt) and a
    question about it, each row with its own row number so that no two prompts share a prefix."""
    if name == "chat":
        texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
        return [texts[i % len(texts)] for i in range(rows)]
    text = PERPLEXITY_TEXT.read_text()
    return [f"Document {i}.\n\n{text}\n\n{ASKS[i % len(ASKS)]}" for i in range(rows)]


def jobs(rows: int, max_tokens: int, rounds: int = 2, workloads=("chat", "long"), log=print) -> list[dict]:
    """Generated tokens/s of SmolLM2 on each workload per KV dtype, the best of `rounds`, the dtypes taking
    turns in every round: chat (`rows` prompts, `max_tokens`), long (`rows`, twice that), long-decode (half
    the rows of long, 8 x `max_tokens` each past EOS: contexts ~550 to ~1050)."""
    from batchjob.api import LLM
    from batchjob.engine.worker.kv_cache import KVCache

    llms = {kv: LLM("smollm2", kv_cache_dtype=kv, max_num_seqs=rows, prefix_caching=False) for kv in KV}
    out = []
    plan = [("chat", rows, max_tokens, rounds, False), ("long", rows, 2 * max_tokens, rounds, False),
            ("long-decode", rows // 2, 8 * max_tokens, rounds, True)]
    for name, n, tokens_cap, reps, past_eos in (p for p in plan if p[0] in workloads):
        prompts = workload("chat" if name == "chat" else "long", n)
        best = {kv: float("inf") for kv in KV}
        done = {}
        for rnd in range(reps + 1):  # round 0 warms up (kernels compiled, first-call costs paid)
            for kv, llm in llms.items():
                t0 = time.perf_counter()
                results = llm.generate(prompts if rnd else prompts[:2], chat=True, max_tokens=tokens_cap if rnd else 4,
                                       ignore_eos=past_eos)
                if rnd:
                    best[kv] = min(best[kv], time.perf_counter() - t0)
                    done[kv] = results
        for kv, llm in llms.items():
            model = llm.engine.runner.model
            results = done[kv]
            tokens = sum(r.completion_tokens for r in results)
            j = {"workload": name, "kv_cache_dtype": kv, "kernels": model.kernels.name, "rows": n,
                 "max_tokens": tokens_cap, "mean_context": round(sum(r.prompt_tokens + r.completion_tokens for r in results) / n),
                 "tokens": tokens, "seconds": round(best[kv], 2), "tokens_s": round(tokens / best[kv], 1),
                 "kv_tokens_per_gib": int(2 ** 30 / (KVCache.bytes_per_block(model, 16) / 16))}
            out.append(j)
            log(job_line(j))
    return out


def measure(rows: int = 64, max_tokens: int = 64, workloads=("chat", "long"), with_attention: bool = True,
            log=print) -> dict:
    attention = []
    for r, lo, hi in CASES if with_attention else []:
        a = {"rows": r, "context": [lo, hi], "ms_per_layer": {kv: round(v, 4) for kv, v in attention_ms(r, lo, hi).items()}}
        attention.append(a)
        log(attention_line(a))
    return {"threads": torch.get_num_threads(), "attention": attention,
            "jobs": jobs(rows, max_tokens, workloads=workloads, log=log)}


def attention_line(a: dict) -> str:
    ms = a["ms_per_layer"]
    return (f"  attention {a['rows']:3} rows, context {a['context'][0]}-{a['context'][1]}: "
            + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
            + f"  int8 x{ms['auto'] / ms['int8']:.2f}  int4 x{ms['auto'] / ms['int4']:.2f}")


def job_line(j: dict) -> str:
    return (f"  job {j['workload']:11} (mean context {j['mean_context']:4}) {j['kv_cache_dtype']:4} ({j['kernels']}): "
            f"{j['tokens_s']:.1f} tok/s, {j['kv_tokens_per_gib']:,} KV tokens/GiB")


def text(report: dict) -> str:
    return "\n".join([attention_line(a) for a in report["attention"]] + [job_line(j) for j in report["jobs"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.kv_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the report here (default: print it)")
    ap.add_argument("--workloads", default="chat,long", help="jobs among chat,long,long-decode (long-decode: minutes)")
    ap.add_argument("--no-attention", action="store_true", help="skip the attention timings")
    args = ap.parse_args(argv)
    report = measure(args.rows, args.max_tokens, workloads=args.workloads.split(","), with_attention=not args.no_attention)
    json_out(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
