"""`--quantization int8` end to end: tiny models of several families run with int8 weight matmuls give the
same tokens and logits as the same model with every projection computed by the torch W8A8 reference
(kernels/reference/scaled_mm.py), stay close to the float model, keep a row's logits independent of its
batch in bfloat16, and a job resumed after a crash writes the text of a job run straight through."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchjob.api import LLM
from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.cli.main import main
from batchjob.io.manifest import Manifest
from batchjob.io.parts import read_results
from batchjob.kernels import KernelError
from batchjob.kernels.linear_int8 import Int8Linear
from batchjob.models.config import ModelConfig
from batchjob.models.registry import build_model
from tests.builders import matmuls, replace
from tests.engine.test_determinism import PROMPTS, generate

NATIVE = shutil.which("g++") is not None  # the native kernels build on every CPU (vec.h)
FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress"]


class ReferenceMatmul:
    """An Int8Linear computed by the torch reference: int8_scaled_mm of quantize_rows_int8."""

    def __init__(self, lin: Int8Linear):
        self.lin = lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.reference(x)


def int8_matmuls(model, swap: bool = False) -> int:
    """The Int8Linears reachable from a model's layers (counted; with `swap`, replaced by ReferenceMatmul)."""
    found = matmuls(model, Int8Linear)
    if swap:
        for path, lin in found.items():
            replace(model, path, ReferenceMatmul(lin))
    return len(found)


TEXT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.mark.parametrize("arch, matmuls", [("llama", 2 * 4), ("phi3", 2 * 4), ("qwen2", 2 * 4), ("qwen3_moe", 4 + 4 * 2 + 2)])
def test_int8_model_is_the_reference_w8a8_model_and_close_to_the_float_one(tiny_model_dir, arch, matmuls):
    """Llama, Phi-3 (its checkpoint's fused qkv/gate_up), Qwen2 (q/k/v biases) and Qwen3-MoE (int8 experts,
    float router). fp32 compute, so nothing but the int8 math differs from the references."""
    folder = str(tiny_model_dir(arch))
    opts = dict(dtype="float32", kernels="torch", max_num_seqs=8, kv_cache_gb=0.02)
    prompts = ["Hello there", "One two three four", "a b c"]
    base, int8 = LLM(folder, **opts), LLM(folder, quantization="int8", **opts)
    model = int8.engine.model
    assert model.quantization == "int8"
    assert int8_matmuls(model) == matmuls + 1  # every projection, fused ones once (layers x qkv, o, gate_up, down;
    # experts), and the LM head
    ids = int8.tokenizer.encode(TEXT)
    logits = teacher_forced_logits(model, ids)
    tokens = [r.token_ids for r in int8.generate(prompts, max_tokens=12, ignore_eos=True)]
    float_logits = teacher_forced_logits(base.engine.model, ids)

    int8_matmuls(model, swap=True)
    assert torch.equal(teacher_forced_logits(model, ids), logits)  # native quantize/rescale = the reference, bitwise
    assert [r.token_ids for r in int8.generate(prompts, max_tokens=12, ignore_eos=True)] == tokens

    err = (logits - float_logits).abs().mean() / float_logits.std()
    assert 0 < err < 0.05, err  # quantized (not the float model), and close to it
    agree = (logits.argmax(-1) == float_logits.argmax(-1)).float().mean()
    assert agree > 0.9, agree


def test_fp8_on_the_cpu_and_unknown_values_are_refused(tiny_model_dir):
    with pytest.raises(KernelError, match="fp8.*GPU.*8.9.*int8"):
        LLM(str(tiny_model_dir("llama")), quantization="fp8", kv_cache_gb=0.02)
    with pytest.raises(ValueError, match="quantization: 'int2' is not one of auto, none, int8, fp8, int4"):
        LLM(str(tiny_model_dir("llama")), quantization="int2")


def _bf16_model() -> object:
    """SmolLM2's attention shape in small (head_dim 64, 3 query heads per KV head), int8 matmuls, bf16."""
    h, inter, vocab = 192, 256, 384
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=2,
                      num_heads=3, num_kv_heads=1, head_dim=64, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    w = lambda *shape, std=0.15: torch.randn(*shape, generator=g) * std  # noqa: E731
    weights = {"model.embed_tokens.weight": w(vocab, h, std=1.0), "model.norm.weight": 1 + w(h, std=0.1), "lm_head.weight": w(vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + w(h, std=0.1), p + "post_attention_layernorm.weight": 1 + w(h, std=0.1),
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(64, h), p + "self_attn.v_proj.weight": w(64, h),
            p + "self_attn.o_proj.weight": w(h, h), p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
    return build_model(cfg, weights, torch.bfloat16, kernels="native", quantization="int8")


@pytest.mark.skipif(not NATIVE, reason="the native kernels need a C++ compiler")
def test_bf16_int8_logits_do_not_depend_on_the_batch():
    """As tests/engine/test_determinism.py for bf16: each row's sampled tokens and logprobs bitwise the same
    alone, 7 at a time on one thread, and in prefill chunks of 5, as in one batch of 20."""
    model = _bf16_model()
    batched = generate(model, max_num_seqs=64)
    assert generate(model, max_num_seqs=1) == batched
    assert generate(model, max_num_seqs=7, threads=1) == batched
    assert generate(model, max_num_seqs=64, prefill_chunk=5) == batched
    assert len({tokens for tokens, _ in batched}) == len(PROMPTS)


def _cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _texts(out: Path) -> list[str]:
    return read_results(out).column("generated_text").to_pylist()


def test_an_int8_job_resumed_after_a_crash_writes_the_same_text(tmp_path, tiny_model_dir, monkeypatch):
    from batchjob.io.commit_log import CommitLog

    class Crash(BaseException):
        pass

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Row {i} says"}) + "\n" for i in range(24)))
    args = ["run", "--model", tiny_model_dir("llama"), "--input", src, "--max-tokens", 6, "--part-rows", 4,
            "--quantization", "int8", *FAST]
    _cli(*args, "--output", tmp_path / "straight")
    append, calls = CommitLog.append, [0]

    def crash_on_fourth(self, record):
        calls[0] += 1
        if calls[0] == 4:
            raise Crash
        append(self, record)

    monkeypatch.setattr(CommitLog, "append", crash_on_fourth)
    with pytest.raises(Crash):
        CliRunner().invoke(main, [*map(str, args), "--output", str(tmp_path / "out")], catch_exceptions=False)
    monkeypatch.undo()
    _cli(*args, "--output", tmp_path / "out")
    assert _texts(tmp_path / "out") == _texts(tmp_path / "straight")
    assert Manifest.load(tmp_path / "out").fingerprint["params"]["quantization"] == "int8"
    # int8 output is another job's than bf16's: resuming it without int8 is refused
    printed = _cli(*args[:-len(FAST) - 2], *FAST, "--output", tmp_path / "out", code=1)
    assert "quantization" in printed and "--restart" in printed
