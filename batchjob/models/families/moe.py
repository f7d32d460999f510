"""Mixture-of-experts decoders on the Llama layout: Mixtral (block_sparse_moe, experts w1/w3/w2, top-k
renormalised), Qwen2-MoE (a shared expert with a sigmoid gate; q/k/v biases) and Qwen3-MoE (per-head q/k norm;
norm_topk_prob; dense layers by decoder_sparse_step / mlp_only_layers)."""
from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from batchjob.kernels import Linear, RotaryEmbedding
from batchjob.kernels.quantization import MatmulFormat, linear
from batchjob.models.config import ModelConfig
from batchjob.models import hf_layout as hf
from batchjob.models.family import BuildSpec, Family, ModelParts
from batchjob.models.families import llama
from batchjob.models.gguf_fields import gguf_fields, gguf_value
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import MLP, DecoderLayer, MoE, fused


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    fields = common_fields(cfg, arch, source)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes num_local_experts for all
    sliding = cfg.get("sliding_window") if arch == "mixtral" or cfg.get("use_sliding_window") else None
    step, dense = cfg.get("decoder_sparse_step") or 1, list(cfg.get("mlp_only_layers") or [])
    return ModelConfig(
        **fields, attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", False))),
        qk_norm=arch == "qwen3_moe", sliding_window=sliding or None,
        extra={"num_experts": int(experts), "top_k": int(cfg["num_experts_per_tok"]),
               "renormalize": arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
               "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or fields["intermediate_size"]),
               "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
               "moe_layers": [i for i in range(fields["num_layers"]) if i not in dense and (i + 1) % step == 0]})


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig:
    """As llama.cpp runs these files (src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp): every layer sparse,
    softmax routing, the top k renormalised for Mixtral and Qwen3-MoE but not for Qwen2-MoE (fixed there, not
    read from the file), Qwen2-MoE's shared expert behind a sigmoid gate. Mixtral is a `llama` file with
    experts (llama.parse_gguf leaves it to us)."""
    key = functools.partial(gguf_value, meta, source)
    fields = gguf_fields(meta, tensor_names, arch, source)
    shared = int(key("expert_shared_feed_forward_length", 0)) if arch == "qwen2_moe" else 0
    return ModelConfig(
        **fields, qk_norm=arch == "qwen3_moe",
        extra={"num_experts": int(key("expert_count")), "top_k": int(key("expert_used_count")),
               "renormalize": arch != "qwen2_moe",
               "moe_intermediate_size": int(key("expert_feed_forward_length", fields["intermediate_size"])),
               "shared_expert_intermediate_size": shared,
               "moe_layers": list(range(fields["num_layers"]))})


# llama.cpp's tensor names -> ours: llama's attention and norms; the router, and the experts stacked into one 3-D
# tensor each ({xid}: the expert), instead of the dense MLP
QWEN_GGUF_NAMES = {
    **{g: ours for g, ours in llama.GGUF_NAMES.items() if ".ffn_" not in g or g.endswith("ffn_norm")},
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.gate",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.mlp.experts.{xid}.gate_proj",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.mlp.experts.{xid}.up_proj",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.mlp.experts.{xid}.down_proj",
    "blk.{bid}.ffn_gate_inp_shexp": "model.layers.{bid}.mlp.shared_expert_gate",
    "blk.{bid}.ffn_gate_shexp": "model.layers.{bid}.mlp.shared_expert.gate_proj",
    "blk.{bid}.ffn_up_shexp": "model.layers.{bid}.mlp.shared_expert.up_proj",
    "blk.{bid}.ffn_down_shexp": "model.layers.{bid}.mlp.shared_expert.down_proj",
}
MIXTRAL_GGUF_NAMES = {
    **{g: ours for g, ours in llama.GGUF_NAMES.items() if ".ffn_" not in g or g.endswith("ffn_norm")},
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.block_sparse_moe.gate",
    "blk.{bid}.ffn_gate_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w1",
    "blk.{bid}.ffn_up_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w3",
    "blk.{bid}.ffn_down_exps": "model.layers.{bid}.block_sparse_moe.experts.{xid}.w2",
}


def gguf_tensor(c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Mixtral's Q/K rows as llama's; the shared expert's gate is [1, hidden] whether or not the file kept the 1."""
    if name.endswith("shared_expert_gate.weight"):
        return t.reshape(1, -1)
    return llama.gguf_tensor(c, name, t)


def _expert_names(c: ModelConfig, i: int, j: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of expert j of layer i."""
    if c.architecture == "mixtral":
        p = f"model.layers.{i}.block_sparse_moe.experts.{j}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{i}.mlp.experts.{j}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _router_name(c: ModelConfig, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if c.architecture == 'mixtral' else 'mlp'}.gate.weight"


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    x, h = c.extra, c.hidden_size
    shapes = hf.weight_shapes(c)
    for i in x["moe_layers"]:
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[p + name + ".weight"]
        shapes[_router_name(c, i)] = (x["num_experts"], h)
        for j in range(x["num_experts"]):
            gate, up, down = _expert_names(c, i, j)
            shapes |= {gate: (x["moe_intermediate_size"], h), up: (x["moe_intermediate_size"], h),
                       down: (h, x["moe_intermediate_size"])}
        if x["shared_expert_intermediate_size"]:
            s = x["shared_expert_intermediate_size"]
            shapes |= {p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                       p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)}
    return shapes


def _moe(c: ModelConfig, w: dict[str, torch.Tensor], i: int, matmuls: MatmulFormat) -> MoE:
    x = c.extra
    experts = []
    for j in range(x["num_experts"]):
        gate, up, down = _expert_names(c, i, j)
        experts.append(MLP(linear(matmuls, fused(w, gate, up)), linear(matmuls, w.pop(down)), c.hidden_act))
    shared = gate = None
    if x["shared_expert_intermediate_size"]:
        shared = hf.mlp(c, w, i, matmuls, prefix=hf.MLP_ + "shared_expert.")
        gate = Linear(w.pop(f"model.layers.{i}.mlp.shared_expert_gate.weight"))
    return MoE(Linear(w.pop(_router_name(c, i))), experts, x["top_k"], x["renormalize"], shared, gate)


def build(c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
    moe_layers = set(c.extra["moe_layers"])

    def mlp(i: int) -> MoE | MLP:
        return _moe(c, w, i, spec.matmuls) if i in moe_layers else hf.mlp(c, w, i, spec.matmuls)

    layers = [DecoderLayer(hf.attention(c, w, i, spec.matmuls), mlp(i),
                           attn_norm=w.pop(f"model.layers.{i}.input_layernorm.weight"),
                           mlp_norm=w.pop(f"model.layers.{i}.post_attention_layernorm.weight")) for i in range(c.num_layers)]
    rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, spec.dtype)
    return ModelParts(layers, w[hf.EMBED], w[hf.FINAL_NORM], hf.lm_head(c, w), [rope])


FAMILY = Family(
    name="Mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE",
    hf_architectures={"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"},
    model_types={"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"},
    parse_hf=parse_hf, weight_shapes=weight_shapes, build=build,
    gguf_architectures={"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"},  # llama: with experts
    parse_gguf=parse_gguf, gguf_names=lambda c: MIXTRAL_GGUF_NAMES if c.architecture == "mixtral" else QWEN_GGUF_NAMES,
    gguf_tensor=gguf_tensor)
