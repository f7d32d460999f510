"""ModelConfig: the architecture facts the model code needs. Each family (models/families/) reads its own
from HF config.json or GGUF metadata; models/registry.py picks the family."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class LongRope:
    """Phi-3's longrope: the long-context factors when the job's context (max_model_len) passes `original`
    (original_max_position_embeddings), the short ones otherwise, for every row and position alike, as vLLM
    and llama.cpp choose. transformers picks per forward by the longest sequence and recomputes the cache
    when a sequence crosses `original`; it agrees with this wherever no row crosses it."""
    original: int


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # the family variant: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, olmo2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None  # Mistral, and the sliding layers of Gemma; None = full attention
    # what the families beyond Llama need (models/families/); the defaults are Llama's
    hidden_act: str = "silu"  # silu | gelu_tanh (the MLP's gate activation)
    layer_types: list[str] | None = None  # per layer: sliding_attention | full_attention (Gemma 2/3)
    rope_local_theta: float | None = None  # Gemma 3: the rotary base of the sliding layers
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5 instead of head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: tanh(s / cap) * cap on attention logits
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    embed_scale: float | None = None  # Gemma: embeddings x sqrt(hidden)
    partial_rotary_factor: float = 1.0  # Phi-3 / Phi-4-mini: the share of each head's dims that rotate
    long_rope: LongRope | None = None  # Phi-3 longrope: where the long-context rotary factors start
    extra: dict = field(default_factory=dict)


def _shortest_f32(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06; give the short decimal it came from."""
    bits = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == bits:
            return short
    return float(value)
