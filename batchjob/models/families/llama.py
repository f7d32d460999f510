"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm), SmolLM2. Pre-norm
layers: RMSNorm before attention and before the SiLU-gated MLP."""
from __future__ import annotations

from collections.abc import Collection

import torch

from batchjob.kernels import Linear, RotaryEmbedding
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


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig:
    """`meta`: GGUF metadata as Python values; `tensor_names`: the file's tensor names (GGUF spelling)."""
    gguf_arch = meta.get("general.architecture")

    def key(name: str, default=None):
        value = meta.get(f"{gguf_arch}.{name}", default)
        if isinstance(value, list):  # per-layer values (hybrid models): only uniform ones are ours
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{source}: {gguf_arch}.{name} varies per layer ({value!r})")
            value = value[0]
        if value is None:
            raise UnsupportedModelError(f"{source}: GGUF metadata lacks {gguf_arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
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
    return ModelConfig(
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
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
    )


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
    return Attention(qkv=Linear(fused(w, a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), bias),
                     o=Linear(w[a + "o_proj.weight"]), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, scale=kw.pop("scale", c.head_dim ** -0.5),
                     q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"), **kw)


def mlp(c: ModelConfig, w: dict[str, torch.Tensor], i: int) -> MLP:
    p = f"model.layers.{i}.mlp."
    return MLP(Linear(fused(w, p + "gate_proj.weight", p + "up_proj.weight")), Linear(w[p + "down_proj.weight"]), c.hidden_act)


def lm_head(c: ModelConfig, w: dict[str, torch.Tensor]) -> torch.Tensor:
    embed = w["model.embed_tokens.weight"]
    return embed if c.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]


def build(c: ModelConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> ModelParts:
    layers = [DecoderLayer(attention(c, w, i), mlp(c, w, i), attn_norm=w[f"model.layers.{i}.input_layernorm.weight"],
                           mlp_norm=w[f"model.layers.{i}.post_attention_layernorm.weight"]) for i in range(c.num_layers)]
    rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype)
    return ModelParts(layers, w["model.embed_tokens.weight"], w["model.norm.weight"], lm_head(c, w), [rope])


FAMILY = Family(
    name="Llama (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)",
    hf_architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3"},
    model_types={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_architectures={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},  # llama.cpp files Mistral as llama
    parse_hf=parse_hf, parse_gguf=parse_gguf, weight_shapes=weight_shapes, build=build)
