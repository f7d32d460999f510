"""Gemma 2 and Gemma 3 (text): four RMSNorms per layer (around attention and around the GELU-tanh MLP), each
`x * (1 + w)` (the 1 folded into the weight at load), embeddings x sqrt(hidden), attention scaled by
query_pre_attn_scalar, sliding-window and global layers (`layer_types`), tied embeddings. Gemma 2 soft-caps
the attention logits and the final logits; Gemma 3 norms q and k per head and gives its sliding layers their
own rotary base."""
from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from batchjob.kernels import RotaryEmbedding
from batchjob.models.config import ModelConfig, UnsupportedModelError, _shortest_f32
from batchjob.models import hf_layout as hf
from batchjob.models.family import BuildSpec, Family, ModelParts
from batchjob.models.families import llama
from batchjob.models.gguf_fields import gguf_fields, gguf_value
from batchjob.models.hf_config import common_fields, rope_of
from batchjob.models.layers import DecoderLayer

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}  # Gemma's configs name its tanh GELU both ways


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    n = cfg["num_hidden_layers"]
    every = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    fields = common_fields(cfg, arch, source)
    fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))  # Gemma ties unless it says not
    local_theta = None
    if arch == "gemma3_text":
        theta, scaling = rope_of(cfg, source, key="full_attention")
        fields["rope_theta"] = theta if theta is not None else 1_000_000.0
        fields["rope_scaling"] = scaling
        local, _ = rope_of(cfg, source, key="sliding_attention")
        local_theta = cfg.get("rope_local_base_freq") or local or 10_000.0
    return ModelConfig(
        **fields, hidden_act=ACTIVATIONS[act], layer_types=list(types), sliding_window=cfg.get("sliding_window"),
        qk_norm=arch == "gemma3_text", rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"), final_logit_softcap=cfg.get("final_logit_softcapping"),
        embed_scale=cfg["hidden_size"] ** 0.5)


def parse_gguf(meta: dict, tensor_names: Collection[str], arch: str, source: str) -> ModelConfig:
    """As llama.cpp reads a Gemma file (src/models/gemma2.cpp, gemma3.cpp): its defaults where a key is absent,
    its layer pattern (sliding_window_pattern: every n-th layer global, or one flag per layer), and its
    attention scale, which it derives rather than reads (1 / sqrt(hidden / heads) for the 27B models, else
    1 / sqrt(head_dim))."""
    key = functools.partial(gguf_value, meta, source)
    gemma2 = arch == "gemma2"
    fields = gguf_fields(meta, tensor_names, arch, source)
    n, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    window = int(key("attention.sliding_window", 4096 if gemma2 else 0))  # Gemma 3 without one: all global
    pattern = meta.get(f"{meta['general.architecture']}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    if window <= 0:
        types = ["full_attention"] * n
    elif isinstance(pattern, list):  # one flag per layer: sliding or not
        types = ["sliding_attention" if s else "full_attention" for s in pattern[:n]]
    else:  # llama_hparams::set_swa_pattern: the last layer of every `pattern` is global
        types = ["sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention" for i in range(n)]
    local_theta = _shortest_f32(key("rope.freq_base_swa", 10_000.0 if not gemma2 else fields["rope_theta"]))
    if window <= 0 or (gemma2 and local_theta == fields["rope_theta"]):
        local_theta = None
    final_cap = key("final_logit_softcapping", 30.0 if gemma2 else 0.0)
    big = n == (46 if gemma2 else 62)  # llama.cpp's LLM_TYPE_27B
    return ModelConfig(
        **fields, hidden_act="gelu_tanh", layer_types=types, sliding_window=window if window > 0 else None,
        qk_norm=arch == "gemma3_text", rope_local_theta=local_theta,
        query_pre_attn_scalar=float(hidden // heads if big else fields["head_dim"]),
        attn_logit_softcap=_shortest_f32(key("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_logit_softcap=_shortest_f32(final_cap) if final_cap else None, embed_scale=hidden ** 0.5)


# llama.cpp's tensor names -> ours: llama's, with Gemma's four norms a layer
GGUF_NAMES = {
    **llama.GGUF_NAMES,
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.pre_feedforward_layernorm",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}


def gguf_tensor(c: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """llama.cpp stores every Gemma norm (q/k norms too) as 1 + w, the weight its x * w applies; ours keep
    HF's w (build adds the 1)."""
    return t - 1.0 if name.endswith("norm.weight") else t


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = hf.weight_shapes(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                   p + "post_feedforward_layernorm.weight": (c.hidden_size,)}
    return shapes


def build(c: ModelConfig, w: dict[str, torch.Tensor], spec: BuildSpec) -> ModelParts:
    norm = {n: 1.0 + t.float() for n, t in w.items() if n.endswith("norm.weight")}  # Gemma's x * (1 + w)
    w = {**w, **{n: t.to(spec.dtype) for n, t in norm.items()}}
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        sliding = c.layer_types[i] == "sliding_attention"
        attn = hf.attention(c, w, i, spec.matmuls, scale=c.query_pre_attn_scalar ** -0.5,
                            window=c.sliding_window if sliding else None,
                            rope=1 if sliding and c.rope_local_theta is not None else 0, softcap=c.attn_logit_softcap)
        mlp = hf.mlp(c, w, i, spec.matmuls)
        layers.append(DecoderLayer(attn, mlp, attn_norm=w.pop(p + "input_layernorm.weight"),
                                   post_attn_norm=w.pop(p + "post_attention_layernorm.weight"),
                                   mlp_norm=w.pop(p + "pre_feedforward_layernorm.weight"),
                                   post_mlp_norm=w.pop(p + "post_feedforward_layernorm.weight")))
    ropes = [RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, spec.dtype)]
    if c.rope_local_theta is not None:
        ropes.append(RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_local_theta, None, spec.dtype))
    return ModelParts(layers, w[hf.EMBED], w[hf.FINAL_NORM], hf.lm_head(c, w), ropes)


FAMILY = Family(
    name="Gemma 2, Gemma 3 (text)",
    hf_architectures={"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"},
    model_types={"gemma2": "gemma2", "gemma3_text": "gemma3_text"},
    gguf_architectures={"gemma2": "gemma2", "gemma3": "gemma3_text"},
    parse_hf=parse_hf, parse_gguf=parse_gguf, weight_shapes=weight_shapes, build=build,
    gguf_names=lambda c: GGUF_NAMES, gguf_tensor=gguf_tensor)
