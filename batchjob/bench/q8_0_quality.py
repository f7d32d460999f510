"""What `--quantization int8` costs on a GGUF Q8_0 model (issue 25): its matrices re-quantized per output channel
from their exact Q8_0 values (kernels/quantization.py QuantizedWeight.int8_channel) against the Q8_0 values
themselves. SmolLM2's weights (the built-in Q4_1 file, dequantized) are written as Q8_0 here by gguf's
quantize, so no other file is needed:

- weight error of the re-quantization over the Q8_0 values (max and mean |error|, relative to mean |w|), next to
  Q8_0's own error against the weights it was made from, and per-channel int8 of those weights;
- perplexity over jobs/data/perplexity.txt (teacher-forced, bf16 compute), the share of positions whose top
  token agrees with the Q8_0 model in bf16, and the mean absolute logit error.

    python -m batchjob.bench.q8_0_quality [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.bench.paths import PERPLEXITY_TEXT
from batchjob.kernels.quantization import QuantizedWeight
from batchjob.kernels import quantize_weight_int8
from batchjob.models.gguf_file import Q8_0_BLOCK
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model


def q8_0(w: torch.Tensor) -> QuantizedWeight:
    """w [N, K] as llama.cpp's Q8_0 (gguf's quantize), kept as codes and block scales."""
    raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 2 + Q8_0_BLOCK)
    scales = torch.from_numpy(raw[:, :2].copy().view(np.float16).astype(np.float32)).reshape(w.shape[0], -1)
    return QuantizedWeight(torch.from_numpy(raw[:, 2:].copy().view(np.int8)).reshape(w.shape), scales, "GGUF Q8_0",
                           Q8_0_BLOCK)


def measure(log=print) -> dict:
    loaded = load_model("smollm2", torch.float32)
    source = {n: t for n, t in loaded.weights.items() if t.dim() == 2 and "embed_tokens" not in n}
    weights = {n: q8_0(t) if n in source else t for n, t in loaded.weights.items()}
    err = {"requant_vs_q8_0": [], "q8_0_vs_source": [], "int8_vs_source": []}
    scale = []
    for n, w in source.items():
        v = weights[n].dequantized(torch.float32)
        codes, s = quantize_weight_int8(v)
        err["requant_vs_q8_0"].append((codes.float() * s[:, None] - v).abs())
        err["q8_0_vs_source"].append((v - w).abs())
        codes, s = quantize_weight_int8(w)
        err["int8_vs_source"].append((codes.float() * s[:, None] - w).abs())
        scale.append(w.abs().mean().item() * w.numel())
    mean_w = sum(scale) / sum(w.numel() for w in source.values())
    out = {"matrices": len(source), "mean_abs_weight": mean_w}
    for k, parts in err.items():
        flat = torch.cat([p.reshape(-1) for p in parts])
        out[k] = {"max_abs": flat.max().item(), "mean_abs": flat.mean().item(), "mean_abs_rel": flat.mean().item() / mean_w}
    ids = loaded.tokenizer.encode(PERPLEXITY_TEXT.read_text())
    rows = {}
    for name, quantization in (("Q8_0 values, bf16", "none"), ("Q8_0 -> int8 per channel", "int8")):
        model = build_model(loaded.config, dict(weights), torch.bfloat16, kernels="native" if _native() else "torch",
                            quantization=quantization)
        rows[name] = teacher_forced_logits(model, ids).float()
    ref = rows["Q8_0 values, bf16"]
    target = torch.tensor(ids[1:])
    out["text_tokens"] = len(ids)
    for name, logits in rows.items():
        out[name] = {"perplexity": math.exp(torch.nn.functional.cross_entropy(logits, target).item()),
                     "top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                     "mean_abs_logit_error": (logits - ref).abs().mean().item()}
    log(json.dumps(out, indent=1))
    return out


def _native() -> bool:
    from batchjob.kernels import cpu_identity

    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= cpu_identity()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = measure()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
