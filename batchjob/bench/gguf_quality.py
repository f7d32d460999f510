"""What computing GGUF weights as stored costs in accuracy (issue 46), on SmolLM2-135M's real weights written in
each format by llama.cpp's own `llama-quantize` (from the built-in Q4_1 file, `--allow-requantize`; `make
bench-llama-cpp` builds it), against the same file dequantized (`--quantization none`: the values gguf's dequantize
gives, in bf16):

- per matmul: the relative RMS error of the packed kernel (activations quantized per block in the call) against
  the dequantized fp32 matmul, over real hidden states (layer 0's inputs for a prompt) and, for scale, bf16's own;
- perplexity over jobs/data/perplexity.txt and the sample prompts (teacher-forced, bf16), as stored and
  dequantized, and their ratio (the issue's bound: within 1%);
- greedy agreement: the share of the sample prompts (chat) whose first 64 generated tokens are identical, and the
  share of teacher-forced positions whose top token agrees; the mean absolute logit error.

    python -m batchjob.bench.gguf_quality [--formats Q4_K_M,Q4_0,Q8_0,Q5_K_M,Q6_K] [--prompts 64] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import torch

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.bench.paths import CACHE, PERPLEXITY_TEXT, PROMPTS
from batchjob.bench.scale_models import llama_quantize_binary
from batchjob.bench.report import json_out

CACHE = CACHE / "gguf_quality"
FORMATS = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q6_K")


def requantized(fmt: str) -> Path:
    """SmolLM2 in `fmt`, written by llama-quantize from the built-in file (cached)."""
    from batchjob.models.loader import resolve_model_path

    out = CACHE / f"smollm2-{fmt}.gguf"
    if out.is_file():
        return out
    binary = llama_quantize_binary()
    if binary is None:
        raise RuntimeError("llama-quantize is not built: run `make bench-llama-cpp` first")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    done = subprocess.run([str(binary), "--allow-requantize", str(resolve_model_path("smollm2")), str(tmp), fmt],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {fmt} failed: {done.stderr.strip().splitlines()[-1:]}")
    tmp.rename(out)
    return out


def _model(path: Path, blocks: bool):
    from batchjob.models.loader import load_model
    from batchjob.models.registry import build_model

    loaded = load_model(str(path), dtype=torch.bfloat16, blocks=blocks)
    return build_model(loaded.config, loaded.weights, torch.bfloat16), loaded.tokenizer


def matmul_errors(stored, text_ids: list[int]) -> dict:
    """Each of layer 0's packed matmuls on real inputs: relative RMS error against the dequantized fp32 matmul (the
    packed kernel on fp32 inputs), and bf16's (bf16 weights and inputs) for scale."""
    from batchjob.kernels.linear_quant import BlockQuantLinear

    layer = stored.layers[0]
    h = stored.embed_tokens(torch.tensor(text_ids[:64])).float()
    x = torch.nn.functional.layer_norm(h, h.shape[-1:])  # a normed residual stream's scale
    out = {}
    for name, lin, inp in (("qkv", layer.attn.qkv, x), ("o", layer.attn.o, x), ("gate_up", layer.mlp.gate_up, x)):
        if not isinstance(lin, BlockQuantLinear):
            continue
        w = lin.weight.dequantized(torch.float32)
        exact = inp.double() @ w.double().T
        rel = lambda y: ((y.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
        out[name] = {"formats": dict(lin.formats), "packed_rel_rms": rel(lin(inp)),
                     "bf16_rel_rms": rel(inp.bfloat16() @ w.bfloat16().T)}
    return out


def measure(formats=FORMATS, num_prompts: int = 64, max_tokens: int = 64, log=print) -> dict:
    from batchjob.api import LLM

    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    text = PERPLEXITY_TEXT.read_text() + "\n" + "\n".join(prompts)
    rows = []
    for fmt in formats:
        path = requantized(fmt)
        row = {"format": fmt, "file_mb": round(path.stat().st_size / 1e6, 1)}
        results = {}
        for blocks in (False, True):
            model, tok = _model(path, blocks)
            ids = tok.encode(text)
            chunks = range(0, len(ids) - 1, 511)
            logits = torch.cat([teacher_forced_logits(model, ids[s:s + 512]) for s in chunks])
            target = torch.cat([torch.tensor(ids[s:s + 512][1:]) for s in chunks])
            ppl = math.exp(torch.nn.functional.cross_entropy(logits, target).item())
            llm = LLM(str(path), quantization="auto" if blocks else "none", max_num_seqs=64, prefix_caching=False)
            texts = [r.token_ids for r in llm.generate(prompts[:num_prompts], chat=True, max_tokens=max_tokens)]
            results[blocks] = (logits, ppl, texts)
            if blocks:
                row["matmuls"] = matmul_errors(model, ids)
            del llm, model
        (ref_logits, ref_ppl, ref_texts), (logits, ppl, texts) = results[False], results[True]
        row |= {"perplexity_dequantized": round(ref_ppl, 4), "perplexity_as_stored": round(ppl, 4),
                "perplexity_ratio": round(ppl / ref_ppl, 4), "text_tokens": len(ref_logits),
                "top1_agreement": round((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(), 4),
                "greedy_agreement": round(sum(a == b for a, b in zip(texts, ref_texts)) / len(texts), 4),
                "mean_abs_logit_error": round((logits - ref_logits).abs().mean().item(), 4)}
        rows.append(row)
        log(line(row))
    return {"model": "SmolLM2-135M-Instruct (built-in Q4_1, requantized by llama-quantize)", "prompts": num_prompts,
            "max_tokens": max_tokens, "rows": rows}


def line(r: dict) -> str:
    worst = max((m["packed_rel_rms"] for m in r.get("matmuls", {}).values()), default=float("nan"))
    return (f"  {r['format']:7} perplexity {r['perplexity_as_stored']:.3f} as stored vs {r['perplexity_dequantized']:.3f} "
            f"dequantized ({(r['perplexity_ratio'] - 1) * 100:+.2f}%), greedy agreement {r['greedy_agreement']:.1%}, "
            f"top-1 {r['top1_agreement']:.1%}, mean |logit error| {r['mean_abs_logit_error']}, matmul rel. RMS <= {worst:.2e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.gguf_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the report here (default: print it)")
    args = ap.parse_args(argv)
    report = measure(tuple(args.formats.split(",")), args.prompts, args.max_tokens)
    json_out(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
