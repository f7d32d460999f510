"""`make bench`'s MoE row: a small random Qwen3-MoE (8 experts, top 2) and its dense equivalent of the same
active parameters (a Qwen3 whose MLP is as wide as two experts), both with SmolLM2's vocabulary, run by
batchjob (bf16, default kernels) and HF transformers (`generate`, static batches of 16, fp32 as HF runs on a
CPU) on the same token-id rows. Each run is its own process, which also reports its peak RSS while loading
against the size of the weights file.

    python -m batchjob.bench.moe [--rows 64] [--prompt 64] [--max-tokens 64] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from batchjob.bench.paths import CACHE

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 512, 6, 8, 4, 64
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 512


def build(kind: str, folder: Path) -> Path:
    """The model as an HF folder (config.json, safetensors written by transformers, SmolLM2's tokenizer)."""
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers as tf

    from batchjob.models.loader import load_model

    tok = load_model("smollm2", dtype=torch.float32).tokenizer
    common = dict(vocab_size=49152, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=2048, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "moe":
        cfg, cls = tf.Qwen3MoeConfig(**common, intermediate_size=TOP_K * EXPERT_WIDTH, num_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True), tf.Qwen3MoeForCausalLM
    else:  # the same active parameters per token: one MLP as wide as the two experts a token uses
        cfg, cls = tf.Qwen3Config(**common, intermediate_size=TOP_K * EXPERT_WIDTH), tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.eos_token, "bos_token": tok.bos_token}))
    return folder


def rows(n: int, prompt: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(prompt)] for _ in range(n)]


def run_one(system: str, folder: Path, n: int, prompt: int, max_tokens: int) -> dict:
    """In this process: load, then generate; peak RSS (MiB) after loading, generation tokens/s."""
    ps = rows(n, prompt)
    if system == "batchjob":
        from batchjob.engine.params import SamplingParams
        from batchjob.job.options.config import load_job
        from batchjob.job.engine_setup import build_engine
        from batchjob.job.options.resolved import ResolvedJob
        from batchjob.models.loader import load_model
    else:
        import transformers
    base = _rss()  # the interpreter and the imports, before any weight is read
    t0 = time.perf_counter()
    if system == "batchjob":
        loaded = load_model(str(folder), dtype=torch.bfloat16)
        cfg = load_job(None, {"model": str(folder), "input": "-", "output": "-", "max_num_seqs": 64, "device": "cpu",
                              "dtype": "bfloat16"})
        engine = build_engine(ResolvedJob.of(cfg), loaded)
        load_s, rss = time.perf_counter() - t0, _rss()
        engine.generate(ps[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
        t1 = time.perf_counter()
        engine.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        gen_s = time.perf_counter() - t1
        dtype = "bfloat16"
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        load_s, rss = time.perf_counter() - t0, _rss()
        t1 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, n, 16):  # static batches of 16 (all prompts the same length: no padding)
                model.generate(torch.tensor(ps[i:i + 16]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
        gen_s = time.perf_counter() - t1
        dtype = "float32"
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    return {"system": system, "model": folder.name, "dtype": dtype, "tokens_s": round(n * max_tokens / gen_s, 1),
            "gen_s": round(gen_s, 2), "load_s": round(load_s, 2), "peak_rss_mib_after_load": round(rss), "rss_mib_before_load": round(base),
            "weights_file_mib": round(size)}


def _rss() -> float:
    """This process's peak RSS in MiB: VmHWM, the high-water mark of its own address space (ru_maxrss keeps
    the parent's RSS at fork across exec, so a child of a big parent reads the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(n: int = 64, prompt: int = 64, max_tokens: int = 64, cache: Path = CACHE, log=print) -> list[dict]:
    out = []
    for kind in ("moe", "dense"):
        folder = build(kind, cache / f"bench-qwen3-{kind}")
        for system in ("batchjob", "hf"):
            proc = subprocess.run([sys.executable, "-m", "batchjob.bench.moe", "--one", system, str(folder), "--rows", str(n),
                                   "--prompt", str(prompt), "--max-tokens", str(max_tokens)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{system} on {folder.name}: {proc.stderr.strip().splitlines()[-1:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["kind"] = kind
            out.append(row)
            log(text([row]))
    return out


def text(rows: list[dict]) -> str:
    return "\n".join(f"  {r['kind']:5} {r['system']:8} {r['dtype']:8} {r['tokens_s']:8.1f} tok/s  load {r['load_s']:5.2f}s  "
                     f"load peak RSS +{r['peak_rss_mib_after_load'] - r['rss_mib_before_load']} MiB (weights file {r['weights_file_mib']} MiB)"
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one", nargs=2, metavar=("SYSTEM", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], Path(args.one[1]), args.rows, args.prompt, args.max_tokens)))
        return 0
    out = measure(args.rows, args.prompt, args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
