"""The encoder cache's measure (issue 48): a VQA-style job, N rows asking different questions about K distinct images
(N / K questions each), on the random SmolVLM-256M-shaped model of `bench/images.py`, run twice by `batchjob run`:
with the encoder cache off (`--encoder-cache-tokens 0`: every row encodes its image, as before the cache) and on
(the default). Reports each run's job seconds, the image encoder's seconds, placeholder runs encoded and read from
the cache, and whether the two runs wrote the same texts.

    python -m batchjob.bench.vqa [--rows 64] [--images 8] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from batchjob.bench.images import CACHE, MAX_TOKENS, photo, prepare_model

# the processor scales a 512-px picture up to 2048 px (longest_edge): 4 x 4 tiles and the global image, 17 placeholder
# runs of 64 a picture
SIZE = (512, 512)
QUESTIONS = ("What is in this picture?", "Which colours dominate?", "Describe the texture.", "Is it day or night?",
             "What shapes do you see?", "Where could this be?", "What is in the top left corner?",
             "Give the picture a title.")


def prepare_input(rows: int, images: int, cache: Path) -> Path:
    """`images` distinct pictures and `rows` rows asking about them in turn, each row its own question."""
    folder = cache / "vqa-rows"
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    for k in range(images):
        path = folder / "pics" / f"{k}.jpg"
        if not path.is_file():
            path.write_bytes(photo(1000 + k, SIZE, scale=48.0))
    lines = [json.dumps({"image": f"pics/{i % images}.jpg",
                         "prompt": f"{QUESTIONS[(i // images) % len(QUESTIONS)]} (question {i})"}) for i in range(rows)]
    src = folder / f"in-{rows}-{images}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def run(model: Path, src: Path, out: Path, cache_tokens: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "batchjob", "run", "--model", str(model), "--input", str(src), "--output", str(out),
           "--image-column", "image", "--chat-template", str(model / "chat_template.jinja"), "--max-tokens",
           str(MAX_TOKENS), "--ignore-eos", "--no-progress", "--encoder-cache-tokens", str(cache_tokens)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"batchjob run failed: {proc.stderr[-1500:]}")
    summary = json.loads((out / "stats.jsonl").read_text().splitlines()[-1])
    from batchjob.io.parts import read_results

    texts = read_results(out).sort_by("row_index").column("generated_text").to_pylist()
    return {"encoder_cache_tokens": cache_tokens, "process_s": time.perf_counter() - t0, "job_s": summary["job_s"],
            "model_s": summary["model_s"], "encoder_s": summary["encoder_s"], "encoded": summary["images_encoded"],
            "cached": summary["images_cached"], "texts": texts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--cache-dir", default=str(CACHE))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir)
    model, src = prepare_model(cache), prepare_input(args.rows, args.images, cache)
    off = run(model, src, cache / "vqa-rows" / "out-off", 0)
    on = run(model, src, cache / "vqa-rows" / "out-on", 16384)
    same = off.pop("texts") == on.pop("texts")
    for r in (off, on):
        print(f"encoder cache {'off' if not r['encoder_cache_tokens'] else 'on '}: job {r['job_s']:.1f} s, image "
              f"encoder {r['encoder_s']:.1f} s ({r['encoded']} placeholder runs encoded, {r['cached']} from the cache), "
              f"the rest of the model {r['model_s'] - r['encoder_s']:.1f} s", file=sys.stderr)
    print(f"{args.rows} rows over {args.images} images; the same texts: {same}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": args.rows, "images": args.images, "off": off, "on": on,
                                               "same_texts": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
