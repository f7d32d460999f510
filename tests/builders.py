"""Builders the tests share: tiny random models in memory, prompts, JSONL inputs and GGUF files written as
llama.cpp writes them. Plain functions; the fixtures over them are in conftest.py."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.models.config import ModelConfig
from batchjob.models.registry import build_model
from batchjob.models.causal_lm import CausalLM

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 512


def random_llama(cfg: ModelConfig, seed: int = 0, std: float = 0.2, embed_std: float = 1.0) -> CausalLM:
    """A Llama of `cfg` with N(0, std) weights (the embeddings N(0, embed_std)) from `seed`, norms at 1; an
    lm_head unless the embeddings are tied. The draw order is fixed, so a seed always gives one model."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=std):
        return torch.randn(*shape, generator=g) * std

    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, h, std=embed_std), "model.norm.weight": torch.ones(h)}
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = w(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h), p + "mlp.down_proj.weight": w(h, inter),
        })
    return build_model(cfg, weights, torch.float32)


def make_engine(model, *, num_blocks=512, block_size=8, eos=(), **sched) -> Engine:
    return Engine(model, list(eos), EngineConfig(num_blocks=num_blocks, block_size=block_size, scheduler=SchedulerConfig(**sched)))


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `LlamaModel.permute` of Q/K rows (what the loader must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_gguf(hf_dir: Path, path: Path, qtype: str = "F32", gguf_arch: str | None = None,
               qtypes: dict[str, str] | None = None) -> Path:
    """Convert a tiny HF folder to GGUF as llama.cpp would (names, Q/K permute for llama, tokenizer metadata).

    2-D weights are stored as `qtype` (F32/F16/BF16/Q8_0/Q5_0/Q4_0/..., IQ4_NL, or a K-quant Q2_K...Q6_K, whose
    rows must be a multiple of 256), unless `qtypes` maps a pattern matching their GGUF name (fnmatch, first match
    wins: {"output.weight": "Q6_K", "blk.*.attn_v.weight": "Q6_K"}) to another type; norms and biases as F32.
    """
    import fnmatch

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = gguf_arch or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(hf_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    w.add_chat_template(tcfg["chat_template"])

    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        parts = name.split(".")
        if name.startswith("model.layers."):
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = llama_cpp_permute(a, heads if module == "self_attn.q_proj" else kv_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        qt = gguf.GGMLQuantizationType[next((t for p, t in (qtypes or {}).items() if fnmatch.fnmatchcase(gname, p)), qtype)]
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a)
        else:
            q = quantize_blocks(a, qt.name) if qt.name in OWN_QUANTIZERS else gguf.quants.quantize(a, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- K-quants and IQ4_NL: gguf.quants.quantize cannot write them, so these do, block by block -----------


def quantize_blocks(a: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of float32 -> the bytes of `qtype` (one of OWN_QUANTIZERS), laid out as gguf.quants.dequantize reads them.

    A plain quantizer (per-sub-block scales from each sub-block's range, round to nearest), not llama.cpp's
    error search, but real data: dequantized, it is the input to within half a step.
    """
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    if a.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} weights, not {a.shape[-1]}")
    blocks = OWN_QUANTIZERS[qtype](a.astype(np.float32).reshape(-1, block))
    return blocks.reshape(*a.shape[:-1], -1)


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the float16 bytes, the float32 value they hold) of one scale per block."""
    h = v.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32).reshape(-1, 1)


def _affine(x: np.ndarray, sub: int, scale_max: int, q_max: int):
    """value = d * sc * q - dmin * m with sc, m in [0, scale_max] per sub-block of `sub`, q in [0, q_max]."""
    s = x.reshape(len(x), -1, sub)
    lo, hi = np.minimum(s.min(-1), 0), np.maximum(s.max(-1), 0)
    step, offset = np.maximum((hi - lo) / q_max, 1e-12), -lo
    d_bytes, d = _f16(step.max(-1) / scale_max)
    dmin_bytes, dmin = _f16(offset.max(-1) / scale_max)
    sc = np.clip(np.rint(step / np.maximum(d, 1e-12)), 1, scale_max)
    m = np.clip(np.rint(offset / np.maximum(dmin, 1e-12)), 0, scale_max)
    q = np.clip(np.rint((s + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, q_max)
    return d_bytes, dmin_bytes, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8).reshape(len(x), 256)


def _symmetric(x: np.ndarray, sub: int, scale_max: int, q_lo: int, q_hi: int):
    """value = d * sc * q with |sc| in [1, scale_max] per sub-block of `sub`, q in [q_lo, q_hi] (q_lo = -q_hi - 1).

    As llama.cpp does, sc takes the sign that puts the sub-block's largest magnitude on q_lo, the longer side.
    """
    s = x.reshape(len(x), -1, sub)
    peak = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)[..., 0]
    step = np.maximum(np.abs(peak) / -q_lo, 1e-12)
    d_bytes, d = _f16(step.max(-1) / scale_max)
    sc = np.clip(np.rint(step / np.maximum(d, 1e-12)), 1, scale_max) * np.where(peak > 0, -1, 1)
    q = np.clip(np.rint(s / (d * sc)[..., None]), q_lo, q_hi)
    return d_bytes, sc.astype(np.int16), q.astype(np.int16).reshape(len(x), 256)


def _bits(q: np.ndarray, groups: int, width: int, bits: int) -> np.ndarray:
    """Pack q (n, 256) into bytes: element (g, k, j) of q.reshape(n, groups, 8 // bits, width) goes to byte
    (g, j) at bit bits * k (how the K-quants interleave their 2-, 4- and 1-bit planes)."""
    q = q.reshape(len(q), groups, 8 // bits, width).astype(np.uint8)
    out = np.zeros((len(q), groups, width), np.uint8)
    for k in range(8 // bits):
        out |= q[:, :, k] << np.uint8(bits * k)
    return out.reshape(len(q), -1)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _q2_k(x):  # scales[16] (sc | m << 4), qs[64] (2-bit), d, dmin
    d, dmin, sc, m, q = _affine(x, 16, 15, 3)
    return np.concatenate([sc | (m << 4), _bits(q, 2, 32, 2), d, dmin], axis=1)


def _q3_k(x):  # hmask[32] (bit 2 of q + 4), qs[64] (its low 2 bits), scales[12] (6-bit, + 32), d
    d, sc, q = _symmetric(x, 16, 31, -4, 3)
    u, s = (q + 4).astype(np.uint8), (sc + 32).astype(np.uint8)
    scales = np.concatenate([_bits(s & 0xF, 1, 8, 4), _bits(s >> 4, 1, 4, 2)], axis=1)  # low nibbles, then top 2 bits
    return np.concatenate([_bits(u >> 2, 1, 32, 1), _bits(u & 3, 2, 32, 2), scales, d], axis=1)


def _q4_k(x):  # d, dmin, scales[12], qs[128] (4-bit)
    d, dmin, sc, m, q = _affine(x, 32, 63, 15)
    return np.concatenate([d, dmin, _k_scales(sc, m), _bits(q, 4, 32, 4)], axis=1)


def _q5_k(x):  # d, dmin, scales[12], qh[32] (bit 4), qs[128] (low 4 bits)
    d, dmin, sc, m, q = _affine(x, 32, 63, 31)
    return np.concatenate([d, dmin, _k_scales(sc, m), _bits(q >> 4, 1, 32, 1), _bits(q & 0xF, 4, 32, 4)], axis=1)


def _q6_k(x):  # ql[128] (low 4 bits of q + 32), qh[64] (its top 2 bits), scales[16] (int8), d
    d, sc, q = _symmetric(x, 16, 127, -32, 31)
    u = (q + 32).astype(np.uint8)
    return np.concatenate([_bits(u & 0xF, 2, 64, 4), _bits(u >> 4, 2, 32, 2), sc.astype(np.int8).view(np.uint8), d], axis=1)


_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_nl(x):  # d, qs[16] (4-bit indices into a fixed table: weight j in the low nibble of byte j % 16)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)[:, 0]
    d_bytes, d = _f16(peak / -127)  # the largest magnitude on -127, the table's longer side
    idx = np.abs(x[..., None] / np.where(d == 0, 1, d)[..., None] - _IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    return np.concatenate([d_bytes, idx[:, :16] | (idx[:, 16:] << 4)], axis=1)


OWN_QUANTIZERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl}
