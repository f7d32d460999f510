"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm), SmolLM2. Pre-norm
layers: RMSNorm before attention and before the SiLU-gated MLP."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.models import hf_layout as hf
from batchjob.models.config import ModelConfig
from batchjob.models.family import BuildSpec, Family, ModelParts
from batchjob.models.gguf_fields import gguf_fields, gguf_value
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import DecoderLayer


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    sliding = cfg.get("sliding_window") if arch in ("mistral", "qwen2", "qwen3") else None
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(**common_fields(cfg, arch, source), attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
                       qk_norm=arch == "qwen3", sliding_window=sliding)


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig | None:
    """`meta`: GGUF metadata as Python values; `tensor_names`: the file's tensor names (GGUF spelling). None for
    a `llama` file with experts: llama.cpp files Mixtral so, and moe.py reads it."""
    if arch == "llama" and gguf_value(meta, source, "expert_count", 0):
        return None
    return ModelConfig(**gguf_fields(meta, tensor_names, arch, source), qk_norm=arch == "qwen3")


# llama.cpp's tensor names (gguf.constants TENSOR_NAMES) -> ours; {bid}: the layer.
GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
    "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}


_QK = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")


def gguf_tensor(c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """llama.cpp's converter permutes the Q/K rows (weights and biases) of `llama` files (Llama, Mistral,
    Mixtral) for its interleaved rotary; Qwen files keep HF's order."""
    if c.architecture in ("llama", "mixtral") and name.endswith(_QK):
        return unpermute_rotary(t, c.num_heads if ".q_proj." in name else c.num_kv_heads)
    return t


def unpermute_rotary(w: np.ndarray | torch.Tensor, heads: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (HF's half-split rotary -> interleaved).

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...); HF wants both halves
    contiguous. Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # a contiguous copy


def build(c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
    layers = [DecoderLayer(hf.attention(c, w, i, spec.matmuls), hf.mlp(c, w, i, spec.matmuls), **hf.norms(w, i))
              for i in range(c.num_layers)]
    rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, spec.dtype)
    return ModelParts(layers, w[hf.EMBED], w[hf.FINAL_NORM], hf.lm_head(c, w), [rope])


FAMILY = Family(
    name="Llama (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)",
    hf_architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3"},
    model_types={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_architectures={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},  # llama.cpp files Mistral as llama
    parse_hf=parse_hf, parse_gguf=parse_gguf, weight_shapes=hf.weight_shapes, build=build,
    gguf_names=lambda c: GGUF_NAMES, gguf_tensor=gguf_tensor)
