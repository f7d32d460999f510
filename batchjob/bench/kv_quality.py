"""Quality of the quantized KV cache on SmolLM2 (issue 14), against the unquantized cache with the same
(torch reference) kernels and dtype:

- greedy agreement: share of the sample prompts (jobs/data/prompts.jsonl, chat) whose first 64
  generated tokens are identical;
- mean absolute logit error and perplexity over a fixed text (jobs/data/perplexity.txt), teacher-forced
  in chunks of 64 tokens, so that later chunks read the quantized K/V of the earlier ones (and every
  chunk its own, stored before attention reads it);
- for int4, the scale group size along head_dim (16, 32, 64 = one scale per token and head);
- the native kernels' int8/int4 (integer dot products: the query quantized to int8 for Q.K, P to 15 bits for P.V)
  against the same reference;
- for scale, the noise floor: the unquantized cache on the native kernels (another summation order),
  and int8 against the unquantized cache in fp32 (no bf16 rounding between them).

    python -m batchjob.bench.kv_quality [--prompts 64] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from batchjob.bench.paths import PERPLEXITY_TEXT, PROMPTS

CHUNK = 64


def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids) - 1, vocab] (fp32) of every next token, the text fed in chunks through the paged cache."""
    from batchjob.engine.worker.input_batch import rows_of, step_inputs
    from batchjob.engine.worker.model_runner import ModelRunner
    from batchjob.engine.core.scheduler import Step
    from batchjob.models.step_context import StepContext
    from batchjob.engine.params import SamplingParams
    from batchjob.engine.core.sequence import Sequence, SeqStatus

    bs = 16
    runner = ModelRunner(model, -(-len(ids) // bs) + 1, bs)
    seq = Sequence(0, list(ids), SamplingParams(max_tokens=1))
    seq.block_table, seq.status = list(range(-(-len(ids) // bs))), SeqStatus.RUNNING
    out = []
    for start in range(0, len(ids) - 1, CHUNK):
        n = min(CHUNK, len(ids) - 1 - start)
        inputs = step_inputs(rows_of(Step([seq], [n])), bs, False)
        input_ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
        hidden = model.forward(StepContext(positions, meta, runner.kv.layers, input_ids=input_ids))
        out.append(model.logits(hidden).float())
        seq.num_computed += n
    return torch.cat(out)


def measure(num_prompts: int = 64, max_tokens: int = 64, log=print, only: list[str] | None = None) -> dict:
    from batchjob.api import LLM
    from batchjob.kernels.reference import kv_quant
    from batchjob.models.registry import build_model

    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:num_prompts]
    text = PERPLEXITY_TEXT.read_text()
    # (KV dtype, int4 group, kernels, dtype); the first of each dtype is the reference of the ones after it
    variants = [("auto", None, "torch", None), ("int8", None, "torch", None), ("int4", 16, "torch", None),
                ("int4", 32, "torch", None), ("int4", 64, "torch", None), ("auto", None, "native", None),
                ("int8", None, "native", None), ("int4", 16, "native", None),
                ("auto", None, "torch", "float32"), ("int8", None, "torch", "float32"), ("int8", None, "native", "float32")]
    if only:  # a subset (the first of each dtype stays: it is the reference)
        variants = [v for v in variants if v[0] == "auto" and v[2] == "torch" or f"{v[0]}/{v[2]}" in only]
    base_group = kv_quant.GROUP4
    results, refs = [], {}
    for kv, group, kernels, dtype in variants:
        kv_quant.GROUP4 = group or base_group  # the int4 scale layout under test (read when caches are built)
        t0 = time.perf_counter()
        llm = LLM("smollm2", kernels=kernels, kv_cache_dtype=kv, max_num_seqs=64, dtype=dtype)
        texts = [r.token_ids for r in llm.generate(prompts, chat=True, max_tokens=max_tokens)]
        loaded = llm.loaded
        model = build_model(loaded.config, loaded.weights, llm.dtype, "cpu", kernels=kernels, kv_cache_dtype=kv)
        ids = loaded.tokenizer.encode(text)
        logits = teacher_forced_logits(model, ids)
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
        row = {"kv_cache_dtype": kv, "int4_group": group, "kernels": kernels, "dtype": str(llm.dtype).removeprefix("torch."),
               "perplexity": round(math.exp(nll.item()), 4), "text_tokens": len(ids),
               "seconds": round(time.perf_counter() - t0, 1)}
        if row["dtype"] not in refs:
            refs[row["dtype"]] = (texts, logits)
        else:
            ref_texts, ref_logits = refs[row["dtype"]]
            row["greedy_agreement"] = round(sum(a == b for a, b in zip(texts, ref_texts)) / len(texts), 4)
            row["mean_abs_logit_error"] = round((logits - ref_logits).abs().mean().item(), 5)
        results.append(row)
        log(line(row))
    kv_quant.GROUP4 = base_group
    return {"prompts": len(prompts), "max_tokens": max_tokens, "rows": results}


def line(r: dict) -> str:
    name = (r["kv_cache_dtype"] + (f" (group {r['int4_group']})" if r["int4_group"] else "")
            + ("" if r["kernels"] == "torch" else f", {r['kernels']}") + f", {r['dtype']}")
    more = "" if "greedy_agreement" not in r else (f", greedy agreement {r['greedy_agreement']:.1%}, mean |logit error| "
                                                   f"{r['mean_abs_logit_error']}")
    return f"  {name:28} perplexity {r['perplexity']}{more}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.kv_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="*", help="variants as KV/KERNELS, e.g. int8/native (the references always run)")
    args = ap.parse_args(argv)
    report = measure(args.prompts, args.max_tokens, only=args.only)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
