"""The ModelConfig fields every family reads the same way out of GGUF metadata (llama.cpp's key names, as its
convert_hf_to_gguf.py writes them): the GGUF counterpart of hf_config.common_fields."""
from __future__ import annotations

import functools
from collections.abc import Collection

from batchjob.models.config import UnsupportedModelError, _shortest_f32

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
