"""The Triton kernels against their torch references under the interpreter (TRITON_INTERPRET=1): the
cases live in tests/kernels/triton_cases.py and run in a process of their own, because the flag must be set
before anything imports triton. On a GPU, `python -m tests.kernels.triton_cases --device cuda` runs the same cases on CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.background import BackgroundRun, starts_early

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


TRITON_CASES = BackgroundRun([sys.executable, "-m", "tests.kernels.triton_cases", "--device", "cpu"],
                             {"TRITON_INTERPRET": "1"})


@starts_early(TRITON_CASES)  # one Python thread for minutes: it runs beside the rest of the suite
def test_triton_kernels_match_their_references_under_the_interpreter():
    out = TRITON_CASES.result()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "all passed" in out.stdout


def _run(args: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchjob.cli.main", "run", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)


def test_a_job_on_the_triton_kernels_gives_the_torch_kernels_and_transformers_greedy_text(tmp_path, tiny_model_dir):
    """The whole forward on Triton kernels (CPU, interpreter, fp32): same greedy text as the torch kernels
    and as transformers' generate."""
    import json

    import pyarrow as pa
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = tiny_model_dir("llama")
    prompts = [[5, 17, 33, 80, 2 + i, 9] * (1 + 3 * i) for i in range(3)]  # 6, 24 and 42 tokens
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["--model", model, "--input", src, "--max-tokens", 5, "--ignore-eos", "--dtype", "float32", "--device", "cpu",
              "--no-progress", "--max-num-batched-tokens", 32]  # prompts in chunks: decodes, prefills and extends
    texts = {}
    for kernels in ("triton", "torch"):
        env = {**os.environ, "TRITON_INTERPRET": "1"} if kernels == "triton" else dict(os.environ)
        out = _run([*common, "--kernels", kernels, "--output", tmp_path / kernels], env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"{kernels} kernels" in out.stdout
        rows = []
        for part in sorted((tmp_path / kernels).glob("part-*.arrow")):
            rows += pa.ipc.open_file(part).read_all().to_pylist()
        texts[kernels] = {r["row_index"]: r["generated_text"] for r in rows}
    assert texts["triton"] == texts["torch"] and len(texts["torch"]) == 3
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):].tolist()
        assert texts["triton"][i] == tok.decode(ids, skip_special_tokens=True), i
