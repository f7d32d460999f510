"""kernels/linear_quant.py and kernels/native/csrc/quant_blocks.cpp: block-quantized weights (GGUF's Q4_0 ... Q8_0,
Q4_K, Q5_K, Q6_K and group-wise int4) packed at load and computed as stored, against the float64 reference in
kernels/reference/quant_blocks.py; the packed values equal gguf's own dequantize bitwise; every path this CPU runs
(AVX-512 with VNNI, AVX2, generic: forced through BATCHJOB_CPU_ISA) gives bitwise the same results, and a row's result
does not depend on its batch, its position or the thread count. The AVX-512 path is compiled (not run) on any x86."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from batchjob.kernels.linear_quant import BlockQuantLinear, PackedWeight
from batchjob.kernels.native.build import ISAS, BuildError, compile_only, compiler, cpu_identity, isa_runs_here
from batchjob.kernels.native.quant_blocks import GGUF_FORMATS, BlockFormat, ScaleKind, native_quant_blocks
from batchjob.kernels.reference.quant_blocks import block_quant_matmul, quantize_blocks_int8
from tests.builders import OWN_QUANTIZERS, quantize_blocks

RUNNABLE_ISAS = [isa for isa in ISAS if isa_runs_here(isa)]
TYPES = {f.name: t for t, f in GGUF_FORMATS.items()}


def _has_compiler() -> bool:
    try:
        compiler()
        return True
    except BuildError:
        return False


pytestmark = pytest.mark.skipif(not _has_compiler(), reason="no C++ compiler: packed weights are dequantized at load")


@pytest.fixture(params=RUNNABLE_ISAS)
def isa(request, monkeypatch) -> str:
    monkeypatch.setenv("BATCHJOB_CPU_ISA", request.param)
    return request.param


def raw_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k weights written as GGUF `name` blocks by gguf's quantizer (tests/builders.py's for K-quants)."""
    a = (np.random.RandomState(seed).randn(n, k) * 0.05).astype(np.float32)
    if name in OWN_QUANTIZERS:  # (tests/builders.py's K-quant writer has no zero-row case)
        return quantize_blocks(a, name)
    a[0, :] = 0  # an all-zero row: its scales are zero
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[name])


def gguf_values(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).copy())


def _rows(g: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero, one with an outlier."""
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g).mul(20).exp2().div(2 ** 10)
    x[rows // 2] = 0
    if rows > 2:
        x[1, k // 3] = 1e3
    return x


def test_the_formats_are_the_librarys():
    native = native_quant_blocks()
    for t, fmt in GGUF_FORMATS.items():
        assert native.gguf_format(t) == fmt


@pytest.mark.parametrize("name", list(TYPES))
def test_packed_values_are_ggufs_dequantize_bitwise(name, isa):
    raw = raw_blocks(name, 130, 512)
    w = PackedWeight([native_quant_blocks().pack_gguf(raw, TYPES[name], 512)])
    assert w.shape == (130, 512)
    values = gguf_values(raw, name)
    assert torch.equal(w.dequantized(torch.float32), values)
    ids = torch.tensor([[5, 129], [0, 64]])
    assert torch.equal(w.rows(ids, torch.float32), values[ids])
    assert torch.equal(w.rows(ids, torch.bfloat16), values[ids].bfloat16())
    with pytest.raises(IndexError):
        w.rows(torch.tensor([130]), torch.float32)


@pytest.mark.parametrize("name", list(TYPES))
def test_a_matmul_equals_the_reference(name, isa):
    n, k = 150, 768 if name.endswith("K") else 96
    raw = raw_blocks(name, n, k, seed=1)
    lin = BlockQuantLinear(PackedWeight([native_quant_blocks().pack_gguf(raw, TYPES[name], k)]), torch.randn(n))
    assert lin.kernel == f"native-{native_quant_blocks().kernel}"
    x = _rows(torch.Generator().manual_seed(2), 9, k)
    out = lin(x)
    ref = block_quant_matmul(x, gguf_values(raw, name), lin.bias, GGUF_FORMATS[TYPES[name]].activation_block)
    assert torch.equal(ref, lin.reference(x))
    scale = ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    assert ((out.double() - ref).abs() / scale).max() < 2e-6
    assert torch.allclose(lin(x.bfloat16()).float(), ref.float(), rtol=2e-2, atol=2e-2 * float(scale.max()))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_a_row_alone_equals_the_row_in_any_batch(name, isa):
    k = 512
    lin = BlockQuantLinear(PackedWeight([native_quant_blocks().pack_gguf(raw_blocks(name, 200, k, 3), TYPES[name], k)]))
    x = _rows(torch.Generator().manual_seed(4), 70, k)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        full = lin(xd)
        for rows in ((0,), (1, 2), (3, 4, 5, 6, 7), tuple(range(10, 70))):
            assert torch.equal(lin(xd[list(rows)]), full[list(rows)])
        torch.set_num_threads(1)
        try:
            assert torch.equal(lin(xd), full)
        finally:
            torch.set_num_threads(2)


def test_every_path_gives_the_same_bits(monkeypatch):
    if len(RUNNABLE_ISAS) < 2:
        pytest.skip("this CPU runs one path only")
    x = _rows(torch.Generator().manual_seed(5), 11, 512)
    outs = {}
    for isa_name in RUNNABLE_ISAS:
        monkeypatch.setenv("BATCHJOB_CPU_ISA", isa_name)
        native = native_quant_blocks()
        assert native.isa == isa_name
        outs[isa_name] = [BlockQuantLinear(PackedWeight([native.pack_gguf(raw_blocks(name, 70, 512, 6), t, 512)]))(x)
                          for name, t in TYPES.items()]
    first = outs[RUNNABLE_ISAS[0]]
    for isa_name in RUNNABLE_ISAS[1:]:
        for name, a, b in zip(TYPES, first, outs[isa_name]):
            assert torch.equal(a, b), (name, isa_name)


def test_a_fused_weight_of_several_formats_writes_each_parts_columns():
    """A Q4_K_M file's QKV: q and k in Q4_K (merged into one part: q fills whole 64-column blocks), v in Q6_K."""
    native = native_quant_blocks()
    q, kk, v = (PackedWeight([native.pack_gguf(raw_blocks(nm, n, 256, s), TYPES[nm], 256)])
                for nm, n, s in (("Q4_K", 128, 7), ("Q4_K", 40, 8), ("Q6_K", 40, 9)))
    fused = PackedWeight.cat([q, kk, v])
    assert [p.fmt.name for p in fused.parts] == ["Q4_K", "Q6_K"] and fused.shape == (208, 256)
    bias = torch.randn(208)
    lin = BlockQuantLinear(fused, bias)
    x = torch.randn(5, 256)
    parts = [BlockQuantLinear(w, b)(x) for w, b in zip((q, kk, v), bias.split([128, 40, 40]))]
    assert torch.equal(lin(x), torch.cat(parts, dim=1))
    assert torch.equal(fused.dequantized(torch.float32), torch.cat([w.dequantized(torch.float32) for w in (q, kk, v)]))


def test_int4_codes_with_fp32_group_scales():
    """Group-wise int4 (as `--quantization int4` and compressed-tensors W4A16 load): symmetric, offset 8."""
    native = native_quant_blocks()
    g = torch.Generator().manual_seed(10)
    n, k, group = 70, 256, 128
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // group, generator=g) * 0.01
    fmt = BlockFormat("int4 g128", 4, group, 8, ScaleKind.F32)
    w = PackedWeight([native.pack_codes(u, d, None, fmt)])
    values = (u.float() - 8) * d.repeat_interleave(group, dim=1)
    assert torch.equal(w.dequantized(torch.float32), values)
    x = torch.randn(6, k, generator=g)
    ref = block_quant_matmul(x, values)
    assert ((BlockQuantLinear(w)(x).double() - ref).abs().max() / ref.abs().max()) < 2e-6
    with pytest.raises(ValueError, match="multiple of"):
        native.pack_codes(u[:, :100], d, None, fmt)


def test_activation_blocks_quantize_as_the_reference_says():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0] + [0.5] * 30])
    q, scale = quantize_blocks_int8(x)
    assert scale[0, 0] == 1.0 and (q[0, :32] == 0).all()  # an all-zero block
    assert scale[0, 1] == torch.tensor(2.0) / 127 and q[0, 33] == -127 and q[0, 32] == 64  # 63.5 rounds to even
    q, scale = quantize_blocks_int8(x, 64)  # the K-quants' activations: one block of 256 (here 64)
    assert scale.shape == (1, 1) and q[0, 33] == -127


@pytest.mark.skipif("avx512f" in cpu_identity()[1] or not isa_runs_here("avx2"), reason="runs the AVX-512 path here")
def test_the_avx512_path_compiles_on_any_x86():
    compile_only("quant_blocks.cpp", {}, "avx512")


@pytest.mark.parametrize("name", ["Q4_K", "Q4_0"])
def test_rows_in_several_panels_equal_rows_alone(name, isa):
    """A call of more rows than one panel holds (about 4 MB of their codes: 512 rows of 8192 values) runs the
    panels in turn; each row's result is the one it has alone."""
    k = 8192
    lin = BlockQuantLinear(PackedWeight([native_quant_blocks().pack_gguf(raw_blocks(name, 70, k, 11), TYPES[name], k)]))
    x = _rows(torch.Generator().manual_seed(12), 700, k).bfloat16()
    full = lin(x)
    for rows in ((0,), (349, 350, 351), (699,)):
        assert torch.equal(lin(x[list(rows)]), full[list(rows)])
