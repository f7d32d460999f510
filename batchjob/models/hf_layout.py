"""The weight layout most Hugging Face decoder checkpoints share (Llama and the families built like it): each
name written once here, with its shape and the block it builds. `model.embed_tokens`, `model.norm`, an untied
`lm_head`; per layer `self_attn.{q,k,v,o}_proj` (optional q/k/v biases and q/k norms), `mlp.{gate,up,down}_proj`,
`input_layernorm` and `post_attention_layernorm`. A family adds or drops names around these."""
from __future__ import annotations

import torch

from batchjob.kernels.quantization import MatmulFormat, linear
from batchjob.models.config import ModelConfig
from batchjob.models.layers import MLP, Attention, fused

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
LAYER = "model.layers.{i}."
ATTN, MLP_ = LAYER + "self_attn.", LAYER + "mlp."
INPUT_NORM, POST_ATTN_NORM = LAYER + "input_layernorm.weight", LAYER + "post_attention_layernorm.weight"
QKV, O = ("q_proj", "k_proj", "v_proj"), "o_proj"
GATE_UP, DOWN = ("gate_proj", "up_proj"), "down_proj"


def outer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights around the layers: embeddings, the final norm, an untied LM head."""
    shapes = {EMBED: (c.vocab_size, c.hidden_size), FINAL_NORM: (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes[LM_HEAD] = (c.vocab_size, c.hidden_size)
    return shapes


def attention_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    a = ATTN.format(i=i)
    shapes = {a + f"{n}.weight": (size, c.hidden_size) for n, size in zip(QKV, (q, kv, kv))}
    shapes[a + f"{O}.weight"] = (c.hidden_size, q)
    if c.attention_bias:
        shapes |= {a + f"{n}.bias": (size,) for n, size in zip(QKV, (q, kv, kv))}
    if c.qk_norm:
        shapes |= {a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
    return shapes


def mlp_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    m = MLP_.format(i=i)
    return {**{m + f"{n}.weight": (c.intermediate_size, c.hidden_size) for n in GATE_UP},
            m + f"{DOWN}.weight": (c.hidden_size, c.intermediate_size)}


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-laid-out checkpoint: pre-norm layers of attention and a gated MLP."""
    shapes = outer_shapes(c)
    for i in range(c.num_layers):
        shapes |= attention_shapes(c, i) | mlp_shapes(c, i)
        shapes |= {INPUT_NORM.format(i=i): (c.hidden_size,), POST_ATTN_NORM.format(i=i): (c.hidden_size,)}
    return shapes


def attention(c: ModelConfig, w: dict[str, torch.Tensor], i: int, matmuls: MatmulFormat, **kw) -> Attention:
    """Layer i's attention (fused QKV, optional biases and q/k norms); `kw`: the Attention fields a family sets."""
    a = ATTN.format(i=i)
    bias = fused(w, *(a + f"{n}.bias" for n in QKV)) if a + "q_proj.bias" in w else None
    kw.setdefault("window", c.sliding_window)
    return Attention(qkv=linear(matmuls, fused(w, *(a + f"{n}.weight" for n in QKV)), bias),
                     o=linear(matmuls, w.pop(a + f"{O}.weight")), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, scale=kw.pop("scale", c.head_dim ** -0.5),
                     q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"), **kw)


def mlp(c: ModelConfig, w: dict[str, torch.Tensor], i: int, matmuls: MatmulFormat, prefix: str = MLP_) -> MLP:
    """Layer i's gated MLP (gate and up fused) under `prefix` (a shared expert's: `...mlp.shared_expert.`)."""
    m = prefix.format(i=i)
    return MLP(linear(matmuls, fused(w, *(m + f"{n}.weight" for n in GATE_UP))), linear(matmuls, w.pop(m + f"{DOWN}.weight")),
               c.hidden_act)


def norms(w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """A pre-norm layer's two norms, as DecoderLayer's fields."""
    return {"attn_norm": w.pop(INPUT_NORM.format(i=i)), "mlp_norm": w.pop(POST_ATTN_NORM.format(i=i))}


def lm_head(c: ModelConfig, w: dict[str, torch.Tensor]) -> torch.Tensor:
    embed = w[EMBED]
    return embed if c.tie_word_embeddings or LM_HEAD not in w else w[LM_HEAD]
