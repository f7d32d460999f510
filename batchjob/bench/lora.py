"""`make bench`'s LoRA row (issue 37): W1's 64 rows on SmolLM2 (its HF folder, bench/models.py), spread round-robin
over 8 random rank-16 adapters (PEFT folders written here; targets q_proj and v_proj, PEFT's default for Llama, or
every projection with --all-linear), as one `batchjob run`; against the same rows on the base model (one job), and
against 8 separate jobs of 8 rows each on the base model: what 8 merged copies cost (a merged copy has the base
model's shapes, so it runs at its speed; the merging itself is not counted). Whole processes, one after another.

    python -m batchjob.bench.lora [--all-linear] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchjob.bench import models, report
from batchjob.bench.paths import CACHE
from batchjob.bench.workloads import w1

ADAPTERS, RANK = 8, 16


def make_adapters(model: Path, folder: Path, targets: list[str]) -> list[Path]:
    cfg = json.loads((model / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    paths = []
    for k in range(ADAPTERS):
        path = folder / f"adapter{k}-{'-'.join(targets)}"
        if not (path / "adapter_model.safetensors").is_file():
            path.mkdir(parents=True, exist_ok=True)
            g = torch.Generator().manual_seed(k)
            w = {}
            for i in range(layers):
                for t in targets:
                    fan_in, fan_out = shapes[t]
                    block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                    key = f"base_model.model.model.layers.{i}.{block}.{t}"
                    w[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) * 0.02
                    w[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.02
            save_file(w, str(path / "adapter_model.safetensors"))
            (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 32,
                                                                   "target_modules": targets, "bias": "none"}))
        paths.append(path)
    return paths


def run(model: Path, rows: list[dict], out: Path, extra: list[str]) -> float:
    src = out.with_suffix(".jsonl")
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "batchjob", "run", "--model", str(model), "--input", str(src), "--output", str(out),
           "--ignore-eos", "--no-progress", "--restart", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"batchjob run failed: {proc.stderr[-1500:]}")
    return time.perf_counter() - t0


def text(r: dict) -> str:
    return (f"  LoRA: W1 ({r['rows']} rows) over {r['adapters']} rank-{r['rank']} adapters on {', '.join(r['targets'])}: "
            f"{r['lora_s']:.1f} s whole process; the base model {r['base_s']:.1f} s ({r['lora_s'] / r['base_s']:.2f}x, "
            f"target <= 1.3x); 8 separate jobs on the base model, as merged copies run, {r['separate_jobs_s']:.1f} s "
            f"({r['separate_jobs_s'] / r['lora_s']:.2f}x ours)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all-linear", action="store_true", help="adapters on every projection, not q_proj and v_proj")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model = Path(models.prepare("smollm2", CACHE).path)
    targets = list(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") if args.all_linear
                   else ("q_proj", "v_proj"))
    work = CACHE / "lora"
    work.mkdir(parents=True, exist_ok=True)
    paths = make_adapters(model, work, targets)
    rows = [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in w1().rows]
    flag = ["--lora", ",".join(f"a{k}={p}" for k, p in enumerate(paths))]
    lora_s = run(model, [{**r, "lora": f"a{i % ADAPTERS}"} for i, r in enumerate(rows)], work / "with-lora", flag)
    base_s = run(model, rows, work / "base", [])
    separate_s = sum(run(model, rows[k::ADAPTERS], work / f"merged-{k}", []) for k in range(ADAPTERS))
    result = {"rows": len(rows), "adapters": ADAPTERS, "rank": RANK, "targets": targets, "lora_s": lora_s,
              "base_s": base_s, "separate_jobs_s": separate_s}
    print(text(result), file=sys.stderr)
    if args.json:
        report.write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
