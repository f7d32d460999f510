"""Phi-3 and Phi-4-mini: the Llama layout with Q/K/V and gate/up already fused in the checkpoint (qkv_proj,
gate_up_proj) and partial rotary where the config says so (partial_rotary_factor)."""
from __future__ import annotations

import torch

from batchjob.kernels import Linear, RotaryEmbedding
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.family import Family, ModelParts
from batchjob.models.families import llama
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import MLP, Attention, DecoderLayer


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UnsupportedModelError(f"{source}: Phi-3 rope scaling {scaling.get('rope_type', scaling.get('type'))!r} "
                                    "(longrope: long and short factors) is not supported yet; supported: none")
    fields = common_fields({**cfg, "rope_scaling": None, "rope_parameters": {k: v for k, v in params.items()
                                                                             if k == "rope_theta"}}, arch, source)
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    return ModelConfig(**fields, partial_rotary_factor=factor, sliding_window=cfg.get("sliding_window"))


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = llama.outer_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, c.hidden_size), p + "self_attn.o_proj.weight": (c.hidden_size, q),
                   p + "mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
                   p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                   p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,)}
    return shapes


def build(c: ModelConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> ModelParts:
    rotary_dim = int(c.head_dim * c.partial_rotary_factor)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn = Attention(Linear(w[p + "self_attn.qkv_proj.weight"]), Linear(w[p + "self_attn.o_proj.weight"]), c.num_heads,
                         c.num_kv_heads, c.head_dim, c.head_dim ** -0.5, window=c.sliding_window, rotary_dim=rotary_dim)
        mlp = MLP(Linear(w[p + "mlp.gate_up_proj.weight"]), Linear(w[p + "mlp.down_proj.weight"]), c.hidden_act)
        layers.append(DecoderLayer(attn, mlp, attn_norm=w[p + "input_layernorm.weight"],
                                   mlp_norm=w[p + "post_attention_layernorm.weight"]))
    rope = RotaryEmbedding(rotary_dim, c.max_position_embeddings, c.rope_theta, None, dtype)
    return ModelParts(layers, w["model.embed_tokens.weight"], w["model.norm.weight"], llama.lm_head(c, w), [rope])


FAMILY = Family(name="Phi-3, Phi-4-mini", hf_architectures={"Phi3ForCausalLM": "phi3"}, model_types={"phi3": "phi3"},
                parse_hf=parse_hf, weight_shapes=weight_shapes, build=build)
