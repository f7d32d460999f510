"""What structured outputs cost a decode step (docs/design/structured-outputs.md): compile time, and for a batch
of rows that all stay live (a finished row is replaced by a fresh one, as continuous batching does), the per-step
bitmask fill, the matchers' advance and the mask applied to the logits, on a model's real vocabulary.

    python -m batchjob.bench.structured [--model smollm2] [--rows 64] [--steps 200] [--threads 1]

Prints one `BENCH_STRUCTURED {json}` line. The rows' tokens are canonical tokenizations of valid outputs (a JSON
object of 3 fields, an e-mail-like regex, one of 4 choices), so every step fills masks in realistic states."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

MARK = "BENCH_STRUCTURED "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
KINDS = ("json", "regex", "choice")
_NAMES = ["Alice Smith", "Bob", "Charlie Brown", "Dana Scully", "Eve", "Frank Zappa", "Grace Hopper", "Heidi"]
_WORDS = ["red", "green", "blue", "fast", "slow", "python", "rust", "batch", "model"]


def _output(kind: str, rng: random.Random) -> str:
    if kind == "json":
        return json.dumps({"name": rng.choice(_NAMES), "age": rng.randint(1, 99),
                           "tags": rng.sample(_WORDS, rng.randint(0, 4))})
    if kind == "regex":
        return ("".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 10))) + "@"
                + "".join(rng.choice("klmnopq") for _ in range(rng.randint(3, 8))) + rng.choice([".com", ".org", ".net"]))
    return rng.choice(CHOICES)


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3),
            "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3), "max_ms": round(xs[-1] * 1e3, 3)}


def bench_structured(model: str = "smollm2", rows: int = 64, steps: int = 200, threads: int = 1) -> dict:
    from batchjob.engine.structured.grammar import GrammarTokenizer, compile_grammar
    from batchjob.engine.structured.mask import apply_token_bitmask_
    from batchjob.engine.structured.matcher import MaskFiller, Matcher
    from batchjob.engine.structured.spec import parse_structured_outputs
    from batchjob.models.loader import load_model

    loaded = load_model(model)
    tok = loaded.tokenizer
    start = time.perf_counter()
    gtok = GrammarTokenizer.from_tokenizer(tok, logits_width=loaded.config.vocab_size)
    out: dict = {"model": model, "rows": rows, "steps": steps, "threads": threads, "vocab": gtok.logits_width,
                 "grammar_tokenizer_s": round(time.perf_counter() - start, 3)}
    specs = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}
    grammars = {}
    for kind in KINDS:
        status = compile_grammar(parse_structured_outputs(specs[kind]), gtok)
        grammars[kind] = status.grammar
        out[f"{kind}_compile_ms"] = round(status.grammar.compile_s * 1e3, 3)
    rng = random.Random(0)
    eos = tok.eos_token_ids[0]
    pool = {k: [tok.encode(_output(k, rng)) + [eos] for _ in range(4 * rows)] for k in KINDS}
    filler = MaskFiller(threads)
    bitmask = gtok.allocate_bitmask(rows)
    for batch in (*KINDS, "mixed"):
        kind_of = [KINDS[i % 3] if batch == "mixed" else batch for i in range(rows)]
        t0 = time.perf_counter()
        matchers = [Matcher(grammars[k]) for k in kind_of]
        create_ms = (time.perf_counter() - t0) * 1e3
        texts = [pool[k][i] for i, k in enumerate(kind_of)]
        pos = [0] * rows
        fills, advances = [], []
        for step in range(steps):
            for i, k in enumerate(kind_of):
                if pos[i] == len(texts[i]):  # finished: a new row takes its place
                    texts[i], pos[i] = pool[k][(step * 7 + i) % len(pool[k])], 0
                    matchers[i] = Matcher(grammars[k])
            t0 = time.perf_counter()
            filler.fill(bitmask, matchers)
            fills.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                if not m.consume(texts[i][pos[i]]):
                    raise AssertionError(f"{batch} row {i}: a valid output's token was refused")
                pos[i] += 1
            advances.append(time.perf_counter() - t0)
        out[batch] = {"first_step_ms": round(fills[0] * 1e3, 3), **_ms(fills[1:]),
                      "create_matchers_ms": round(create_ms, 3), "consume_median_ms": _ms(advances)["median_ms"]}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, gtok.logits_width).to(dtype)
        times = []
        for _ in range(30):
            work = logits.clone()
            t0 = time.perf_counter()
            apply_token_bitmask_(work, bitmask)
            times.append(time.perf_counter() - t0)
        out[f"apply_{str(dtype).removeprefix('torch.')}"] = _ms(times)
    return out


JOB_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 400},
                                               "keywords": {"type": "array", "items": {"type": "string"}}},
              "required": ["summary", "keywords"], "additionalProperties": False}


def bench_job(model: str = "smollm2", rows: int = 64, max_tokens: int = 64, repeats: int = 3) -> dict:
    """`make bench`'s structured row: the same 64-row chat job with every row constrained by a JSON schema and
    unconstrained, EOS ignored so both generate max_tokens per row (a row whose grammar completes early ends
    early, so the structured job's tokens are counted, not assumed). Alternating runs in one process; tok/s
    = generated tokens / wall seconds of the generate call."""
    from batchjob.api import LLM

    llm = LLM(model, prefix_caching=False)  # every run prefills its prompts: runs are alike
    prompts = [{"messages": [{"role": "user", "content": f"Summarize chapter {i} of a novel about the sea as JSON "
                                                          f"with a summary and keywords."}]} for i in range(rows)]
    runs: dict[str, list[float]] = {"unconstrained": [], "structured": []}
    tokens: dict[str, int] = {}
    llm.generate(prompts[:4], max_tokens=8, structured_outputs={"json": JOB_SCHEMA})  # warm-up: kernels, grammar vocabulary
    for _ in range(repeats):
        for name, extra in (("unconstrained", {}), ("structured", {"structured_outputs": {"json": JOB_SCHEMA}})):
            t0 = time.perf_counter()
            results = llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True, **extra)
            runs[name].append(time.perf_counter() - t0)
            tokens[name] = sum(r.completion_tokens for r in results)
    tps = {name: tokens[name] / min(ts) for name, ts in runs.items()}
    return {"model": model, "rows": rows, "max_tokens": max_tokens, "tokens": tokens,
            "seconds": {k: [round(t, 2) for t in v] for k, v in runs.items()},
            "tok_s": {k: round(v, 1) for k, v in tps.items()},
            "slowdown": round(1 - tps["structured"] / tps["unconstrained"], 3)}


def job_text(result: dict) -> str:
    t = result["tok_s"]
    return (f"  {result['rows']} rows x {result['max_tokens']} tokens: unconstrained {t['unconstrained']:,.0f} tok/s, "
            f"every row JSON-schema constrained {t['structured']:,.0f} tok/s ({result['slowdown']:.1%} slower)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64, help="the job comparison's tokens per row")
    parser.add_argument("--json", help="write {mask: ..., job: ...} here (make bench)")
    args = parser.parse_args(argv)
    masks = bench_structured(args.model, args.rows, args.steps, args.threads)
    print(MARK + json.dumps(masks), flush=True)
    job = bench_job(args.model, args.rows, args.max_tokens)
    print(MARK + json.dumps(job), flush=True)
    print(job_text(job), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mask": masks, "job": job}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
