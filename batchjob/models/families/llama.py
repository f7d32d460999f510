"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm), SmolLM2. Pre-norm
layers: RMSNorm before attention and before the SiLU-gated MLP."""
from __future__ import annotations

import functools
from collections.abc import Collection

import numpy as np
import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.kernels.quantization import linear
from batchjob.models.config import ModelConfig, UnsupportedModelError, _shortest_f32
from batchjob.models.family import Family, ModelParts
from batchjob.models.hf_config import common_fields
from batchjob.models.layers import MLP, Attention, DecoderLayer, fused


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


_REQUIRED = object()


def gguf_value(meta: dict, source: str, name: str, default=_REQUIRED):
    """The metadata value `{general.architecture}.{name}`, or `default` (none: required); a per-layer list must be
    uniform (hybrid models are not ours)."""
    gguf_arch = meta.get("general.architecture")
    value = meta.get(f"{gguf_arch}.{name}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{source}: {gguf_arch}.{name} varies per layer ({value!r})")
        value = value[0]
    if value is None:
        if default is _REQUIRED:
            raise UnsupportedModelError(f"{source}: GGUF metadata lacks {gguf_arch}.{name}")
        return default
    return value


def gguf_fields(meta: dict, tensor_names: Collection[str], arch: str, source: str, partial_rotary: bool = False) -> dict:
    """The ModelConfig fields every family reads the same way out of GGUF metadata (llama.cpp's key names, as
    its convert_hf_to_gguf.py writes them); the GGUF counterpart of hf_config.common_fields."""
    key = functools.partial(gguf_value, meta, source)
    gguf_arch = meta.get("general.architecture")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim and not partial_rotary:
        raise UnsupportedModelError(f"{source}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    scaling = meta.get(f"{gguf_arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        # llama3-style scaling is stored as a precomputed `rope_freqs` tensor we do not interpret
        raise UnsupportedModelError(
            f"{source}: GGUF rope scaling ({scaling if scaling != 'none' else 'rope_freqs tensor'}) is not "
            "supported; load the HF folder instead"
        )
    vocab = meta.get(f"{gguf_arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise UnsupportedModelError(f"{source}: GGUF metadata gives no vocab size (no {gguf_arch}.vocab_size, no tokens)")
    return dict(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_shortest_f32(key("attention.layer_norm_rms_epsilon")),
        rope_theta=_shortest_f32(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,  # llama.cpp writes `output` only when untied
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


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


def outer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights around the layers: embeddings, the final norm, an untied LM head."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = outer_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
    return shapes


def attention(c: ModelConfig, w: dict[str, torch.Tensor], i: int, **kw) -> Attention:
    """Layer i's attention from HF names (self_attn.{q,k,v,o}_proj, optional biases and q/k norms)."""
    a = f"model.layers.{i}.self_attn."
    bias = fused(w, a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if a + "q_proj.bias" in w else None
    kw.setdefault("window", c.sliding_window)
    return Attention(qkv=linear(fused(w, a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), bias),
                     o=linear(w.pop(a + "o_proj.weight")), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, scale=kw.pop("scale", c.head_dim ** -0.5),
                     q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"), **kw)


def mlp(c: ModelConfig, w: dict[str, torch.Tensor], i: int) -> MLP:
    p = f"model.layers.{i}.mlp."
    return MLP(linear(fused(w, p + "gate_proj.weight", p + "up_proj.weight")), linear(w.pop(p + "down_proj.weight")), c.hidden_act)


def lm_head(c: ModelConfig, w: dict[str, torch.Tensor]) -> torch.Tensor:
    embed = w["model.embed_tokens.weight"]
    return embed if c.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]


def build(c: ModelConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> ModelParts:
    layers = [DecoderLayer(attention(c, w, i), mlp(c, w, i), attn_norm=w.pop(f"model.layers.{i}.input_layernorm.weight"),
                           mlp_norm=w.pop(f"model.layers.{i}.post_attention_layernorm.weight")) for i in range(c.num_layers)]
    rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype)
    return ModelParts(layers, w["model.embed_tokens.weight"], w["model.norm.weight"], lm_head(c, w), [rope])


FAMILY = Family(
    name="Llama (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)",
    hf_architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3"},
    model_types={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_architectures={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},  # llama.cpp files Mistral as llama
    parse_hf=parse_hf, parse_gguf=parse_gguf, weight_shapes=weight_shapes, build=build,
    gguf_names=lambda c: GGUF_NAMES, gguf_tensor=gguf_tensor)
