"""compressed-tensors checkpoints (llm-compressor's W8A8 `quantization_config`) load without re-quantizing: a
folder written here from a tiny Llama's weights, quantized per channel by quantize_weight_int8, is bitwise the
same model as `--quantization int8` of the float weights (LM head ignored, as llm-compressor leaves it);
per-tensor scales broadcast, static activation scales run dynamically, fp8 weights are dequantized at load,
a conflicting --quantization and every scheme we do not run are one clear error."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.io.manifest import Manifest
from batchjob.kernels.linear_int8 import Int8Linear, QuantizationError
from batchjob.kernels.linear import Linear
from batchjob.kernels.reference.scaled_mm import FP8_MAX, quantize_weight_int8
from batchjob.models.loader import ModelLoadError, load_model
from batchjob.models.registry import build_model
from tests.job.test_resume import FAST, cli, texts, write_jsonl

TEXT = "The quick brown fox jumps over the lazy dog. " * 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def quantization_config(weights=W8A8, activations=TOKEN, fmt="int-quantized", **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
            "ignore": ["lm_head"], **extra}


def write_folder(src: Path, dst: Path, qc: dict, tensor_scale: tuple[str, ...] = (), static: bool = False,
                 fp8: bool = False) -> Path:
    """A copy of the float folder `src` with its projections quantized as llm-compressor stores them: int8 codes
    and [out, 1] scales (a [1] scale for the projections named in `tensor_scale`), `input_scale` if static,
    float8_e4m3fn codes if fp8."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    weights = load_file(src / "model.safetensors")
    for name in [n for n in weights if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]:
        w, module = weights.pop(name), name.removesuffix(".weight")
        tensor = module.rsplit(".", 1)[-1] in tensor_scale
        if fp8:
            scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
            weights[name] = (w / scale).to(torch.float8_e4m3fn)
        elif tensor:
            scale = w.abs().amax().reshape(1) / 127
            weights[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        else:
            codes, scale = quantize_weight_int8(w)
            weights[name], scale = codes, scale[:, None]
        weights[module + ".weight_scale"] = scale.to(torch.bfloat16) if fp8 else scale
        if static:
            weights[module + ".input_scale"] = torch.tensor([0.02])
    save_file(weights, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


@pytest.fixture(scope="module")
def float_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def w8a8_dir(float_dir, tmp_path_factory) -> Path:
    return write_folder(float_dir, tmp_path_factory.mktemp("ct") / "w8a8", quantization_config())


def _logits(model) -> torch.Tensor:
    return teacher_forced_logits(model, list(range(3, 60)))


def test_a_w8a8_folder_is_the_int8_model_of_its_float_weights(w8a8_dir, float_dir):
    loaded = load_model(w8a8_dir)
    assert loaded.quantization == "int8" and "int8 weights, dynamic per-token" in loaded.quantization_scheme
    model = build_model(loaded.config, loaded.weights, torch.float32, kernels="torch", quantization="int8",
                        prequantized=True)
    f = load_model(float_dir)
    ref = build_model(f.config, f.weights, torch.float32, kernels="torch", quantization="int8", quantize_lm_head=False)
    assert isinstance(model.layers[0].attn.qkv, Int8Linear) and isinstance(model.lm_head, Linear)  # lm_head ignored
    assert torch.equal(_logits(model), _logits(ref))  # the same codes and scales: bitwise


def test_tensor_scales_broadcast_and_static_activations_run_per_token(float_dir, tmp_path, caplog):
    """k_proj and down_proj with one scale each: the fused QKV's scales are q's channels, k's one scale
    repeated, v's channels. Static input scales are not used (one log line): the same logits as dynamic."""
    static = {**TOKEN, "strategy": "tensor", "dynamic": False}
    folder = write_folder(float_dir, tmp_path / "ct", quantization_config(activations=static),
                          tensor_scale=("k_proj", "down_proj"), static=True)
    stored = load_file(folder / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(folder)
    assert sum("static per-tensor activation scales" in r.message and "per token" in r.message
               for r in caplog.records) == 1
    model = build_model(loaded.config, loaded.weights, torch.float32, kernels="torch", quantization="int8",
                        prequantized=True)
    qkv, a = model.layers[0].attn.qkv, "model.layers.0.self_attn."
    k_scale = stored[a + "k_proj.weight_scale"]
    kv = k_scale.numel() and stored[a + "k_proj.weight"].shape[0]
    assert torch.equal(qkv.scales, torch.cat([stored[a + "q_proj.weight_scale"][:, 0], k_scale.expand(kv),
                                              stored[a + "v_proj.weight_scale"][:, 0]]))
    assert torch.equal(qkv.weight_codes(), torch.cat([stored[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]))
    # each matmul is the W8A8 reference on those codes: dynamic per-token activations
    x = torch.randn(5, loaded.config.hidden_size)
    assert torch.equal(qkv(x), qkv.reference(x))


def test_fp8_weights_are_dequantized_at_load(float_dir, tmp_path, caplog):
    fp8 = {**W8A8, "type": "float"}
    folder = write_folder(float_dir, tmp_path / "fp8", quantization_config(fp8, {**TOKEN, "type": "float"}, "float-quantized"),
                          fp8=True)
    stored = load_file(folder / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(folder)
    assert any("fp8 weights are dequantized to float32" in r.message for r in caplog.records)
    assert loaded.quantization == "dequantized"
    name = "model.layers.1.mlp.down_proj.weight"
    exact = stored[name].float() * stored[name + "_scale"].float()
    assert torch.equal(loaded.weights[name], exact)
    w = load_model(float_dir).weights[name]
    assert (exact - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


def test_a_w8a8_job_runs_int8_and_a_conflicting_option_is_refused(w8a8_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(6)])
    args = ["run", "--model", w8a8_dir, "--input", src, "--max-tokens", 5, *FAST]
    cli(*args, "--output", tmp_path / "out")
    assert len(texts(tmp_path / "out")) == 6
    assert Manifest.load(tmp_path / "out").fingerprint["params"]["quantization"] == "int8"  # auto: the checkpoint's
    cli(*args, "--quantization", "int8", "--output", tmp_path / "again")
    assert texts(tmp_path / "again") == texts(tmp_path / "out")
    printed = cli(*args, "--quantization", "none", "--output", tmp_path / "none", code=1)
    assert "pre-quantized checkpoint" in printed and "--quantization none conflicts" in printed


def test_build_model_refuses_a_prequantized_model_without_int8(w8a8_dir):
    loaded = load_model(w8a8_dir)
    with pytest.raises(ValueError, match=r"pre-quantized checkpoint runs with its own quantization \(int8, fp8 or int4\), not 'none'"):
        build_model(loaded.config, loaded.weights, torch.float32, kernels="torch", quantization="none", prequantized=True)
    from batchjob.kernels.quantization import resolved_quantization
    with pytest.raises(QuantizationError, match="conflicts"):
        resolved_quantization("fp8", "int8", loaded.quantization_scheme, "m")


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("qc, message", [
    (quantization_config({**INT4, "num_bits": 2}, None, "pack-quantized"),  # W4A16: test_compressed_tensors_w4a16.py
     r"weights int2 group \(group_size 128\) \(pack-quantized\) are not supported"),
    (quantization_config(INT4, None, "naive-quantized"), r"weights int4 group \(group_size 128\) are not supported"),
    (quantization_config({**W8A8, "symmetric": False}), "weights int8 channel asymmetric are not supported"),
    (quantization_config({**W8A8, "strategy": "block", "block_structure": [128, 128]}),
     r"weights int8 block \(block \[128, 128\]\) are not supported"),
    (quantization_config(activations={**TOKEN, "symmetric": False}), "activations int8 token asymmetric"),
    (quantization_config(activations={**TOKEN, "type": "float"}), "activations float8 token"),
    (quantization_config(fmt="marlin-24"), "format 'marlin-24'"),
    (quantization_config(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparsity format 'sparse-24-bitmask'"),
    (quantization_config(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
])
def test_schemes_we_do_not_run_are_one_clear_line(float_dir, tmp_path, qc, message):
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = json.loads((float_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))  # refused before the weights
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(folder)
    assert "\n" not in str(e.value) and "supported" in str(e.value)
