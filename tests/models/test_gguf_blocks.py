"""GGUF weights computed as stored (kernels/linear_quant.py: what `--quantization auto` runs on a CPU): every family
that loads from GGUF, in the block formats its files come in, gives the greedy text of the same file dequantized
(`--quantization none`, the values gguf's dequantize gives) wherever the reference's logit margin allows: a
continuation may part from the reference only at a token whose two best logits the reference had within MARGIN
(the activations' int8 blocks move logits by about that much). Rows are bitwise the same alone and batched, on every
path this CPU runs. Also: which tensors stay packed, the tied LM head sharing the embeddings' copy, the memory the
packed model takes."""
from __future__ import annotations

import random

import gguf
import pytest
import torch

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.engine.params import SamplingParams
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.kernels.linear_quant import BlockQuantLinear, PackedWeight
from batchjob.kernels.native.build import ISAS, isa_runs_here
from batchjob.kernels.native.quant_blocks import native_quant_blocks
from batchjob.models.loader import load_model
from batchjob.models.registry import build_model
from tests.builders import write_family_gguf
from tests.kernels.test_linear_quant import pytestmark as needs_compiler  # noqa: F401 - the same skip
from tests.models.test_gguf_quants import Q4_K_M_LIKE, wide_gguf, wide_llama_dir  # noqa: F401 - fixtures

pytestmark = needs_compiler
MARGIN = 0.05  # logits: the reference's top-2 gap under which the int8 activations may choose the other token
NEW_TOKENS = 16
DENSE = ("llama", "qwen2", "qwen3", "mistral")
FAMILIES = ("gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe_every_layer")


@pytest.fixture(scope="module")
def family_gguf(tiny_model_dir, tiny_gguf_path, tmp_path_factory):
    made = {}

    def make(arch: str, qtype: str):
        if arch in DENSE:
            return tiny_gguf_path(arch, qtype)
        if (arch, qtype) not in made:
            folder = tmp_path_factory.mktemp(f"blocks_{arch}_{qtype}")
            hf = tiny_model_dir(arch, tie_word_embeddings=arch.startswith("gemma"))
            made[arch, qtype] = write_family_gguf(hf, folder / f"{arch}.{qtype}.gguf", qtype)
        return made[arch, qtype]

    return make


def models(path, kernels: str = "auto"):
    """(as stored, dequantized) fp32 models of one file."""
    out = []
    for blocks in (True, False):
        loaded = load_model(str(path), dtype=torch.float32, blocks=blocks)
        out.append(build_model(loaded.config, dict(loaded.weights), torch.float32, kernels=kernels))
    return out[0], out[1], loaded


def greedy(model, prompts, n=NEW_TOKENS):
    got = Engine(model, [], EngineConfig(num_blocks=256, block_size=16)).generate(
        prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return [s.output_ids for s in got]


def assert_equal_where_the_margin_allows(ours, ref_model, prompts, theirs):
    """Each continuation equals the reference's, or parts from it at a token the reference nearly tied (after which
    the two texts go their own ways: nothing more to compare)."""
    for p, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = teacher_forced_logits(ref_model, p + b[:i + 1])[-1]
        top = logits.topk(2).values
        assert top[0] - top[1] < MARGIN, f"parted at token {i} where the reference led by {top[0] - top[1]:.3f}"


def prompts_for(vocab: int, lengths=(3, 12, 30, 50)) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", DENSE + FAMILIES)
def test_every_family_gives_the_dequantized_text_where_the_margin_allows(arch, qtype, family_gguf):
    path = family_gguf(arch, qtype)
    ours, ref, loaded = models(path)
    packed = [layer.attn.o for layer in ours.layers]
    assert all(isinstance(m, BlockQuantLinear) for m in packed)
    ps = prompts_for(loaded.config.vocab_size)
    mine, theirs = greedy(ours, ps), greedy(ref, ps)
    assert_equal_where_the_margin_allows(mine, ref, ps, theirs)
    alone = [greedy(ours, [p])[0] for p in ps[:2]]
    assert alone == mine[:2]


def test_a_q4_k_m_like_file_packs_each_tensor_in_its_own_format(wide_gguf):
    path = wide_gguf(*Q4_K_M_LIKE)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    loaded = load_model(str(path), dtype=torch.float32, blocks=True)
    w = loaded.weights
    assert isinstance(w["model.embed_tokens.weight"], PackedWeight) and isinstance(w["lm_head.weight"], PackedWeight)
    assert dict(w["lm_head.weight"].formats) == {"Q6_K": 400 * 256}
    assert not isinstance(w["model.norm.weight"], PackedWeight)
    expect = types["blk.1.attn_output.weight"]  # Q5_1 there
    assert set(w["model.layers.1.self_attn.o_proj.weight"].formats) == {expect}
    ours, ref, loaded = models(path)
    qkv = ours.layers[0].attn.qkv
    assert [p.fmt.name for p in qkv.weight.parts] == ["Q4_K", "Q6_K"]  # q and k merged, v its own
    ps = prompts_for(loaded.config.vocab_size, (3, 10, 25, 50, 90))
    assert_equal_where_the_margin_allows(greedy(ours, ps, 20), ref, ps, greedy(ref, ps, 20))


def test_the_packed_model_holds_the_files_bytes(wide_gguf):
    """Each format's bits a weight (BlockFormat.bits_per_weight: the file's, but Q6_K's codes kept as bytes, 8.6 bits
    instead of 6.6, and the K-quants' 12 bytes of scales as 16), rows rounded up to blocks of 64."""
    path = wide_gguf(*Q4_K_M_LIKE)
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) > 1)
    loaded = load_model(str(path), dtype=torch.float32, blocks=True)
    parts = [p for w in loaded.weights.values() if isinstance(w, PackedWeight) for p in w.parts]
    for p in parts:
        assert p.nbytes == -(-p.n // 64) * 64 * p.k * p.fmt.bits_per_weight / 8, p.fmt.name
    packed = sum(p.nbytes for p in parts)
    assert file_bytes <= packed <= 1.3 * file_bytes


def test_tied_embeddings_and_lm_head_share_one_packed_copy(family_gguf):
    path = family_gguf("gemma2", "Q8_0")
    ours, ref, _ = models(path)
    assert isinstance(ours.embed, PackedWeight) and ours.lm_head.weight is ours.embed
    ids = torch.tensor([1, 7, 300])
    assert torch.equal(ours.embed_tokens(ids), ref.embed_tokens(ids))  # the values gguf gives, bitwise


@pytest.mark.parametrize("isa", [i for i in ISAS if isa_runs_here(i)])
def test_rows_alone_equal_rows_batched_on_every_path(isa, monkeypatch, wide_gguf):
    monkeypatch.setenv("BATCHJOB_CPU_ISA", isa)
    assert native_quant_blocks().isa == isa
    path = wide_gguf(*Q4_K_M_LIKE)
    loaded = load_model(str(path), dtype=torch.bfloat16, blocks=True)
    model = build_model(loaded.config, dict(loaded.weights), torch.bfloat16)
    ps = prompts_for(loaded.config.vocab_size, (5, 17, 40))
    batched = greedy(model, ps)
    assert [greedy(model, [p])[0] for p in ps] == batched


def test_quantization_none_dequantizes_and_int8_requantizes(tiny_gguf_path):
    path = tiny_gguf_path("llama", "Q8_0")
    loaded = load_model(str(path), dtype=torch.float32, blocks=True)
    int8 = build_model(loaded.config, dict(loaded.weights), torch.float32, quantization="int8")
    assert type(int8.layers[0].attn.o).__name__ == "Int8Linear"
    plain = load_model(str(path), dtype=torch.float32)
    assert not any(isinstance(w, PackedWeight) for w in plain.weights.values())


def test_types_not_computed_as_stored_are_named_once_with_their_memory(wide_gguf, capsys):
    from tests.models.test_gguf_quants import Q3_K_M_LIKE

    path = wide_gguf(*Q3_K_M_LIKE)  # Q3_K and IQ4_NL: dequantized; its Q6_K, Q5_K, Q4_K: packed
    loaded = load_model(str(path), dtype=torch.bfloat16, blocks=True)
    said = capsys.readouterr().err
    assert said.count("not computed as stored") == 1
    assert "Q3_K (" in said and "IQ4_NL (1)" in said and "dequantized at load to bfloat16" in said and "GiB" in said
    assert isinstance(loaded.weights["lm_head.weight"], PackedWeight)  # its Q6_K output stays packed
    load_model(str(path), dtype=torch.bfloat16)  # --quantization none: nothing to say
    assert "not computed as stored" not in capsys.readouterr().err


def test_the_start_line_says_the_weights_formats_and_size(wide_gguf):
    from batchjob.job.report.summary import weight_words

    path = wide_gguf(*Q4_K_M_LIKE)
    ours, ref, _ = models(path)
    said = weight_words(ours.weight_memory())
    assert said.startswith("weights ") and "Q4_K " in said and "Q6_K " in said and "float32 " in said
    packed = sum(v for k, v in ours.weight_memory().items() if k.startswith("Q"))
    assert packed <= 1.3 * sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1)
    assert weight_words(ref.weight_memory()).endswith("(float32)")  # dequantized: one format
