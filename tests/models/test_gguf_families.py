"""GGUF files of the families beyond dense Llama/Qwen (Gemma 2, Gemma 3 text, Phi-3, OLMo 2, Mixtral, Qwen2-MoE,
Qwen3-MoE), written from tiny random HF models as llama.cpp's convert_hf_to_gguf.py writes them
(tests/builders.py write_family_gguf, whose tensor names come from gguf's own TensorNameMap): batchjob reads back
the HF config and weights, and its greedy text equals the reference's.

The reference is transformers loading the same GGUF file where its GGUF loader knows the architecture (gemma2,
gemma3, phi3, qwen2moe, qwen3moe), handed the config fields that loader does not read from the file (UNREAD:
it leaves them at the config class's defaults, one published checkpoint's values). Otherwise it is the HF model
the file was written from: transformers has no GGUF loader for olmo2, and reads a Mixtral file (`llama` with
experts) as a dense Llama without its experts. Gemma files also come with their own SentencePiece vocabulary
(tokenizer.ggml.model "llama"): one test per Gemma generates text end to end with one.
"""
from __future__ import annotations

import json
import random
import re

import gguf
import numpy as np
import pytest
import torch

from batchjob.engine.params import SamplingParams
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.models import registry
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.families import gemma, llama, moe, olmo2, phi3
from batchjob.models.loader import load_model
from batchjob.models.weights import ModelLoadError
from tests.builders import sentencepiece_vocab, with_gguf_vocab, write_family_gguf

transformers = pytest.importorskip("transformers")

ARCHS = ("gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe_every_layer")
# transformers' GGUF loader: the config fields it leaves at its defaults (llama.cpp derives them or does not store
# them); None: no GGUF loader for the architecture, the HF model is the reference
UNREAD = {
    "gemma2": ("query_pre_attn_scalar",),  # llama.cpp derives the attention scale from head_dim
    "gemma3_text": ("query_pre_attn_scalar", "layer_types"),  # ... and the layer types from sliding_window_pattern
    "phi3": ("rope_parameters", "pad_token_id"),  # the rotary share (rope.dimension_count); its default pad is 32000
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),  # expert_*feed_forward_length
    "qwen3_moe_every_layer": ("moe_intermediate_size",),
    "olmo2": None,
    "mixtral": None,
}
NEW_TOKENS = 12
SPM_CORPUS = """\
The quick brown fox jumps over the lazy dog. In 2024 I paid 12345 dollars for 3 apples.
Batch inference reads rows from files, runs a language model, and writes the answers back out.
def square(x: int) -> int:
    return x ** 2  # squares a number
"""


@pytest.fixture(scope="module")
def hf_dirs(tiny_model_dir):
    return {arch: tiny_model_dir(arch, tie_word_embeddings=arch.startswith("gemma")) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_path(hf_dirs, tmp_path_factory):
    """Factory: `gguf_path(arch, qtype="F32", **writer options)` -> the HF folder of `arch` written as GGUF."""
    made = {}

    def make(arch: str, qtype: str = "F32", **options):
        key = (arch, qtype, tuple(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"gguf_{arch}_{qtype}")
            made[key] = write_family_gguf(hf_dirs[arch], folder / f"{arch}.{qtype}.gguf", qtype, **options)
        return made[key]

    return make


def reference(arch: str, hf_dir, path):
    """transformers' model for `arch`'s GGUF `path` (see the module docstring): from the file, or from `hf_dir`."""
    if UNREAD[arch] is None:
        return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    for name in UNREAD[arch]:
        setattr(config, name, hf_config[name])
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32).eval()


def greedy_pair(arch, hf_dir, path, lengths=(3, 30, 50)):
    """(batchjob's, the reference's) greedy continuations of a few prompts; 30 and 50 pass Gemma's 24-token window."""
    rng = random.Random(2)
    ps = [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]
    loaded = load_model(str(path), dtype=torch.float32)
    model = registry.build_model(loaded.config, dict(loaded.weights), torch.float32, kernels="torch")
    ours = [s.output_ids for s in Engine(model, [], EngineConfig(num_blocks=64, block_size=16)).generate(
        ps, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    ref = reference(arch, hf_dir, path)
    theirs = []
    for p in ps:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        theirs.append(out[0, len(p):].tolist())
    return ours, theirs, loaded, ref


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Every weight of ours equals transformers' (which keeps a layer's experts fused: gate_up_proj [E, 2F, H],
    gate rows first, and down_proj [E, H, F])."""
    for name, t in ours.items():
        if m := re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name):
            fused, x = theirs[f"{m[1]}.{'down' if m[3] == 'down' else 'gate_up'}_proj"][int(m[2])], m[3]
            expected = fused if x == "down" else fused.chunk(2)[0 if x == "gate" else 1]
        else:
            expected = theirs[name]
        assert torch.equal(t, expected), name


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_weights_read_back(arch, hf_dirs, gguf_path):
    hf, g = load_model(str(hf_dirs[arch])), load_model(str(gguf_path(arch)))
    assert g.config == hf.config
    assert g.weights.keys() == hf.weights.keys()
    for name, t in hf.weights.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # stored as 1 + w: what the model applies
            assert torch.equal(1 + g.weights[name], 1 + t), name
        else:
            assert torch.equal(g.weights[name], t), name
    assert g.identity["architecture"] == hf.config.architecture


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_text_matches_the_reference(arch, hf_dirs, gguf_path):
    path = gguf_path(arch)
    ours, theirs, loaded, ref = greedy_pair(arch, hf_dirs[arch], path)
    assert ours == theirs
    assert len({tuple(o) for o in ours}) == len(ours) and all(len(set(o)) > 2 for o in ours)  # varied, not stuck
    if UNREAD[arch] is not None:  # the same file read by transformers: the same weights
        assert_same_weights(loaded.weights, ref.state_dict())


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe_every_layer"])  # Gemma's norm offset; 3-D expert stacks
def test_a_q8_0_file_matches_transformers_reading_it(arch, hf_dirs, gguf_path):
    path = gguf_path(arch, "Q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    if arch.startswith("qwen3"):
        assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    ours, theirs, loaded, ref = greedy_pair(arch, hf_dirs[arch], path)
    assert ours == theirs
    assert_same_weights(loaded.weights, ref.state_dict())


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_a_gemma_file_with_its_sentencepiece_vocab_generates_transformers_text(arch, hf_dirs, gguf_path, tmp_path):
    # as Gemma files come: tokenizer.ggml.model "llama" (tests/builders.py sentencepiece_vocab, Gemma's layout)
    from batchjob import api

    path = with_gguf_vocab(gguf_path(arch), tmp_path / f"{arch}.spm.gguf", sentencepiece_vocab(SPM_CORPUS, 400, "gemma"))
    llm = api.LLM(str(path), dtype="float32", kernels="torch", kv_cache_gb=0.05)
    prompts = ["The quick brown fox", "Batch inference reads rows from files, runs a language model, and writes", "def f(x):"]
    got = llm.generate(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = reference(arch, hf_dirs[arch], path)
    for prompt, result in zip(prompts, got):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert llm.tokenizer.encode(prompt) == ids[0].tolist()
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        assert result.text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt


def test_a_shared_expert_gate_stored_as_a_matrix_reads_too(hf_dirs, gguf_path):
    # today's converter keeps Qwen2-MoE's shared_expert_gate [1, hidden]; older ones squeezed it to a vector
    path = gguf_path("qwen2_moe", shared_gate_vector=False)
    assert [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_gate_inp_shexp.weight"][0].shape.tolist() == [64, 1]
    hf, g = load_model(str(hf_dirs["qwen2_moe"])), load_model(str(path))
    for name, t in hf.weights.items():
        assert torch.equal(g.weights[name], t), name


# ---- the names: llama.cpp's, as gguf.constants lists them per architecture ---------------------------------------


VARIANTS = {llama: {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}, gemma: {"gemma2": "gemma2", "gemma3_text": "gemma3"},
            phi3: {"phi3": "phi3"}, olmo2: {"olmo2": "olmo2"},
            moe: {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}}  # variant -> GGUF arch


def _spec(gguf_arch: str) -> tuple[set[str], gguf.TensorNameMap]:
    """llama.cpp's tensor names for `gguf_arch` (gguf.constants MODEL_TENSORS), and gguf's HF -> GGUF name map."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == gguf_arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}, gguf.get_tensor_name_map(arch, 1)


@pytest.mark.parametrize("family", list(VARIANTS), ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_each_familys_gguf_names_are_llama_cpps(family):
    # one table a family, its variants sharing it as they share HF names: every name is llama.cpp's for one of
    # the family's GGUF architectures, and where it is, gguf's own HF -> GGUF map gives our HF name back
    assert {v: a for a, v in family.FAMILY.gguf_architectures.items()}.items() <= VARIANTS[family].items()
    everywhere = set().union(*(_spec(a)[0] for a in VARIANTS[family].values()))
    for variant, gguf_arch in VARIANTS[family].items():
        table = family.FAMILY.gguf_names(ModelConfig(variant, 8, 8, 8, 1, 1, 1, 8))
        assert set(table) <= everywhere, set(table) - everywhere
        spec, hf_to_gguf = _spec(gguf_arch)
        for g, hf in table.items():
            if g in spec:  # experts: gguf's map spells the stack without the expert index
                assert hf_to_gguf.get_name(hf.format(bid=0, xid="{xid}").replace(".{xid}", "")) == g.format(bid=0), (g, hf)


# ---- metadata llama.cpp reads its own way: defaults, the layer pattern, the attention scale ------------------


def _meta(arch: str, layers: int, **keys) -> dict:
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 32}
    base = {"block_count": layers, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 16, "attention.layer_norm_rms_epsilon": 1e-6,
            "rope.freq_base": 1e6}
    return meta | {f"{arch}.{k}": v for k, v in (base | keys).items()}


def test_gemma3_layers_without_a_pattern_are_llama_cpps_every_sixth_global():
    c = registry.config_from_gguf(_meta("gemma3", 12, **{"attention.sliding_window": 512}), [])
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11]
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 1e6, 10_000.0, 16.0)
    assert c.final_logit_softcap is None and c.attn_logit_softcap is None and c.qk_norm and c.tie_word_embeddings
    flat = registry.config_from_gguf(_meta("gemma3", 2), [])  # no window: global attention everywhere
    assert flat.layer_types == ["full_attention"] * 2 and flat.sliding_window is None and flat.rope_local_theta is None
    big = registry.config_from_gguf(_meta("gemma3", 62, **{"attention.sliding_window": 1024, "embedding_length": 5376,
                                                          "attention.head_count": 32, "attention.key_length": 128}), [])
    assert big.query_pre_attn_scalar == 168.0  # the 27B: hidden / heads, as llama.cpp scales it


def test_gemma2_defaults_are_llama_cpps():
    c = registry.config_from_gguf(_meta("gemma2", 4), [])
    assert c.layer_types == ["sliding_attention", "full_attention"] * 2 and c.sliding_window == 4096
    assert (c.attn_logit_softcap, c.final_logit_softcap, c.rope_local_theta) == (50.0, 30.0, None)


def test_mixtral_is_a_llama_file_with_experts():
    c = registry.config_from_gguf(_meta("llama", 2, expert_count=8, expert_used_count=2), ["output.weight"])
    assert c.architecture == "mixtral" and registry.family_of(c) is moe.FAMILY
    assert c.extra == {"num_experts": 8, "top_k": 2, "renormalize": True, "moe_intermediate_size": 128,
                       "shared_expert_intermediate_size": 0, "moe_layers": [0, 1]}
    assert registry.config_from_gguf(_meta("llama", 2), ["output.weight"]).architecture == "llama"


# ---- refusals: one line each, naming what is wrong -------------------------------------------------------------


def test_an_unsupported_architecture_is_one_line_listing_the_supported():
    with pytest.raises(UnsupportedModelError) as e:
        registry.config_from_gguf(_meta("mamba", 2), [])
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, gemma2, "
                                 "gemma3, phi3, olmo2, qwen2moe, qwen3moe")


def _with_extra_tensor(src, dst, name: str, shape: tuple[int, ...]):
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("arch, extra, message", [
    ("phi3", "blk.0.attn_q.weight", r"unexpected GGUF tensor 'blk\.0\.attn_q\.weight' for a 'phi3' model .*attn_qkv"),
    ("gemma2", "blk.1.attn_gate.weight", r"unexpected GGUF tensor 'blk\.1\.attn_gate\.weight' for a 'gemma2' model"),
    ("qwen2_moe", "blk.7.attn_norm.weight", r"GGUF tensor blk\.7\.attn_norm\.weight \(model\.layers\.7\.input_layernorm"
                                            r"\.weight\) is not part of the model .*qwen2_moe, 2 layers"),
])
def test_an_unexpected_tensor_is_named(arch, extra, message, gguf_path, tmp_path):
    path = _with_extra_tensor(gguf_path(arch), tmp_path / "extra.gguf", extra, (64,) if "norm" in extra else (64, 64))
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(str(path))
    assert "\n" not in str(e.value)


def test_phi3_longrope_and_olmo3_files_are_refused():
    with pytest.raises(UnsupportedModelError, match="longrope in GGUF .*rope_factors_long"):
        registry.config_from_gguf(_meta("phi3", 2), ["rope_factors_long.weight", "rope_factors_short.weight"])
    with pytest.raises(UnsupportedModelError, match="sliding window .*OLMo 3"):
        registry.config_from_gguf(_meta("olmo2", 2, **{"attention.sliding_window": 4096}), [])
