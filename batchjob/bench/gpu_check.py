"""`make gpu-check`: every GPU check in one command, failing at the first error (issue 11).

1. kernels: the Triton kernel cases on CUDA (tests/triton_cases.py and tests/kernels/w4a16_cases.py, the same
   cases CI runs under the interpreter);
2. text: the quickstart job's first rows on the GPU (Triton kernels, fp32) against a CPU fp32 run
   (torch kernels): share of rows with identical greedy text;
3. attention: paged decode attention at 128 rows x 2k context (SmolLM2's and 1B-class shapes, bf16):
   GB/s of K/V read, and that as a share of the device's measured copy bandwidth (target >= 70%);
4. decode: W1-style steps (256 rows) on SmolLM2 and on a random 1B-shaped Llama: torch kernels, Triton
   eager (synchronous, then with async output), Triton with CUDA graphs, and that with `--quantization int8`
   and (compute capability >= 8.9) `fp8` weight matmuls, and with `int4` (W4A16, the Triton kernel of
   kernels/triton/w4a16.py): tokens/s, and the step time against the weights + KV bytes roofline at the measured
   bandwidth (the roofline of the bf16 weights for every variant);
5. w4a16: the W4A16 matmul (kernels/linear_w4a16.py, groups of 32 and 128) on a 1B-class model's projections at 1,
   16 and 256 rows against the bf16 matmul: ms per call, the int4 weight's GB/s, the error against its reference;
6. peer: HF transformers `generate`, static batches of 16, on the same GPU (when transformers is here).

Writes a JSON file and prints a table. `--smoke` runs tiny shapes on the CPU under TRITON_INTERPRET=1
(the code paths, not the numbers) so CI can keep this script working without a GPU."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from batchjob.bench.paths import REPORTS, ROOT
from batchjob.kernels.quantization import fp8_capable


class CheckFailed(Exception):
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeat: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeat


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device memory bandwidth as a large copy sees it: bytes read + written per second."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    s = _timed(lambda: y.copy_(x), device, 5)
    return 2 * nbytes / s


def decode_attention(device: torch.device, rows: int, ctx: int, kv_heads: int, gqa: int, head_dim: int,
                     block_size: int = 16, repeat: int = 10) -> dict:
    """Triton paged decode attention: K/V bytes read per second."""
    from batchjob.kernels import AttentionMetadata
    from batchjob.kernels import TritonKernels

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kern = TritonKernels(head_dim, gqa, dtype, block_size)
    per_row = -(-ctx // block_size)
    blocks = torch.randperm(rows * per_row, device=device).to(torch.int32).view(rows, per_row)
    shape, _ = kern.kv_cache_shapes(rows * per_row, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, device=device).to(dtype)
    vc = torch.randn(shape, device=device).to(dtype)
    q = torch.randn(rows, kv_heads * gqa, head_dim, device=device).to(dtype)
    qsl = list(range(rows + 1))
    meta = AttentionMetadata(blocks, torch.full((rows,), ctx, dtype=torch.int32, device=device),
                             torch.tensor(qsl, dtype=torch.int32, device=device),
                             torch.zeros(rows, dtype=torch.long, device=device), rows,
                             host={"query_start_loc": qsl, "seq_lens": [ctx] * rows})
    s = _timed(lambda: kern.attention(q, kc, vc, meta, head_dim ** -0.5), device, repeat)
    nbytes = 2 * rows * ctx * kv_heads * head_dim * kc.element_size()
    return {"rows": rows, "context": ctx, "kv_heads": kv_heads, "gqa": gqa, "head_dim": head_dim,
            "ms": round(s * 1e3, 3), "gb_s": round(nbytes / s / 1e9, 1)}


def random_llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, device, dtype,
                 max_positions: int = 4096):
    from batchjob.models.config import ModelConfig

    d = hidden // heads
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, max_position_embeddings=max_positions)
    w = lambda *shape: (torch.randn(*shape, device=device) * 0.02).to(dtype)  # noqa: E731
    weights = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden, device=device),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": torch.ones(hidden, device=device),
                        p + "post_attention_layernorm.weight": torch.ones(hidden, device=device),
                        p + "self_attn.q_proj.weight": w(heads * d, hidden), p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
                        p + "self_attn.v_proj.weight": w(kv_heads * d, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * d),
                        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                        p + "mlp.down_proj.weight": w(hidden, inter)})
    return cfg, weights


def decode_throughput(cfg, weights, device, dtype, kernels: str, rows: int, prompt: int, out: int, bandwidth: float,
                      cuda_graphs: bool = True, async_scheduling: bool | None = None, quantization: str = "none") -> dict:
    """tokens/s of decode steps with `rows` rows, and the step time over the weights + KV roofline. `weights` is
    kept (the model is built from a copy of the dict), so each variant builds from the same load."""
    from batchjob.engine.engine import Engine, EngineConfig
    from batchjob.engine.sample.row_keys import row_key
    from batchjob.engine.core.scheduler import SchedulerConfig
    from batchjob.engine.params import SamplingParams
    from batchjob.engine.core.sequence import Sequence
    from batchjob.models.registry import build_model

    model = build_model(cfg, dict(weights), dtype, str(device), kernels=kernels, quantization=quantization)
    sched = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=max(2048, rows))
    engine = Engine(model, [], EngineConfig(scheduler=sched, cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, kv_cache_bytes=rows * (prompt + out + 16) * 2 * cfg.num_layers
                                            * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8 + (64 << 20)))
    g = torch.Generator().manual_seed(0)
    for i in range(rows):
        ids = torch.randint(3, cfg.vocab_size, (prompt,), generator=g).tolist()
        engine.add(Sequence(i, ids, SamplingParams(max_tokens=out, ignore_eos=True), rng_key=row_key(0, i)))
    decode_s, decode_steps, decode_rows = 0.0, 0, 0
    while engine.has_work:
        t = time.perf_counter()
        engine.step()
        call_s = time.perf_counter() - t  # one step period (with async scheduling, steps overlap: not step_s)
        st = engine.last_stats
        if st is not None and st.num_decode == st.num_seqs == rows:
            decode_s += call_s
            decode_steps += 1
            decode_rows += rows
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    kv_bytes = rows * (prompt + out / 2) * kv_token  # the mean context over the decode
    step = decode_s / max(1, decode_steps)
    roofline = (weight_bytes + kv_bytes) / bandwidth
    graphs = engine.runner.decode_graphs
    return {"kernels": model.kernels.name, "quantization": quantization, "cuda_graphs": graphs is not None, "async_scheduling": engine.async_scheduling,
            "graph_replays": graphs.replays if graphs else 0,
            "graph_capture_s": round(graphs.capture_s, 2) if graphs else 0.0, "rows": rows, "decode_steps": decode_steps,
            "tokens_s": round(decode_rows / decode_s, 1) if decode_s else None,
            "step_ms": round(step * 1e3, 3), "roofline_ms": round(roofline * 1e3, 3),
            "over_roofline": round(step / roofline, 2) if roofline else None}


def w4a16_matmuls(device: torch.device, smoke: bool) -> list[dict]:
    """W4A16Linear against F.linear in the compute dtype on a 1B-class model's projections (fused QKV, fused
    gate/up, down): ms per call, the int4 weight's bytes read per second, the kernel that ran (triton once its
    start-up check passed) and its largest error against the torch reference, relative to the largest result."""
    from batchjob.kernels.linear_quant import quantize_int4
    from batchjob.kernels import W4A16Linear

    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = [(64, 128)] if smoke else [(2048 + 2 * 512, 2048), (2 * 8192, 2048), (2048, 8192)]
    results = []
    for n, k in shapes:
        w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        for group in (32, 128):
            lin = W4A16Linear(quantize_int4(w, group))
            for rows in ((1, 5) if smoke else (1, 16, 256)):
                x = torch.randn(rows, k, device=device).to(dtype)
                want = lin.reference(x).float()
                err = ((lin(x).float() - want).abs().max() / want.abs().max()).item()
                repeat = 1 if smoke else 50
                s4 = _timed(lambda: lin(x), device, repeat)
                s16 = _timed(lambda: torch.nn.functional.linear(x, w), device, repeat)
                results.append({"n": n, "k": k, "group": group, "rows": rows, "kernel": lin.kernel,
                                "err": float(f"{err:.2e}"), "int4_ms": round(s4 * 1e3, 4),
                                "dense_ms": round(s16 * 1e3, 4), "speedup": round(s16 / s4, 2),
                                "int4_gb_s": round(lin.nbytes / s4 / 1e9, 1)})
        del w
    return results


def quickstart_text(out: Path, rows: int, smoke: bool) -> dict:
    """Greedy text of the quickstart job's first rows: GPU (Triton, fp32) vs CPU (torch, fp32)."""
    from batchjob.io.parts import read_results

    runs = {"gpu": ["--device", "cuda", "--kernels", "triton"], "cpu": ["--device", "cpu", "--kernels", "torch"]}
    if smoke:
        runs["gpu"] = ["--device", "cpu", "--kernels", "triton"]  # the interpreter: the code path only
    texts = {}
    for name, flags in runs.items():
        folder = out / f"quickstart-{name}"
        cmd = [sys.executable, "-m", "batchjob", "run", str(ROOT / "jobs/quickstart.toml"), "--output", str(folder),
               "--dtype", "float32", "--limit", str(rows), "--max-tokens", "4" if smoke else "64", "--no-progress",
               "--restart", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CheckFailed(f"quickstart on {name} failed:\n{done.stderr[-2000:]}")
        table = read_results(folder).sort_by("row_index")
        texts[name] = dict(zip(table.column("row_index").to_pylist(), table.column("generated_text").to_pylist()))
    same = sum(texts["gpu"][i] == texts["cpu"].get(i) for i in texts["gpu"])
    return {"rows": len(texts["gpu"]), "identical": same, "share": round(same / max(1, len(texts["gpu"])), 3)}


def tensor_parallel_text(out: Path, smoke: bool) -> dict:
    """Greedy text of `--tensor-parallel 2` vs one process (fp32) on an HF folder whose heads split two ways (the bench's
    tiny Llama): NCCL over two GPUs, or gloo over two CPU processes under --smoke. One GPU: skipped, with the reason."""
    from batchjob.bench.models import prepare
    from batchjob.io.parts import read_results

    gpus = torch.cuda.device_count() if not smoke else 0
    if not smoke and gpus < 2:
        return {"status": f"skipped: tensor parallel needs 2 GPUs, this machine has {gpus}"}
    folder = prepare("tiny").path
    prompts = out / "tp-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (i * 7 + j) % 500}" for j in range(5 + i))}) + "\n"
                               for i in range(8)))
    device = "cpu" if smoke else "cuda"
    texts = {}
    for name, extra in (("one", []), ("tp2", ["--tensor-parallel", "2"])):
        folder_out = out / f"tp-{name}"
        cmd = [sys.executable, "-m", "batchjob", "run", "--model", folder, "--input", str(prompts), "--output",
               str(folder_out), "--dtype", "float32", "--device", device, "--max-tokens", "16", "--ignore-eos",
               "--no-progress", "--restart", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CheckFailed(f"tensor parallel check ({name}) failed:\n{done.stderr[-2000:]}")
        texts[name] = read_results(folder_out).column("generated_text").to_pylist()
    same = sum(a == b for a, b in zip(texts["one"], texts["tp2"]))
    return {"status": "ok", "backend": "gloo" if smoke else "nccl", "rows": len(texts["one"]), "identical": same}


def hf_generate(device: torch.device, rows: int, prompt: int, out: int) -> dict:
    try:
        import transformers as tf
    except ImportError:
        return {"status": "not run: transformers is not installed"}
    from batchjob.models.loader import resolve_model_path

    gguf = resolve_model_path("smollm2")
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=g).to(device)
    t0 = time.perf_counter()
    for b in range(0, rows, 16):
        model.generate(ids[b:b + 16], max_new_tokens=out, min_new_tokens=out, do_sample=False)
    _sync(device)
    return {"status": "ok", "static_batch": 16, "tokens_s": round(rows * out / (time.perf_counter() - t0), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPORTS / "gpu-check")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    if not smoke and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (use --smoke under TRITON_INTERPRET=1 to check the script)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke)", "torch": torch.__version__}
    t0 = time.time()
    try:
        if not smoke:
            done = subprocess.run([sys.executable, "-m", "tests.kernels.triton_cases", "--device", "cuda"], cwd=ROOT,
                                  capture_output=True, text=True)
            report["kernels"] = done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]
            if done.returncode:
                raise CheckFailed(f"Triton kernel cases failed on CUDA:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
            done = subprocess.run([sys.executable, "-m", "tests.kernels.w4a16_cases", "--device", "cuda"], cwd=ROOT,
                                  capture_output=True, text=True)
            report["kernels"] += done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]
            if done.returncode:
                raise CheckFailed(f"W4A16 kernel cases failed on CUDA:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        report["text"] = quickstart_text(args.out, 2 if smoke else 48, smoke)
        if report["text"]["share"] < (1.0 if smoke else 0.9):
            raise CheckFailed(f"GPU greedy text differs from the CPU fp32 run on too many rows: {report['text']}")
        report["tensor_parallel"] = tensor_parallel_text(args.out, smoke)
        tp = report["tensor_parallel"]
        if tp["status"] == "ok" and tp["identical"] < tp["rows"]:
            raise CheckFailed(f"--tensor-parallel 2 greedy text differs from one process's: {tp}")
        bw = copy_bandwidth(device, (16 << 20) if smoke else (2 << 30))
        report["copy_gb_s"] = round(bw / 1e9, 1)
        shapes = {"smollm2": (3, 3, 64), "1b": (8, 4, 64)}  # kv heads, GQA group, head_dim
        rows, ctx = (2, 64) if smoke else (128, 2048)
        report["attention"] = {name: decode_attention(device, rows, ctx, *s, repeat=1 if smoke else 20) for name, s in shapes.items()}
        for a in report["attention"].values():
            a["share_of_copy"] = round(a["gb_s"] * 1e9 / bw, 3)
        dtype = torch.float32 if smoke else torch.bfloat16
        models = {"smollm2": None, "1b": (128256, 2048, 8192, 16, 32, 8)} if not smoke else {"tiny": (512, 64, 128, 2, 4, 2)}
        report["decode"] = {}
        for name, shape in models.items():
            if shape is None:
                from batchjob.models.loader import load_model, resolve_model_path

                loaded = load_model(resolve_model_path(name), dtype=dtype)
                cfg, weights = loaded.config, loaded.weights
            else:
                cfg, weights = random_llama(*shape, device=device, dtype=dtype)
            r, p, o = (4, 8, 4) if smoke else (256, 128, 128)
            # (kernels, CUDA graphs, async output, quantization): the references; Triton eager, synchronous;
            # + async; + graphs; + int8 / fp8 / int4 weight matmuls (smoke: int8 on the CPU runs the native kernel)
            variants = [("triton", False, None, "none"), ("triton", False, None, "int8")] if smoke else [
                ("torch", False, None, "none"), ("triton", False, False, "none"), ("triton", False, True, "none"),
                ("triton", True, True, "none"), ("triton", True, True, "int8"), ("triton", True, True, "int4")]
            if not smoke and fp8_capable(device):
                variants.append(("triton", True, True, "fp8"))
            report["decode"][name] = [decode_throughput(cfg, weights, device, dtype, k, r, p, o, bw, cuda_graphs=g,
                                                        async_scheduling=a, quantization=q) for k, g, a, q in variants]
            del weights
        report["w4a16"] = w4a16_matmuls(device, smoke)
        bad = [r for r in report["w4a16"] if r["kernel"] != "triton" or not r["err"] <= 3e-2]
        if bad:
            raise CheckFailed(f"W4A16: the Triton kernel did not run, or differs from its reference: {bad[0]}")
        if not smoke:
            report["hf_generate"] = hf_generate(device, 64, 128, 128)
    except CheckFailed as e:
        report["failed"] = str(e)
        print(f"gpu-check FAILED: {e}", file=sys.stderr)
    report["seconds"] = round(time.time() - t0, 1)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table(report))
    return 1 if "failed" in report else 0


def table(report: dict) -> str:
    """The headline numbers, one line each."""
    lines = [f"{report['device']}: copy {report.get('copy_gb_s', '-')} GB/s"]
    for name, a in report.get("attention", {}).items():
        lines.append(f"attention {name:8} {a['rows']} rows x {a['context']}: {a['gb_s']} GB/s = "
                     f"{a.get('share_of_copy', 0):.0%} of copy")
    for name, runs in report.get("decode", {}).items():
        for r in runs:
            how = (f"{r['kernels']}{' +graphs' if r['cuda_graphs'] else ''}{' +async' if r['async_scheduling'] else ''}"
                   f"{'' if r['quantization'] == 'none' else ' ' + r['quantization']}")
            lines.append(f"decode {name:8} {how:22} {r['tokens_s']} tok/s, step {r['step_ms']} ms = "
                         f"{r['over_roofline']}x roofline")
    for r in report.get("w4a16", []):
        lines.append(f"w4a16 {r['n']}x{r['k']} g{r['group']} {r['rows']:>3} rows: {r['int4_ms']} ms ({r['int4_gb_s']} GB/s) "
                     f"vs dense {r['dense_ms']} ms = {r['speedup']}x, err {r['err']:.1e}")
    peer = report.get("hf_generate", {})
    if peer.get("tokens_s"):
        lines.append(f"HF generate static-16: {peer['tokens_s']} tok/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
