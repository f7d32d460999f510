"""`--quantization fp8`'s plumbing, on the CPU: fp8 runs only on a CUDA GPU with compute capability >= 8.9, so
these tests step past that gate (`check_quantization`, and `keeps_fp8_codes` for the loader) and run the
Fp8Linears on the torch references (kernels/linear_fp8.py's backend off CUDA). A tiny model built under fp8
has every projection an Fp8Linear on the fp8 weights (fused ones as their parts), the LM head in the compute
dtype, and is close to the model built from the same fp8 weights dequantized (only the activations' fp8
rounding differs). A compressed-tensors W8A8 fp8 folder keeps its codes as stored where fp8 runs, and is
dequantized at load everywhere else, as before. Nothing here has run on a GPU."""
from __future__ import annotations

import logging

import pytest
import torch

import batchjob.api
import batchjob.job.options.resolved
import batchjob.models.registry
from batchjob.api import LLM
from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.kernels.linear import Linear
from batchjob.kernels.linear_fp8 import Fp8Linear
from batchjob.kernels.linear_int8 import QuantizationError
from batchjob.kernels.quantization import QuantizedWeight, resolved_quantization
from batchjob.kernels.reference.scaled_mm import quantize_rows_fp8, quantize_weight_fp8
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.builders import matmuls, replace
from tests.models.test_compressed_tensors import TOKEN, W8A8, quantization_config, write_folder

TEXT = "The quick brown fox jumps over the lazy dog. " * 6
PROMPTS = ["Hello there", "One two three four", "a b c"]
FP8_W8A8 = quantization_config({**W8A8, "type": "float"}, {**TOKEN, "type": "float"}, "float-quantized")


@pytest.fixture
def fp8_gate_open(monkeypatch):
    """As on a GPU with fp8: build_model's device check passes, the API's loader keeps a checkpoint's fp8 codes."""
    monkeypatch.setattr(batchjob.models.registry, "check_quantization", lambda quantization, device: None)
    monkeypatch.setattr(batchjob.job.options.resolved, "keeps_fp8_codes", lambda requested, device: requested != "none")


class Fp8Activations:
    """A compute-dtype Linear fed the fp8 rounding of its input rows (quantize_rows_fp8, dequantized): what an
    Fp8Linear on the same (dequantized) weight computes, but for the order and precision of its sums."""

    def __init__(self, lin: Linear):
        self.lin = lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
        return self.lin((q.float() * s).to(x.dtype).view(x.shape))


def _dequantized_fp8(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_weight_fp8(w)
    return q.float() * s[:, None]


def _close(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    err = ((logits - ref).abs().mean() / ref.std()).item()
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return err, agree


def _greedy(model, ids: list[int], n: int = 10) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(teacher_forced_logits(model, ids)[-1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("arch, projections", [("llama", 2 * 4), ("qwen2", 2 * 4), ("qwen3_moe", 4 + 4 * 2 + 2)])
def test_an_fp8_model_is_its_dequantized_fp8_weights_with_fp8_activations(tiny_model_dir, monkeypatch, arch,
                                                                           projections):
    """Llama, Qwen2 (q/k/v biases) and Qwen3-MoE (fp8 experts, float router); fp32 compute on the references.
    Against the model built from the fp8 weights dequantized, with every such projection fed fp8-rounded rows:
    the same greedy tokens and logits within 1e-4 (the reference sums in float64, F.linear in fp32). Against
    the dequantized model alone: close (the activations' fp8 rounding is all that differs)."""
    monkeypatch.setattr(batchjob.models.registry, "check_quantization", lambda quantization, device: None)
    loaded = load_model(tiny_model_dir(arch))
    cfg, weights = loaded.config, loaded.weights
    fp8 = build_model(cfg, dict(weights), torch.float32, kernels="torch", quantization="fp8")
    assert fp8.quantization == "fp8"
    lins = matmuls(fp8, Fp8Linear)
    assert len(lins) == projections and all(lin.codes.dtype == torch.float8_e4m3fn for lin in lins.values())
    assert isinstance(fp8.lm_head, Linear)  # the LM head stays in the compute dtype under fp8
    # the model of the fp8 weights dequantized: every projection quantized as fp8 would (the router, embeddings,
    # norms and LM head as they are)
    float_names = ("embed_tokens.weight", "lm_head.weight", ".gate.weight", "shared_expert_gate.weight")
    dequantized = {n: _dequantized_fp8(w) if w.dim() == 2 and not n.endswith(float_names) else w
                   for n, w in weights.items()}
    if arch == "llama":  # fused projections are their parts' codes and scales, stacked
        a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
        qkv, gate_up = fp8.layers[0].attn.qkv, fp8.layers[0].mlp.gate_up
        assert torch.equal(qkv.codes.float() * qkv.scales[:, None],
                           torch.cat([dequantized[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]))
        assert torch.equal(gate_up.codes.float() * gate_up.scales[:, None],
                           torch.cat([dequantized[m + p + ".weight"] for p in ("gate_proj", "up_proj")]))
    ref = build_model(cfg, dict(dequantized), torch.float32, kernels="torch", quantization="none")
    emulated = build_model(cfg, dequantized, torch.float32, kernels="torch", quantization="none")
    floats = matmuls(emulated, Linear)
    assert set(lins) <= set(floats)  # the same layout, the projections where the fp8 model has them
    for path in lins:
        replace(emulated, path, Fp8Activations(floats[path]))
    ids = loaded.tokenizer.encode(TEXT)
    logits = teacher_forced_logits(fp8, ids)
    want = teacher_forced_logits(emulated, ids)
    assert (logits - want).abs().max() < 1e-4 * want.std(), (logits - want).abs().max()
    prompt = loaded.tokenizer.encode(PROMPTS[1])
    assert _greedy(fp8, prompt) == _greedy(emulated, prompt)
    err, agree = _close(logits, teacher_forced_logits(ref, ids))
    assert 0 < err < 0.05 and agree > 0.8, (err, agree)  # fp8 activations: close, not the same


def test_an_fp8_checkpoint_keeps_its_codes_where_fp8_runs(tiny_model_dir, tmp_path, fp8_gate_open, caplog):
    """Loaded for a device with fp8 (`fp8_codes`): QuantizedWeights of the stored e4m3 codes, run as Fp8Linears on
    them as stored (no re-quantization), the LM head (ignored by the config) in the compute dtype; the static
    input scales unused (one log line: per token at run time). The API on a (pretend) fp8 GPU runs it as fp8."""
    static = quantization_config({**W8A8, "type": "float"},
                                 {**TOKEN, "type": "float", "strategy": "tensor", "dynamic": False}, "float-quantized")
    folder = write_folder(tiny_model_dir("llama"), tmp_path / "fp8", static, static=True, fp8=True)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(folder, fp8_codes=True)
    assert loaded.quantization == "fp8" and loaded.prequantized
    assert "fp8 weights, static per-tensor activations" in loaded.quantization_scheme
    assert not any("dequantized" in r.message for r in caplog.records)
    assert sum("input_scale" in r.message and "--quantization fp8" in r.message for r in caplog.records) == 1
    name = "model.layers.0.self_attn.q_proj.weight"
    qw = loaded.weights[name]
    assert isinstance(qw, QuantizedWeight) and qw.codes.dtype == torch.float8_e4m3fn
    stored = {n: loaded.weights[n] for n in loaded.weights}
    assert resolved_quantization("auto", loaded.quantization, loaded.quantization_scheme, "m") == "fp8"
    model = build_model(loaded.config, dict(loaded.weights), torch.float32, kernels="torch", quantization="fp8",
                        prequantized=True)
    qkv = model.layers[0].attn.qkv
    assert isinstance(qkv, Fp8Linear) and isinstance(model.lm_head, Linear)
    parts = [stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv.codes.view(torch.uint8), torch.cat([p.codes for p in parts]).view(torch.uint8))
    assert torch.equal(qkv.scales, torch.cat([p.scales for p in parts]))

    # the same folder loaded as on a CPU: dequantized at load, as before; close to the fp8 model
    deq = load_model(folder)
    assert deq.quantization == "dequantized"
    ref = build_model(deq.config, deq.weights, torch.float32, kernels="torch", quantization="none")
    ids = loaded.tokenizer.encode(TEXT)
    err, agree = _close(teacher_forced_logits(model, ids), teacher_forced_logits(ref, ids))
    assert 0 < err < 0.05 and agree > 0.8, (err, agree)  # the activations' fp8 rounding

    llm = LLM(str(folder), dtype="float32", kernels="torch", kv_cache_gb=0.02)  # auto: the checkpoint's fp8
    assert llm.engine.model.quantization == "fp8" and isinstance(llm.engine.model.layers[0].attn.qkv, Fp8Linear)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)]
    assert all(len(t) == 8 for t in tokens)
    with pytest.raises(QuantizationError, match=r"runs as 'fp8'; quantization='int8' conflicts with it: use "
                                                r"auto \(or fp8\)"):  # the API's words for --quantization int8
        LLM(str(folder), dtype="float32", kernels="torch", kv_cache_gb=0.02, quantization="int8")
    none = LLM(str(folder), dtype="float32", kernels="torch", kv_cache_gb=0.02, quantization="none")
    assert none.engine.model.quantization == "none"  # none: dequantized at load, on an fp8 GPU too


def test_on_the_cpu_an_fp8_checkpoint_is_dequantized_and_fp8_or_int8_are_refused(tiny_model_dir, tmp_path, caplog):
    folder = write_folder(tiny_model_dir("llama"), tmp_path / "fp8", FP8_W8A8, fp8=True)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(folder), dtype="float32", kernels="torch", kv_cache_gb=0.02)
    assert llm.engine.model.quantization == "none" and not matmuls(llm.engine.model, Fp8Linear)
    assert any("fp8 weights are dequantized to float32 at load (fp8 compute runs on a CUDA GPU with compute "
               "capability >= 8.9 only" in r.message for r in caplog.records)
    for option in ("fp8", "int8"):
        with pytest.raises(QuantizationError, match=rf"runs as 'none' here, its weights dequantized at load \(fp8 "
                                                    rf"compute needs a CUDA GPU.*quantization='{option}' conflicts"):
            LLM(str(folder), dtype="float32", kernels="torch", kv_cache_gb=0.02, quantization=option)
