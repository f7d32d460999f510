"""compressed-tensors W4A16 checkpoints (`format` pack-quantized, what GPTQ / AWQ exports through llm-compressor write)
load without dequantizing: a tiny Llama quantized and compressed by compressed-tensors' own code (symmetric groups of
32 and 64, asymmetric with zero points, per channel; bf16 scales as a bf16 model saves them) loads as Int4Weight
whose values are compressed-tensors' own decompression of the same file (bitwise in fp32; rounded to bf16, bitwise
its bf16 result), runs int4 on the CPU's packed kernel (BlockQuantLinear) and gives the greedy text of a float model
on those values wherever the reference's logit margin allows. Groups the kernel does not take (16) run dequantized
with the same values; W8A16 pack-quantized is dequantized at load; activation order (a g_idx that is not the
identity), a conflicting --quantization and pack-quantized schemes we do not run are one clear error each."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.bench.kv_quality import teacher_forced_logits
from batchjob.io.manifest import Manifest
from batchjob.kernels.linear import Linear
from batchjob.kernels.linear_quant import BlockQuantLinear, Int4Weight
from batchjob.models.loader import ModelLoadError, load_model
from batchjob.models.registry import build_model
from tests.builders import write_compressed_tensors
from tests.job.test_resume import FAST, cli, texts, write_jsonl
from tests.kernels.test_linear_quant import pytestmark as needs_compiler
from tests.models.test_gguf_blocks import assert_equal_where_the_margin_allows, greedy, prompts_for

pytest.importorskip("compressed_tensors")  # the `test` extra installs it
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

SCHEMES = {  # QuantizationArgs of the weights, as an llm-compressor recipe names them
    "group32": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
    "group64": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True},
    "group32-zero-points": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
    "channel": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True},
    "channel-zero-points": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False},
}
MORE = {  # loaded, but not as the kernel computes them: groups of 16 (dequantized at build), 8 bits (at load)
    "group16": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": True},
    "w8a16": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
}
PROJ = "model.layers.0.mlp.down_proj"  # k = 128: two groups of 64, four of 32
LOGIT_TOLERANCE = 0.02  # packed int4 model against the float model on the same values (measured <= 0.0055)


@pytest.fixture(scope="module")
def float_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def ct_folder(float_dir, tmp_path_factory):
    """Factory: `ct_folder(scheme, dtype=bf16)` -> the float folder compressed by compressed-tensors (cached)."""
    made = {}

    def make(scheme: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        if (scheme, dtype) not in made:
            dst = tmp_path_factory.mktemp("w4a16") / f"{scheme}-{str(dtype).removeprefix('torch.')}"
            made[scheme, dtype] = write_compressed_tensors(float_dir, dst, (SCHEMES | MORE)[scheme], dtype=dtype)
        return made[scheme, dtype]

    return make


def decompressed(folder: Path, fp32_scales: bool = False) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every packed linear of the folder (PackedQuantizationCompressor,
    which computes scale * (q - z) in the scale's dtype); `fp32_scales`: with the stored scales upcast first, so the
    products are exact (bf16 scale x 4-bit integer)."""
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    stored = load_file(folder / "model.safetensors")
    out = {}
    for module in {n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")}:
        parts = {n.removeprefix(module + "."): t for n, t in stored.items() if n.rsplit(".", 1)[0] == module}
        if fp32_scales:
            parts["weight_scale"] = parts["weight_scale"].float()
        out[module + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    return out


def reference(folder: Path, loaded) -> object:
    """The fp32 float model whose projections are compressed-tensors' decompressed values (the rest: the folder's)."""
    weights = dict(loaded.weights) | decompressed(folder, fp32_scales=True)
    return build_model(loaded.config, weights, torch.float32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_loaded_values_are_compressed_tensors_own_decompression(ct_folder, scheme):
    folder = ct_folder(scheme)
    loaded = load_model(folder)
    assert loaded.quantization == "int4" and loaded.prequantized
    assert "int4 weights" in loaded.quantization_scheme and "W4A16" in loaded.quantization_scheme
    theirs, exact = decompressed(folder), decompressed(folder, fp32_scales=True)
    assert len(theirs) == 14  # 7 projections x 2 layers; lm_head ignored
    for name, value in theirs.items():
        w = loaded.weights[name]
        assert isinstance(w, Int4Weight) and w.u.dtype == torch.uint8 and int(w.u.max()) <= 15
        assert w.group == SCHEMES[scheme].get("group_size", w.shape[1])
        assert (w.mins is None) == SCHEMES[scheme]["symmetric"]
        ours = w.dequantized(torch.float32)
        assert torch.equal(ours, exact[name])  # fp32: exact products, bitwise
        assert value.dtype == torch.bfloat16 and torch.equal(ours.to(torch.bfloat16), value)  # their bf16 result
    if not SCHEMES[scheme]["symmetric"]:  # the zero points are not all 0 (-8 * scale): they were read
        w = loaded.weights[PROJ + ".weight"]
        assert not torch.equal(w.mins, -8 * w.scales)
    assert loaded.weights["lm_head.weight"].dtype == torch.float32  # in the compute dtype, as ignored


def test_fp32_scales_symmetric_bitwise_asymmetric_within_rounding(ct_folder):
    """An fp32 model's checkpoint has fp32 scales: symmetric values are compressed-tensors' own bitwise (one rounding
    of scale * q either way); with zero points ours is scale * u + mins (two roundings, compressed-tensors' one):
    within 1.5 ulp of 15 * scale."""
    sym = ct_folder("group32", torch.float32)
    w = load_model(sym).weights
    for name, value in decompressed(sym).items():
        assert value.dtype == torch.float32 and torch.equal(w[name].dequantized(torch.float32), value)
    asym = ct_folder("group32-zero-points", torch.float32)
    w = load_model(asym).weights
    for name, value in decompressed(asym).items():
        scale = w[name].scales.repeat_interleave(32, dim=1)
        assert ((w[name].dequantized(torch.float32) - value).abs() <= 24 * torch.finfo(torch.float32).eps * scale).all()


@needs_compiler
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_w4a16_folder_runs_packed_and_gives_the_dequantized_text(ct_folder, scheme):
    folder = ct_folder(scheme)
    loaded = load_model(folder)
    ref = reference(folder, loaded)
    model = build_model(loaded.config, dict(loaded.weights), torch.float32, quantization="int4", prequantized=True)
    layer = model.layers[0]
    for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
        assert isinstance(m, BlockQuantLinear)
        assert set(m.formats) == {f"int4 g{SCHEMES[scheme].get('group_size', m.weight.shape[1])}"}
    assert isinstance(model.lm_head, Linear)  # ignored by the recipe: the compute dtype
    ps = prompts_for(loaded.config.vocab_size)
    # the int8 activation blocks move logits by ~0.005 here; the unquantized float model is 0.07-0.09 away: so the
    # values the kernel computes on are these, not merely close to them
    assert (teacher_forced_logits(model, ps[-1]) - teacher_forced_logits(ref, ps[-1])).abs().max() < LOGIT_TOLERANCE
    ours, theirs = greedy(model, ps), greedy(ref, ps)
    assert_equal_where_the_margin_allows(ours, ref, ps, theirs)
    assert [greedy(model, [p])[0] for p in ps[:2]] == ours[:2]  # alone = batched


@needs_compiler  # --quantization int4 on a CPU needs the native library, whatever the groups
def test_groups_the_kernel_does_not_take_run_dequantized_with_the_same_values(ct_folder, capfd):
    folder = ct_folder("group16")
    loaded = load_model(folder)
    assert loaded.quantization == "int4" and loaded.weights[PROJ + ".weight"].group == 16
    model = build_model(loaded.config, dict(loaded.weights), torch.float32, kernels="torch", quantization="int4",
                        prequantized=True)
    assert "groups of 16 weights are not computed as stored" in capfd.readouterr().err
    assert isinstance(model.layers[0].mlp.down, Linear)
    ref = build_model(loaded.config, dict(loaded.weights) | decompressed(folder, fp32_scales=True), torch.float32,
                      kernels="torch")
    ids = list(range(3, 40))
    assert torch.equal(teacher_forced_logits(model, ids), teacher_forced_logits(ref, ids))


def test_w8a16_pack_quantized_is_dequantized_at_load(ct_folder, caplog):
    folder = ct_folder("w8a16")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(folder)
    assert loaded.quantization == "dequantized" and not loaded.prequantized
    assert any("int8 weight-only (pack-quantized) weights are dequantized to float32" in r.message
               for r in caplog.records)
    for name, value in decompressed(folder, fp32_scales=True).items():
        assert torch.equal(loaded.weights[name], value)


@needs_compiler
def test_a_job_runs_int4_and_a_conflicting_option_is_one_clear_error(ct_folder, tmp_path):
    folder = ct_folder("group32")
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(4)])
    args = ["run", "--model", folder, "--input", src, "--max-tokens", 4, *FAST]
    cli(*args, "--output", tmp_path / "out")
    assert len(texts(tmp_path / "out")) == 4
    assert Manifest.load(tmp_path / "out").fingerprint["params"]["quantization"] == "int4"  # auto: the checkpoint's
    printed = cli(*args, "--quantization", "none", "--output", tmp_path / "none", code=1)
    assert ("is a pre-quantized checkpoint (compressed-tensors int4 weights in groups of 32, weight-only (W4A16)) that "
            "runs as 'int4'; --quantization none conflicts with it: use auto (or int4)") in printed


def _with_g_idx(folder: Path, dst: Path, g_idx: torch.Tensor) -> Path:
    """A copy of `folder` whose PROJ stores `g_idx` (as GPTQ with actorder 'group' wrote it)."""
    shutil.copytree(folder, dst)
    weights = load_file(dst / "model.safetensors")
    weights[PROJ + ".weight_g_idx"] = g_idx.to(torch.int32)
    save_file(weights, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_activation_order_is_refused_naming_the_layer_unless_its_g_idx_is_the_identity(ct_folder, tmp_path):
    folder = ct_folder("group32")
    plain = torch.arange(128) // 32
    assert load_model(_with_g_idx(folder, tmp_path / "identity", plain)).quantization == "int4"
    shuffled = plain[torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ModelLoadError) as e:
        load_model(_with_g_idx(folder, tmp_path / "act-order", shuffled))
    message = str(e.value)
    assert f"{PROJ}.weight_g_idx" in message and "activation order" in message and "not supported" in message
    assert "\n" not in message


W4 = SCHEMES["group32"]


@pytest.mark.parametrize("group, message", [
    ({"weights": W4, "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}},
     r"activations int8 token with pack-quantized weights int4 group \(group_size 32\) are not supported"),
    ({"weights": {**W4, "num_bits": 2}}, r"weights int2 group \(group_size 32\) \(pack-quantized\) are not supported"),
    ({"weights": {**W4, "strategy": "tensor", "group_size": None}}, r"weights int4 tensor \(pack-quantized\)"),
    ({"weights": {**W4, "dynamic": True}}, "are not supported"),
    ({"weights": W4, "format": "marlin-24"}, "group group_0: format 'marlin-24' is not supported"),
])
def test_pack_quantized_schemes_we_do_not_run_are_one_clear_line(float_dir, tmp_path, group, message):
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = json.loads((float_dir / "config.json").read_text())
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision" if "format" in group else "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], **group}}, "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))  # refused before the weights
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(folder)
    assert "\n" not in str(e.value) and "supported" in str(e.value)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_unpacking_inverts_compressed_tensors_pack_to_int32(bits, byteorder, monkeypatch):
    """Codes and zero points of any width in k (a partial last word too), on either path (bytes split on a
    little-endian host, shifts elsewhere)."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    from batchjob.models import compressed_tensors as ct

    monkeypatch.setattr(ct.sys, "byteorder", byteorder)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (37, 100), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    u = ct._unpack(pack_to_int32(q, bits), bits, 100)
    assert u.dtype == torch.uint8 and torch.equal(u.int() - half, q.int())
    z = q[:, :3].contiguous()  # zero points: packed along the outputs
    assert torch.equal(ct._unpack(pack_to_int32(z, bits, packed_dim=0).t().contiguous(), bits, 37).t().int() - half,
                       z.int())
