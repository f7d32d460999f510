"""OLMo 2: RMSNorm after attention and after the MLP (on each block's output, before the residual add; no
norm before them), and q/k RMSNorm over the whole projection rather than per head."""
from __future__ import annotations

from collections.abc import Collection

import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models import hf_layout as hf
from batchjob.models.family import BuildSpec, Family, ModelParts
from batchjob.models.families import llama
from batchjob.models.gguf_fields import gguf_fields, gguf_value
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import DecoderLayer


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    return ModelConfig(**common_fields(cfg, arch, source), qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False)))


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig:
    window = gguf_value(meta, source, "attention.sliding_window", 0)
    if window:  # llama.cpp files OLMo 3 as olmo2 with sliding layers
        raise UnsupportedModelError(f"{source}: an olmo2 GGUF with a sliding window ({window}; OLMo 3) is not "
                                    "supported; supported: OLMo 2 (no sliding window)")
    return ModelConfig(**gguf_fields(meta, tensor_names, arch, source), qk_norm=True)


# llama.cpp's tensor names -> ours: llama's minus the pre-norms, plus the norms after each block
GGUF_NAMES = {
    **{g: ours for g, ours in llama.GGUF_NAMES.items() if g not in ("blk.{bid}.attn_norm", "blk.{bid}.ffn_norm")},
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {n: s for n, s in hf.weight_shapes(c).items() if "input_layernorm" not in n and "_norm." not in n}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,),
                   p + "post_feedforward_layernorm.weight": (c.hidden_size,)}
    return shapes


def build(c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
    layers = [DecoderLayer(hf.attention(c, w, i, spec.matmuls, qk_norm_per_head=False), hf.mlp(c, w, i, spec.matmuls),
                           post_attn_norm=w.pop(f"model.layers.{i}.post_attention_layernorm.weight"),
                           post_mlp_norm=w.pop(f"model.layers.{i}.post_feedforward_layernorm.weight"))
              for i in range(c.num_layers)]
    rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, spec.dtype)
    return ModelParts(layers, w[hf.EMBED], w[hf.FINAL_NORM], hf.lm_head(c, w), [rope])


FAMILY = Family(name="OLMo 2", hf_architectures={"Olmo2ForCausalLM": "olmo2"}, model_types={"olmo2": "olmo2"},
                parse_hf=parse_hf, weight_shapes=weight_shapes, build=build,
                gguf_architectures={"olmo2": "olmo2"}, parse_gguf=parse_gguf, gguf_names=lambda c: GGUF_NAMES)
