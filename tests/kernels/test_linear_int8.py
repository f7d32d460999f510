"""kernels/linear_int8.py and kernels/native/csrc/scaled_mm.cpp: the W8A8 int8 matmul against the references
in kernels/reference/scaled_mm.py (exact int32 sums, bitwise quantization and rescale), and the batch
invariance a resume depends on. The native tests run on every instruction-set path this CPU runs (AVX-512, AVX2,
generic: each its own build and GEMM micro-kernel, forced through BATCHJOB_CPU_ISA), and the AVX-512 path is
compiled (not run) on any x86 CPU."""
import pytest
import torch

from batchjob.kernels import linear_int8
from batchjob.kernels.linear_int8 import Int8Linear, _int_mm_exact
from batchjob.kernels.native.build import ISAS, BuildError, compiler, cpu_identity, isa_runs_here
from batchjob.kernels.native.scaled_mm import native_scaled_mm
from batchjob.kernels.reference.scaled_mm import (int8_matmul_int32, int8_scaled_mm, quantize_rows_int8,
                                                  quantize_weight_int8)
from tests.kernels.compile_checks import compile_every_path

RUNNABLE_ISAS = [isa for isa in ISAS if isa_runs_here(isa)]  # best first
DTYPES = [torch.float32, torch.bfloat16]


def _has_compiler() -> bool:
    try:
        compiler()
        return True
    except BuildError:
        return False


needs_compiler = pytest.mark.skipif(not _has_compiler(), reason="no C++ compiler")


@pytest.fixture(params=RUNNABLE_ISAS)
def isa(request, monkeypatch) -> str:
    """Each path this CPU runs, forced through BATCHJOB_CPU_ISA (which `native_scaled_mm()`, and so `Int8Linear`,
    read when called; each path is its own cached build)."""
    if not _has_compiler():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("BATCHJOB_CPU_ISA", request.param)
    return request.param


def _ops(isa: str):
    ops = native_scaled_mm()
    assert ops is not None and ops.isa == isa and ops.has_gemm
    return ops


def _rows(g, rows: int, k: int, dtype) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero (its scale is 1), one with a single large outlier."""
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g).mul(30).exp2().div(2 ** 15)
    x[rows // 2] = 0
    if rows > 2:
        x[1, k // 3] = 1e3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_quantize_rows_equals_the_reference_bitwise(dtype, isa):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(1)
    for rows, k in ((1, 576), (5, 33), (3, 7), (300, 1536)):
        x = _rows(g, rows, k, dtype)
        q, s = ops.quantize_rows(x)
        qr, sr = quantize_rows_int8(x)
        assert torch.equal(q, qr) and torch.equal(s, sr), (rows, k)
    # halves: x * 127 / amax landing on .5 exactly rounds to even, as torch.round does
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, 126.5]], dtype=dtype)
    assert torch.equal(ops.quantize_rows(x)[0], quantize_rows_int8(x)[0])
    assert ops.quantize_rows(x)[0].tolist() == [[127, 0, 2, 2, -2, 126]]
    # strided rows (a view into a wider tensor)
    wide = _rows(g, 9, 80, dtype)
    q, s = ops.quantize_rows(wide[:, 5:70])
    qr, sr = quantize_rows_int8(wide[:, 5:70])
    assert torch.equal(q, qr) and torch.equal(s, sr)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("acc_dtype", [torch.int32, torch.float32])
def test_native_rescale_equals_the_reference_bitwise(dtype, acc_dtype, isa):
    """The rescale alone (around another GEMM): ((float)acc * x_scale) * w_scale (+ bias), rounded to the dtype."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(5)
    for rows, n in ((1, 17), (7, 100), (300, 576)):
        acc = torch.randint(-127 * 127 * 600, 127 * 127 * 600, (rows, n), generator=g, dtype=torch.int32)
        xs, ws = torch.rand(rows, 1, generator=g) / 100, torch.rand(n, generator=g) / 100
        bias = torch.randn(n, generator=g)
        for b in (None, bias):
            out = ops.rescale(acc.to(acc_dtype), xs, ws, b, dtype)
            ref = acc.float() * xs * ws
            assert torch.equal(out, (ref if b is None else ref + b).to(dtype)), (rows, n)


@pytest.mark.parametrize("n,k", [(96, 40), (100, 37), (17, 3), (960, 576), (200, 4099)])
def test_the_int8_sums_are_exact(n, k, isa):
    """The GEMM (this path's micro-kernel) against exact int32 sums, at extreme codes (all +-127: the largest pairs
    `vpmaddubsw` sees, where a u8 x s8 scheme without the sign trick saturates), past 2**24 (where an fp32 sum
    would round), with k and n off the packing's multiples (k in quads, n in blocks of 64 and micro-tiles of 16
    or 32: the padding must add nothing), for every row count a tile can have (1 to 7, then full ones)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = 127  # the largest sums: 127 * 127 * k
    w[-1] = -127
    w[n // 2, ::2] = -127  # alternating signs within a pair
    w[n // 2, 1::2] = 127
    lin = Int8Linear(codes=w, scales=torch.ones(n))
    assert lin.kernel == f"native-{_ops(isa).gemm_kernel}" and lin._codes is None
    assert torch.equal(lin.weight_codes(), w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 64, 300):
        xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
        xq[0] = 127
        xq[-1] = -127
        if rows > 2:
            xq[1, ::2] = -127
            xq[1, 1::2] = 127
        acc = lin.sums(xq)
        assert acc.dtype == torch.int32 and torch.equal(acc, int8_matmul_int32(xq, w)), (n, k, rows)
    assert acc[0, 0] == 127 * 127 * k and acc[-1, -1] == 127 * 127 * k
    assert k < 3 or 127 * 127 * 4099 > 2 ** 24


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_reference(dtype, bias, isa):
    """The whole call (quantize, GEMM, rescale) equals int8_scaled_mm of the reference quantization, bitwise (the
    same fp32 operations in the same order), on odd shapes and SmolLM2's."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((96, 40), (100, 37), (17, 3), (3072, 576), (576, 1536)):
        w = torch.randn(n, k, generator=g).mul(0.05).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        lin = Int8Linear(w, b)
        assert lin.kernel == f"native-{_ops(isa).gemm_kernel}"
        wq, ws = quantize_weight_int8(w)
        assert torch.equal(lin.weight_codes(), wq) and torch.equal(lin.scales, ws)
        for rows in (1, 3, 7, 300):
            x = _rows(g, rows, k, dtype)
            xq, xs = quantize_rows_int8(x)
            ref = int8_scaled_mm(xq, xs, wq, ws, b, dtype)
            out = lin(x)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert torch.equal(out, ref), (n, k, rows)
        assert torch.equal(lin(x.view(3, 100, k)), lin(x).view(3, 100, n))  # any leading dims
        wide = _rows(g, 5, k + 9, dtype)  # strided rows
        assert torch.equal(lin(wide[:, 4:4 + k]), lin(wide[:, 4:4 + k].contiguous()))


# SmolLM2's shapes, its LM head among them; the generic path (plain loops: slow) on two
SMOLLM2 = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
INVARIANCE = [(isa, shape) for isa in RUNNABLE_ISAS for shape in (SMOLLM2 if isa != "generic" else SMOLLM2[::2])]


@pytest.mark.parametrize("isa_name,shape", INVARIANCE)
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(isa_name, shape, monkeypatch):
    """A row's output bitwise the same alone, in batches of 2 to 300 rows at any position (every micro-tile height
    and remainder), on 1 or 2 threads (integer sums are exact in any order; the quantize and rescale see one row)."""
    if not _has_compiler():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("BATCHJOB_CPU_ISA", isa_name)
    g = torch.Generator().manual_seed(4)
    lin = Int8Linear(torch.randn(*shape, generator=g).bfloat16())
    assert lin.kernel.startswith("native-")
    x = torch.randn(300, shape[1], generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = lin(x[:1])
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 2, 3, 5, 16, 17, 33, 64, 65, 300):
                assert torch.equal(lin(x[:rows])[:1], alone), (t, rows)
            assert torch.equal(lin(torch.cat([x[5:40], x[:1]]))[-1:], alone), t  # last of 36 rows
            assert torch.equal(lin(torch.cat([x[5:150], x[:1], x[150:]]))[145:146], alone), t  # in the middle of 300
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_every_path_gives_the_same_bits():
    """The paths this CPU runs, side by side on one weight and one batch (each already equals the reference)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(130, 200, generator=g)
    x = _rows(g, 37, 200, torch.float32)
    outs = {}
    for isa in RUNNABLE_ISAS:
        ops = native_scaled_mm(isa)
        packed = ops.pack_weight(quantize_weight_int8(w)[0])
        outs[isa] = ops.int8_linear(x, packed, quantize_weight_int8(w)[1], None, torch.float32)
    first = outs[RUNNABLE_ISAS[0]]
    assert all(torch.equal(first, o) for o in outs.values()), list(outs)


def test_from_codes_and_errors():
    w = torch.randn(16, 8)
    q, s = quantize_weight_int8(w)
    a, b = Int8Linear(w), Int8Linear(codes=q, scales=s)
    x = torch.randn(3, 8)
    assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="either"):
        Int8Linear(w, codes=q, scales=s)
    with pytest.raises(ValueError, match="int8"):
        Int8Linear(codes=q.float(), scales=s)


def test_the_native_kernel_runs_on_every_path(isa):
    """The whole call in one native op wherever the library builds, on each path with its own micro-kernel:
    AVX512-VNNI / AVX-VNNI `vpdpbusd` where the CPU has it, else AVX2's vpmaddubsw (AVX-512 CPUs without VNNI
    too), generic C++ elsewhere. Only the packed copy of the weight is kept."""
    flags = cpu_identity()[1]
    expected = {"avx512": "avx512-vnni" if "avx512_vnni" in flags else "avx-vnni" if "avx_vnni" in flags else "avx2",
                "avx2": "avx-vnni" if "avx_vnni" in flags else "avx2", "generic": "generic"}[isa]
    assert _ops(isa).gemm_kernel == expected
    lin = Int8Linear(torch.randn(16, 8))
    assert lin.kernel == f"native-{expected}" and lin._codes is None and lin._packed is not None


def test_without_the_native_library_int_mm_runs(monkeypatch):
    """No compiler (no native library): `_int_mm` between the torch references' quantize and rescale, equal to
    the reference."""
    monkeypatch.setattr(linear_int8, "native_scaled_mm", lambda: None)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 24, generator=g)
    lin = Int8Linear(w, torch.randn(40, generator=g))
    assert lin.kernel == ("int_mm" if _int_mm_exact() else "reference") and lin._packed is None
    x = _rows(g, 9, 24, torch.float32)
    torch.testing.assert_close(lin(x), lin.reference(x), rtol=1e-6, atol=0)


@pytest.mark.skipif(not isa_runs_here("avx2"), reason="not an x86 CPU")
@needs_compiler
def test_every_path_compiles_here():
    """Each path's source compiles with its target flags on this x86 CPU, AVX-512 (with VNNI) included: a path
    this CPU cannot run is still checked to build."""
    compile_every_path("scaled_mm.cpp", {})
