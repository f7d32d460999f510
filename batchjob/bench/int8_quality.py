"""Quality of int8 compute (`--quantization int8`, issue 25) on SmolLM2, against bf16 with the same kernels, in
the way kv_quality.py measures the quantized KV cache:

- greedy agreement: share of the sample prompts (jobs/data/prompts.jsonl, chat) whose first 64 generated
  tokens are identical to bf16's;
- perplexity and mean absolute logit error over a fixed text (jobs/data/perplexity.txt), teacher-forced in
  chunks of 64 tokens;
- with and without an int8 LM head (shipped: with; this is the measurement that decided it);
- for scale, the bf16 noise floor: bf16 on the torch reference kernels (other summation orders in attention
  and the norms) against bf16 on the native ones, and fp32 against bf16.

    python -m batchjob.bench.int8_quality [--prompts 64] [--max-tokens 64] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.bench.paths import PERPLEXITY_TEXT, PROMPTS
from batchjob.bench.report import json_out

# (name, quantization, int8 LM head, kernels, dtype); the first is the reference of all
VARIANTS = [("bf16", "none", False, "native", "bfloat16"), ("bf16, torch kernels", "none", False, "torch", "bfloat16"),
            ("fp32", "none", False, "native", "float32"), ("int8", "int8", True, "native", "bfloat16"),
            ("int8, bf16 LM head", "int8", False, "native", "bfloat16")]


def _llm(quantization: str, lm_head: bool, kernels: str, dtype: str):
    """An LLM on SmolLM2 whose model is built with these options (the LM head kept in bf16 is no job option)."""
    from batchjob.api import LLM
    from batchjob.models.loader import load_model
    from batchjob.models.registry import build_model

    llm = LLM("smollm2", kernels=kernels, dtype=dtype, quantization=quantization, max_num_seqs=64, prefix_caching=False)
    if quantization == "int8" and not lm_head:
        loaded = load_model("smollm2", dtype=llm.dtype)
        llm._models = (build_model(loaded.config, loaded.weights, llm.dtype, "cpu", kernels=kernels,
                                   quantization=quantization, quantize_lm_head=False), None)
        llm._engine = None  # rebuilt around the new model at the next call
    return llm


def measure(num_prompts: int = 64, max_tokens: int = 64, variants=VARIANTS, log=print) -> dict:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:num_prompts]
    text = PERPLEXITY_TEXT.read_text()
    rows, ref = [], None
    for name, quantization, lm_head, kernels, dtype in variants:
        t0 = time.perf_counter()
        llm = _llm(quantization, lm_head, kernels, dtype)
        texts = [r.token_ids for r in llm.generate(prompts, chat=True, max_tokens=max_tokens)]
        ids = llm.tokenizer.encode(text)
        logits = teacher_forced_logits(llm.engine.model, ids)
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
        row = {"variant": name, "quantization": quantization, "int8_lm_head": lm_head, "kernels": kernels, "dtype": dtype,
               "perplexity": round(math.exp(nll.item()), 4), "text_tokens": len(ids)}
        if ref is None:
            ref = (texts, logits)
        else:
            row["greedy_agreement"] = round(sum(a == b for a, b in zip(texts, ref[0])) / len(texts), 4)
            row["mean_abs_logit_error"] = round((logits - ref[1]).abs().mean().item(), 5)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        log(line(row))
        del llm
    return {"prompts": len(prompts), "max_tokens": max_tokens, "reference": variants[0][0], "rows": rows}


def line(r: dict) -> str:
    more = "" if "greedy_agreement" not in r else (f", greedy agreement {r['greedy_agreement']:.1%}, mean |logit error| "
                                                   f"{r['mean_abs_logit_error']}")
    return f"  {r['variant']:22} perplexity {r['perplexity']}{more}"


def text(report: dict) -> str:
    return "\n".join(line(r) for r in report["rows"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.int8_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the report here (default: print it)")
    args = ap.parse_args(argv)
    report = measure(args.prompts, args.max_tokens)
    json_out(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
