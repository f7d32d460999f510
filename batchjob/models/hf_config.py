"""Reading the fields every family shares out of an HF config.json: sizes, heads, the rotary base and
scaling (both the `rope_theta` / `rope_scaling` keys and transformers 5's `rope_parameters`)."""
from __future__ import annotations

from batchjob.models.config import ModelConfig, UnsupportedModelError

ROPE_SCALINGS = ("llama3", "linear")  # the rope_scaling types the rotary tables implement (kernels/reference/rotary.py)


def rope_of(cfg: dict, source: str, key: str | None = None) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling) of a config; `key`: the layer type under rope_parameters (Gemma 3)."""
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and key is not None and isinstance(params.get(key), dict):
        params = params[key]
    if theta is None and isinstance(params, dict):
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        theta = params.get("rope_theta")
        if params.get("rope_type", "default") != "default":
            scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind not in ROPE_SCALINGS:
            raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} is not supported; supported: "
                                        f"{', '.join(ROPE_SCALINGS)} (or none)")
    return (float(theta) if theta is not None else None), scaling


def common_fields(cfg: dict, arch: str, source: str) -> dict:
    """The ModelConfig fields every family reads the same way."""
    num_heads = cfg["num_attention_heads"]
    theta, scaling = rope_of(cfg, source)
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta if theta is not None else 10000.0,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def config(**fields) -> ModelConfig:
    return ModelConfig(**fields)
