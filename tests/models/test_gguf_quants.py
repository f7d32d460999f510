"""GGUF files of the weight types llama.cpp writes (the K-quants, Q5_0/Q5_1, IQ4_NL, and mixes per tensor as in
its Q4_K_M and Q3_K_M files): batchjob loads the same weights as transformers loading the same file, and
generates the same greedy text.

The K-quant and IQ4_NL tensors are written by tests/builders.py's `quantize_blocks` (gguf reads them but cannot
write them), from a small Llama whose rows are 256 or 512 weights long: a K-quant block is 256 weights.
"""
from __future__ import annotations

import random
import shutil

import gguf
import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.params import SamplingParams
from batchjob.models import gguf_file
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.builders import write_gguf

HAS_NATIVE = shutil.which("g++") is not None

# Each type's dequantized weights against the originals: the error's RMS over the weights' RMS is at most this.
REL_RMS = {"Q2_K": 0.35, "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03, "Q5_0": 0.06, "Q5_1": 0.05,
           "IQ4_NL": 0.1}

# As llama.cpp's Q4_K_M: Q4_K, with the output, attn_v and half the ffn_down in Q6_K; one Q5_0 and one Q5_1
# tensor stand for its fallbacks where a row is not a multiple of 256.
Q4_K_M_LIKE = ("Q4_K", {
    "output.weight": "Q6_K",
    "blk.*.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q5_0",
    "blk.1.attn_output.weight": "Q5_1",
})
# As its Q3_K_M: Q3_K, attn_v and ffn_down in Q5_K / Q4_K, the output in Q6_K; IQ4_NL is its Q3_K fallback.
Q3_K_M_LIKE = ("Q3_K", {
    "output.weight": "Q6_K",
    "blk.*.attn_v.weight": "Q5_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.ffn_down.weight": "IQ4_NL",
})


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A 2-layer Llama saved as an HF folder: hidden 256, MLP 512, 4 heads of 64, 2 KV heads, vocabulary 400."""
    import json

    import transformers as tf
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights that give varied greedy text (HF's init is near-flat), norms off 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((1.0 if "embed_tokens" in name else 0.06) * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("wide_llama")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="module")
def wide_gguf(wide_llama_dir, tmp_path_factory):
    """Factory: `wide_gguf(qtype, qtypes=None)` -> `wide_llama_dir` written as GGUF (one file per argument set)."""
    made = {}

    def make(qtype: str, qtypes: dict[str, str] | None = None):
        key = (qtype, tuple((qtypes or {}).items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"wide_{qtype}")
            made[key] = write_gguf(wide_llama_dir, folder / f"wide.{qtype}.gguf", qtype, qtypes=qtypes)
        return made[key]

    return make


def transformers_weights(path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("qtype", list(REL_RMS))
def test_each_type_loads_the_weights_transformers_loads(wide_llama_dir, wide_gguf, qtype):
    path = wide_gguf(qtype)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} == {qtype, "F32"}  # norms in F32
    ours, theirs = load_model(str(path)).weights, transformers_weights(path)
    originals = load_model(str(wide_llama_dir)).weights
    assert ours.keys() == originals.keys()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
        w = originals[name]
        if w.ndim == 2:  # close to what was quantized: Q/K rows un-permuted right
            assert (t - w).pow(2).mean().sqrt() <= REL_RMS[qtype] * w.pow(2).mean().sqrt(), name
        else:
            assert torch.equal(t, w), name


def test_dequantizing_in_row_chunks_and_to_bf16(wide_gguf, monkeypatch):
    path = wide_gguf(*Q4_K_M_LIKE)
    whole = load_model(str(path)).weights  # every tensor here fits one chunk
    monkeypatch.setattr(gguf_file, "_CHUNK_ELEMENTS", 1000)  # 3 rows of 256 a chunk: chunks end mid-tensor
    chunked = load_model(str(path)).weights
    bf16 = load_model(str(path), dtype=torch.bfloat16).weights
    for name, t in whole.items():
        assert torch.equal(chunked[name], t), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16)), name


@pytest.mark.parametrize("kernels", [pytest.param("torch"), pytest.param("auto", id="default")])
@pytest.mark.parametrize("mix", [pytest.param(Q4_K_M_LIKE, id="Q4_K_M"), pytest.param(Q3_K_M_LIKE, id="Q3_K_M")])
def test_mixed_file_greedy_matches_transformers(wide_gguf, mix, kernels):
    import transformers

    path = wide_gguf(*mix)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert set(types.values()) == {"F32", mix[0], *mix[1].values()}
    assert types["token_embd.weight"] == types["blk.0.attn_q.weight"] == mix[0] and types["output.weight"] == "Q6_K"

    loaded = load_model(str(path))
    ours = build_model(loaded.config, dict(loaded.weights), torch.float32, kernels=kernels)
    assert ours.kernels.name == ("native" if kernels == "auto" and HAS_NATIVE else "torch")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    rng = random.Random(1)
    ps = [[rng.randrange(3, loaded.config.vocab_size) for _ in range(n)] for n in (3, 10, 25, 50, 90, 5)]
    got = Engine(ours, [], EngineConfig(num_blocks=256, block_size=16)).generate(
        ps, SamplingParams(max_tokens=20, ignore_eos=True))
    texts = set()
    for p, s in zip(ps, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        assert s.output_ids == out[0, len(p):].tolist()
        assert loaded.tokenizer.decode(s.output_ids) == loaded.tokenizer.decode(out[0, len(p):].tolist())
        texts.add(tuple(s.output_ids))
    assert len(texts) == len(ps) and all(len(set(t)) > 3 for t in texts)  # varied text, not one token repeated
