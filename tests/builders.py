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
from batchjob.models.llama import LlamaModel

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 512


def random_llama(cfg: ModelConfig, seed: int = 0, std: float = 0.2, embed_std: float = 1.0) -> LlamaModel:
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
    return LlamaModel(cfg, weights, torch.float32)


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


def write_gguf(hf_dir: Path, path: Path, qtype: str = "F32", gguf_arch: str | None = None) -> Path:
    """Convert a tiny HF folder to GGUF as llama.cpp would (names, Q/K permute for llama, tokenizer metadata).

    2-D weights are stored as `qtype` (F32/F16/BF16/Q8_0/Q4_0/Q4_1/...); norms and biases as F32.
    """
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

    qt = gguf.GGMLQuantizationType[qtype]
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
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
