"""Phi-3 and Phi-4-mini: the Llama layout with Q/K/V and gate/up already fused in the checkpoint (qkv_proj,
gate_up_proj), partial rotary where the config says so (partial_rotary_factor), and longrope's short and long
factors (which of them a job uses: models/config.py LongRope)."""
from __future__ import annotations

import math
from collections.abc import Collection

import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.kernels.quantization import linear
from batchjob.models.config import LongRope, ModelConfig, UnsupportedModelError
from batchjob.models import hf_layout as hf
from batchjob.models.family import BuildSpec, Family, ModelParts
from batchjob.models.gguf_fields import gguf_fields, gguf_value
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import MLP, Attention, DecoderLayer


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "longrope"):
        raise UnsupportedModelError(f"{source}: Phi-3 rope scaling {kind!r} is not supported; supported: longrope (or none)")
    fields = common_fields({**cfg, "rope_scaling": None, "rope_parameters": {k: v for k, v in params.items()
                                                                             if k == "rope_theta"}}, arch, source)
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    config = ModelConfig(**fields, partial_rotary_factor=factor, sliding_window=cfg.get("sliding_window"))
    if kind == "longrope":
        config.rope_scaling, config.long_rope = longrope(cfg, scaling, int(fields["head_dim"] * factor), source)
    return config


def longrope(cfg: dict, scaling: dict, rotary_dim: int, source: str) -> tuple[dict, LongRope]:
    """The longrope table parameters as transformers computes them (_compute_longrope_parameters): the
    attention factor from the ratio of the context to the pre-training one unless the config gives it."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    short, long = scaling.get("short_factor"), scaling.get("long_factor")
    if not original or short is None or long is None:
        raise UnsupportedModelError(f"{source}: longrope needs short_factor, long_factor and "
                                    "original_max_position_embeddings; the config lacks some")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != rotary_dim // 2:
            raise UnsupportedModelError(f"{source}: longrope {name} has {len(factors)} entries; the rotary dims "
                                        f"({rotary_dim}) need {rotary_dim // 2}")
    max_positions = cfg.get("max_position_embeddings", 2048)
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    table = {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long),
             "attention_factor": float(attention)}
    return table, LongRope(original=int(original))


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig:
    """As convert_hf_to_gguf writes Phi-3 (Phi3MiniModel): rope.dimension_count is the rotated part of a head
    (partial rotary), attention.sliding_window 0 for none."""
    if "rope_factors_long.weight" in tensor_names:
        raise UnsupportedModelError(f"{source}: Phi-3 longrope in GGUF (rope_factors_long/short tensors) is not "
                                    "supported yet; load the HF folder instead")
    fields = gguf_fields(meta, tensor_names, arch, source, partial_rotary=True)
    rotary = int(gguf_value(meta, source, "rope.dimension_count", fields["head_dim"]))
    window = int(gguf_value(meta, source, "attention.sliding_window", 0))
    return ModelConfig(**fields, partial_rotary_factor=rotary / fields["head_dim"], sliding_window=window or None)


# llama.cpp's tensor names -> ours: Q/K/V in one tensor, and ffn_up holding gate and up (gate first), as in HF
GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = hf.outer_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, c.hidden_size), p + "self_attn.o_proj.weight": (c.hidden_size, q),
                   p + "mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
                   p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                   p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,)}
    return shapes


def build(c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
    rotary_dim = int(c.head_dim * c.partial_rotary_factor)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn = Attention(linear(spec.matmuls, w.pop(p + "self_attn.qkv_proj.weight")), linear(spec.matmuls, w.pop(p + "self_attn.o_proj.weight")), c.num_heads,
                         c.num_kv_heads, c.head_dim, c.head_dim ** -0.5, window=c.sliding_window, rotary_dim=rotary_dim)
        mlp = MLP(linear(spec.matmuls, w.pop(p + "mlp.gate_up_proj.weight")), linear(spec.matmuls, w.pop(p + "mlp.down_proj.weight")), c.hidden_act)
        layers.append(DecoderLayer(attn, mlp, attn_norm=w.pop(p + "input_layernorm.weight"),
                                   mlp_norm=w.pop(p + "post_attention_layernorm.weight")))
    rope = RotaryEmbedding(rotary_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, spec.dtype)
    return ModelParts(layers, w[hf.EMBED], w[hf.FINAL_NORM], hf.lm_head(c, w), [rope])


FAMILY = Family(name="Phi-3, Phi-4-mini", hf_architectures={"Phi3ForCausalLM": "phi3"}, model_types={"phi3": "phi3"},
                parse_hf=parse_hf, weight_shapes=weight_shapes, build=build,
                gguf_architectures={"phi3": "phi3"}, parse_gguf=parse_gguf, gguf_names=lambda c: GGUF_NAMES)
