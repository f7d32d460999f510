"""ModelConfig: the architecture facts the model code needs, read from HF config.json or GGUF metadata."""
from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass, field

# HF `architectures[0]` / `model_type` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# GGUF `general.architecture` -> our family name. llama.cpp files Mistral under "llama" too.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
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
    sliding_window: int | None = None  # Mistral; None = full attention
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = cfg.get("model_type")
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(mt)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
            rp = cfg["rope_parameters"]
            rope_theta = rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in (None, "default"):
                rope_scaling = None
            elif kind != "llama3":
                raise UnsupportedModelError(
                    f"{source}: rope_scaling type {kind!r} is not supported; supported: llama3 (or none)"
                )
        sliding = cfg.get("sliding_window") if arch in ("mistral", "qwen2", "qwen3") else None
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
        )

    @classmethod
    def from_gguf(cls, meta: dict, tensor_names: Collection[str], source: str = "GGUF") -> "ModelConfig":
        """`meta`: GGUF metadata as Python values; `tensor_names`: the file's tensor names (GGUF spelling)."""
        gguf_arch = meta.get("general.architecture")
        arch = GGUF_ARCHITECTURES.get(gguf_arch)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

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
        return cls(
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


def _shortest_f32(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06; give the short decimal it came from."""
    bits = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == bits:
            return short
    return float(value)
