"""`--quantization int4`: an HF float checkpoint's matmul weights quantized at load into symmetric int4 groups of 32
(kernels/linear_quant.py quantize_int4: Q4_0's rule with an fp32 scale) and computed by the CPU kernels of GGUF blocks
(the same packing and kernel): its greedy text equals a float model of the same int4 values wherever the reference's
logit margin allows, alone = batched, and a job runs it."""
from __future__ import annotations

import pytest
import torch

from batchjob.kernels.linear_int8 import Int8Linear
from batchjob.kernels.linear_quant import BlockQuantLinear, Int4Weight, quantize_int4
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.kernels.test_linear_quant import pytestmark as needs_compiler  # noqa: F401 - the same skip
from tests.models.test_gguf_blocks import assert_equal_where_the_margin_allows, greedy, prompts_for

pytestmark = needs_compiler


def test_quantize_int4_is_q4_0s_rule_with_an_fp32_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    q = quantize_int4(w)
    assert q.u.dtype == torch.uint8 and int(q.u.max()) <= 15 and q.scales.shape == (8, 2)
    values = q.dequantized(torch.float32)
    peak = w.reshape(8, 2, 32).abs().argmax(-1)  # each group's largest magnitude lands exactly on -8 d
    for r in range(8):
        for j in range(2):
            k = 32 * j + int(peak[r, j])
            assert values[r, k] == w[r, k] and q.u[r, k] == 0
    assert (values - w).abs().max() <= q.scales.abs().max() * 0.5 + 1e-7  # within half a step
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(2, 40))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int4_gives_the_text_of_its_values_where_the_margin_allows(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    loaded = load_model(str(folder), dtype=torch.float32)
    ours = build_model(loaded.config, dict(loaded.weights), torch.float32, quantization="int4", quantize_lm_head=False)
    assert isinstance(ours.layers[0].attn.qkv, BlockQuantLinear) and ours.quantization == "int4"
    assert set(ours.layers[0].mlp.down.formats) == {"int4 g32"}
    values = {n: (quantize_int4(t).dequantized(torch.float32) if t.dim() == 2 and "embed" not in n and "lm_head" not in n
                  else t) for n, t in loaded.weights.items()}
    ref = build_model(loaded.config, values, torch.float32)
    ps = prompts_for(loaded.config.vocab_size)
    mine = greedy(ours, ps)
    assert_equal_where_the_margin_allows(mine, ref, ps, greedy(ref, ps))
    assert [greedy(ours, [p])[0] for p in ps[:2]] == mine[:2]


def test_int4_weights_take_about_a_quarter_of_bf16s(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16)
    bf16 = build_model(loaded.config, dict(loaded.weights), torch.bfloat16).weight_memory()
    int4 = build_model(loaded.config, dict(loaded.weights), torch.bfloat16, quantization="int4")
    mem = int4.weight_memory()
    assert isinstance(int4.lm_head, Int8Linear)  # the head int8, as under --quantization int8
    body = mem["int4 g32"]
    layers = sum(t.numel() for n, t in loaded.weights.items() if ".layers." in n and t.dim() == 2)
    assert body == pytest.approx(layers * 5 / 8, rel=0.05)  # 4 bits + an fp32 scale per 32
    assert sum(mem.values()) < sum(bf16.values())


def test_an_int4_job_runs_and_says_so(tiny_model_dir, tmp_path):
    import batchjob

    out = batchjob.generate(["hello there", "one two"], model=str(tiny_model_dir("llama")), max_tokens=6,
                            quantization="int4")
    assert all(r.completion_tokens == 6 or r.finish_reason == "stop" for r in out)


def test_a_checkpoints_int4_weight_with_groups_under_32_is_dequantized(tiny_model_dir):
    from batchjob.kernels.quantization import int4_linear

    w = quantize_int4(torch.randn(64, 64), group=16)
    assert isinstance(w, Int4Weight) and not w.packable()
    lin = int4_linear(w)
    x = torch.randn(3, 64)
    assert torch.allclose(lin(x), x @ w.dequantized(torch.float32).T, atol=1e-5)
