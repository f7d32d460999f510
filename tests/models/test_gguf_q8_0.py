"""GGUF Q8_0 under `--quantization int8`: the matrices load as their int8 codes with one fp16 scale per 32
weights (nothing dequantized at load), their values exactly what gguf's dequantize gives, and build as Int8Linear
re-quantized per output channel from those exact values (docs/guide/quantization.md has the measured error).
Without int8 nothing changes: every tensor is dequantized to the compute dtype at load, as before."""
from __future__ import annotations

import gguf
import numpy as np
import torch

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.io.manifest import Manifest
from batchjob.kernels.linear_int8 import Int8Linear
from batchjob.kernels.quantization import QuantizedWeight
from batchjob.kernels.reference.scaled_mm import quantize_weight_int8
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.job.test_resume import FAST, cli, texts, write_jsonl


def test_q8_0_matrices_load_as_their_codes_and_block_scales(tiny_gguf_path):
    path = tiny_gguf_path("llama", "Q8_0")
    codes = load_model(path, torch.float32, int8_codes=True)
    plain = load_model(path, torch.float32)
    assert all(isinstance(t, torch.Tensor) for t in plain.weights.values())
    quantized = {n: t for n, t in codes.weights.items() if isinstance(t, QuantizedWeight)}
    assert len(quantized) == 2 * 7 + 2  # every projection, the embeddings and the LM head; norms stay float
    for name, t in codes.weights.items():  # Q/K rows un-permuted alike: the same values as the plain load
        value = t.dequantized(torch.float32) if isinstance(t, QuantizedWeight) else t
        assert torch.equal(value, plain.weights[name]), name
    # the codes are the file's bytes: block = fp16 d, then 32 int8 q (down_proj: no Q/K permutation)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down.weight")
    blocks = np.asarray(t.data).reshape(-1, 34)
    w = quantized["model.layers.1.mlp.down_proj.weight"]
    assert w.codes.dtype == torch.int8 and w.group == 32
    assert np.array_equal(w.codes.numpy().reshape(-1, 32), blocks[:, 2:].view(np.int8))
    assert np.array_equal(w.scales.numpy().reshape(-1), blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1))


def test_an_int8_build_requantizes_per_channel_from_the_exact_values(tiny_gguf_path):
    """In fp32 the same model as int8 of the plain load (whose fp32 weights are those exact values); in bf16 the
    codes come from the fp32 values, not from their bf16 rounding."""
    path = tiny_gguf_path("llama", "Q8_0")
    loaded, plain = load_model(path, torch.float32, int8_codes=True), load_model(path, torch.float32)
    down = loaded.weights["model.layers.0.mlp.down_proj.weight"].dequantized(torch.float32)
    model = build_model(loaded.config, dict(loaded.weights), torch.float32, kernels="torch", quantization="int8")
    ref = build_model(plain.config, plain.weights, torch.float32, kernels="torch", quantization="int8")
    assert isinstance(model.layers[0].mlp.down, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    ids = list(range(3, 60))
    assert torch.equal(teacher_forced_logits(model, ids), teacher_forced_logits(ref, ids))
    bf16 = build_model(loaded.config, loaded.weights, torch.bfloat16, kernels="torch", quantization="int8")
    codes, scales = quantize_weight_int8(down)
    assert torch.equal(bf16.layers[0].mlp.down.weight_codes(), codes) and torch.equal(bf16.layers[0].mlp.down.scales, scales)


def test_a_q8_0_job_runs_int8(tiny_gguf_path, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(5)])
    args = ["run", "--model", tiny_gguf_path("llama", "Q8_0"), "--input", src, "--max-tokens", 5, *FAST]
    cli(*args, "--quantization", "int8", "--output", tmp_path / "int8")
    cli(*args, "--output", tmp_path / "auto")  # auto on a GGUF file: the compute dtype, as before
    assert len(texts(tmp_path / "int8")) == len(texts(tmp_path / "auto")) == 5
    assert Manifest.load(tmp_path / "int8").fingerprint["params"]["quantization"] == "int8"
    assert "quantization" not in Manifest.load(tmp_path / "auto").fingerprint["params"]
