"""Builders the tests share: tiny random models in memory, prompts, JSONL inputs and GGUF files written as
llama.cpp writes them. Plain functions; the fixtures over them are in conftest.py."""
from __future__ import annotations

import dataclasses
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


def rows_a_step(job: Path, seqs: int) -> None:
    """A job file whose engine takes one row a step (`max_num_seqs = 1`) changed to `seqs` rows, atomically: a run that
    starts from now on (a requeued Slurm task, a retried Ray shard) reads either the old file or the new one. A resume
    with another batch size gives the same rows and text (a row's text does not depend on its batch)."""
    import os

    text = job.read_text()
    assert "max_num_seqs = 1\n" in text, job
    job.with_suffix(".new").write_text(text.replace("max_num_seqs = 1\n", f"max_num_seqs = {seqs}\n"))
    os.replace(job.with_suffix(".new"), job)


def exported(out: Path, to: Path, columns: list[str]) -> list[dict]:
    """`batchjob export OUT --to TO` (a Parquet file; it must succeed), then `columns` of its rows, in input order."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from batchjob.cli.main import main

    result = CliRunner().invoke(main, ["export", str(out), "--to", str(to)])
    assert result.exit_code == 0, result.output
    return pq.read_table(to, columns=columns).to_pylist()


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


# ---- SentencePiece vocabularies (tokenizer.ggml.model "llama"), as llama.cpp writes Llama 2's, Phi-3's, Gemma's ----

_LLAMA_HEAD = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("[INST]", 3), ("[/INST]", 3)]  # Mistral v0.3's controls
_LLAMA_TAIL = [("<|user|>", 3), ("<|assistant|>", 3), ("<|end|>", 3), ("<think>", 4)]  # Phi-3's; one user-defined
# Gemma: ids 0-4, its turn markers, and the user-defined runs of whitespace that llama.cpp stores with real spaces
_GEMMA_HEAD = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 3), ("<start_of_turn>", 3),
               ("<end_of_turn>", 3), ("\n\n", 4), ("  ", 4), ("   ", 4), ("    ", 4)]


def sentencepiece_vocab(corpus: str, size: int, flavour: str = "llama") -> dict:
    """GGUF tokenizer metadata (key -> value) of a SentencePiece BPE vocabulary of exactly `size` tokens.

    Laid out as llama.cpp writes one: special tokens, the 256 byte pieces <0x00>..<0xFF>, the merged pieces
    best-scored first (score -rank), then every character of `corpus`. The pieces are learned here
    (tokenizers' BpeTrainer over '▁'-prefixed words, as SentencePiece BPE sees text). flavour "llama": Llama 2 /
    Mistral / Phi-3 ids (<unk> <s> </s>), newlines only through byte fallback; "gemma": Gemma's ids (<pad> <eos>
    <bos> <unk>), "\\n" a piece. Both carry control tokens, a user-defined one, and an eot token.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer = Tokenizer(models.BPE())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer.train_from_iterator(corpus.splitlines() * 4,
                                trainer=trainers.BpeTrainer(vocab_size=4000, show_progress=False))
    learned = json.loads(trainer.to_str())["model"]
    merged = list(dict.fromkeys((m if isinstance(m, str) else " ".join(m)).replace(" ", "") for m in learned["merges"]))
    chars = sorted({c for c in learned["vocab"] if len(c) == 1} | ({"\n"} if flavour == "gemma" else set()))

    head, tail = (_GEMMA_HEAD, []) if flavour == "gemma" else (_LLAMA_HEAD, _LLAMA_TAIL)
    runs = [] if flavour == "gemma" else ["▁▁", "▁▁▁", "▁▁▁▁"]  # Gemma's are the user-defined "  "...
    pieces = runs + [m for m in merged if not set(m) <= {"▁"}]
    room = size - len(head) - 256 - len(chars) - len(tail)
    if room < 0 or room > len(pieces):
        raise ValueError(f"a vocabulary of {size} cannot be made from this corpus ({len(pieces)} pieces learned)")
    pieces = pieces[:room] + chars  # merged pieces have 2+ characters
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + pieces + [t for t, _ in tail]
    types = [k for _, k in head] + [6] * 256 + [1] * len(pieces) + [k for _, k in tail]
    scores = [-1000.0 if k == 4 else 0.0 for _, k in head] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    scores += [-1000.0 if k == 4 else 0.0 for _, k in tail]
    assert len(tokens) == len(set(tokens)) == size
    if flavour == "gemma":
        names = ("<bos>", "<eos>", "<unk>", "<end_of_turn>", "<pad>")
    else:
        names = ("<s>", "</s>", "<unk>", "<|end|>", None)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}
    for key, name in zip(("bos", "eos", "unknown", "eot", "padding"), names):
        if name is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = tokens.index(name)
    return meta


def write_vocab_gguf(path: Path, arch: str, vocab: dict) -> Path:
    """A GGUF of `arch` with no tensors: a few hyperparameters (what transformers' AutoTokenizer reads a config
    from) and the tokenizer metadata `vocab`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(vocab["tokenizer.ggml.tokens"]))
    for key, value in vocab.items():
        _add_gguf_value(w, key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def with_gguf_vocab(src: Path, dst: Path, vocab: dict) -> Path:
    """A copy of the GGUF `src` whose tokenizer metadata is `vocab` (its other keys and its tensors as they are)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in vocab.items():
        _add_gguf_value(w, key, value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _add_gguf_value(w, key: str, value) -> None:
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, list):
        sub = t.STRING if isinstance(value[0], str) else t.FLOAT32 if isinstance(value[0], float) else t.INT32
        w.add_key_value(key, value, t.ARRAY, sub_type=sub)
    else:
        kind = t.BOOL if isinstance(value, bool) else t.STRING if isinstance(value, str) else t.UINT32
        w.add_key_value(key, value, kind)


# ---- GGUF files of every family, as llama.cpp's convert_hf_to_gguf.py writes them ------------------------------

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # HF model_type -> GGUF general.architecture


def write_family_gguf(hf_dir: Path, path: Path, qtype: str = "F32", shared_gate_vector: bool = True) -> Path:
    """Convert a tiny HF folder of any family to GGUF as llama.cpp's convert_hf_to_gguf.py does (its model classes
    per family): their metadata keys; tensor names from gguf's own TensorNameMap (the specification, not
    batchjob's tables); llama's Q/K row permute (Mixtral's too); Gemma's norms stored as 1 + w and Gemma 2's lm_head
    dropped; each layer's experts stacked into one 3-D tensor per projection. The vocabulary: `write_gguf`'s.

    One liberty: a Gemma 3 file states its layer types (sliding_window_pattern, a flag a layer, which llama.cpp
    reads) where the converter leaves llama.cpp's default, every sixth layer global: a 2-layer model keeps its
    global layer. Matrices and expert stacks are stored as `qtype` (a type gguf.quants.quantize writes; F16 where a
    row is not a multiple of its block, as the converter falls back); norms,
    biases and routers as F32, as the converter keeps them. Qwen2-MoE's shared-expert gate is a vector, as the
    converter wrote it while it squeezed every tensor (most such files; transformers reads only that), or with
    `shared_gate_vector=False` [1, hidden], as it writes it now.
    """
    import re

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    kind = cfg["model_type"]
    arch = GGUF_ARCH[kind]
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(hf_dir.name)
    w.add_block_count(n)  # TextModel.set_gguf_parameters: what every family writes
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":  # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    elif kind in ("qwen2_moe", "qwen3_moe"):  # Qwen2MoeModel
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    elif kind == "gemma2":  # Gemma2Model
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif kind == "gemma3_text":  # Gemma3Model
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    elif kind == "phi3":  # Phi3MiniModel
        w.add_rope_dimension_count(int((cfg.get("partial_rotary_factor") or 1.0) * hidden) // heads)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    _add_gpt2_vocab(w, hf_dir)

    weights = load_file(str(hf_dir / "model.safetensors"))
    stacks: dict[str, dict[int, torch.Tensor]] = {}  # the converter's _experts: one 3-D tensor a projection
    for name in [k for k in weights if re.fullmatch(r"model\.layers\.\d+\.\w+\.experts\.\d+\.\w+\.weight", k)]:
        layer, part, xid, proj = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight", name).groups()
        stacks.setdefault(f"model.layers.{layer}.{part}.experts.{proj}.weight", {})[int(xid)] = weights.pop(name)
    weights |= {name: torch.stack([parts[x] for x in sorted(parts)]) for name, parts in stacks.items()}

    names = gguf.get_tensor_name_map(next(a for a, s in gguf.MODEL_ARCH_NAMES.items() if s == arch), n)
    for name, t in weights.items():
        if kind == "gemma2" and name == "lm_head.weight":  # Gemma2Model.filter_tensors
            continue
        a = t.float().numpy()
        if kind.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's x * (1 + w), stored as 1 + w
            a = a + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            a = llama_cpp_permute(a, heads if ".q_proj." in name else kv_heads)
        base, suffix = name.rsplit(".", 1)
        gname = names.get_name(base)
        if gname is None:
            raise ValueError(f"gguf's tensor map for {arch} has no name for {name}")
        gname += "." + suffix
        if shared_gate_vector and ".ffn_gate_inp_shexp." in gname:
            a = a.reshape(-1)
        a = np.ascontiguousarray(a, dtype=np.float32)
        qt = gguf.GGMLQuantizationType[qtype]
        if a.ndim == 1 or gname.endswith("_norm.weight") or ".ffn_gate_inp" in gname or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a)
        elif a.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:  # as the converter does for a row it cannot quantize
            w.add_tensor(gname, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gpt2_vocab(w, hf_dir: Path) -> None:
    """The tokenizer metadata of `write_gguf`: the folder's byte-level BPE as tokenizer.ggml.model "gpt2"."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    w.add_chat_template(tcfg["chat_template"])


def run_rows(model: CausalLM, prompts: list[list[int]], params, *, budget: int = 2048, caching: bool = True,
             num_blocks: int = 512, block_size: int = 8, max_steps: int = 2000, **scheduler):
    """Every prompt as a row with `params` through a fresh engine until none is left (at most `max_steps`
    steps: a row that never finishes fails the test instead of hanging it); returns (engine, rows)."""
    from batchjob.engine.core.sequence import Sequence

    engine = Engine(model, [], EngineConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                                            scheduler=SchedulerConfig(max_num_batched_tokens=budget, **scheduler)))
    seqs = [Sequence(i, list(p), params) for i, p in enumerate(prompts)]
    for s in seqs:
        assert engine.add(s) is None
    for _ in range(max_steps):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work, [(s.num_computed, s.num_prompt, s.status) for s in seqs]
    return engine, seqs


def matmuls(obj, kind: type, path=(), seen=None) -> dict[tuple, object]:
    """The `kind` matmuls (Int8Linear, Fp8Linear, Linear) reachable from a model's layers, by their path
    (attribute names and list indices): for counting them, and with `replace`, swapping them for test doubles."""
    seen = set() if seen is None else seen
    found = {}
    items = (vars(obj).items() if hasattr(obj, "__dict__") else
             ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else ())
    for name, value in list(items):
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, kind):
            found[(*path, name)] = value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v) or hasattr(v, "__dict__"):
                    found |= matmuls(v, kind, (*path, name, i), seen)
        elif dataclasses.is_dataclass(value):
            found |= matmuls(value, kind, (*path, name), seen)
    return found


def replace(obj, path: tuple, value) -> None:
    """Sets what `path` (a key of `matmuls`) names in obj to `value`."""
    for key in path[:-1]:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    setattr(obj, path[-1], value)


def write_compressed_tensors(hf_dir: Path, dst: Path, weights: dict, fmt: str = "pack-quantized",
                             dtype: torch.dtype = torch.bfloat16) -> Path:
    """An HF folder quantized weight-only by compressed-tensors' own code, as llm-compressor's round-to-nearest
    recipe (QuantizationModifier, minmax observer) saves it: `weights` are QuantizationArgs (e.g. num_bits 4, strategy
    group, group_size 32, symmetric), applied to every Linear but lm_head; scales and zero points from each group's
    min / max (calculate_qparams), then ModelCompressor compresses the model into `fmt`, save_pretrained writes it in
    `dtype` (scales too) and update_config adds the quantization_config. Tokenizer files are copied."""
    import shutil

    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            n, k = module.weight.shape
            size = args.group_size if args.strategy == "group" else k
            groups = module.weight.reshape(n, k // size, size)
            scale, zero = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for f in hf_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def weights_digest(folder: Path) -> str:
    """The SHA-256 of a saved model folder's weights (one model.safetensors)."""
    import hashlib

    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
