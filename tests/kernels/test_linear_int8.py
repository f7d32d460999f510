"""kernels/linear_int8.py and kernels/native/csrc/scaled_mm.cpp: the W8A8 int8 matmul against the references
in kernels/reference/scaled_mm.py (exact int32 sums, bitwise quantization and rescale), and the batch
invariance a resume depends on."""
import pytest
import torch

from batchjob.kernels.linear_int8 import Int8Linear, _int_mm_exact
from batchjob.kernels.native.scaled_mm import native_scaled_mm
from batchjob.kernels.reference.scaled_mm import (int8_matmul_int32, int8_scaled_mm, quantize_rows_int8,
                                                  quantize_weight_int8)


def _rows(g, rows: int, k: int, dtype) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero (its scale is 1), one with a single large outlier."""
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g).mul(30).exp2().div(2 ** 15)
    x[rows // 2] = 0
    if rows > 2:
        x[1, k // 3] = 1e3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_quantize_rows_equals_the_reference_bitwise(dtype):
    ops = native_scaled_mm()
    if ops is None:
        pytest.skip("no native kernels on this machine")
    g = torch.Generator().manual_seed(1)
    for rows, k in ((1, 576), (5, 33), (300, 1536)):
        x = _rows(g, rows, k, dtype)
        q, s = ops.quantize_rows(x)
        qr, sr = quantize_rows_int8(x)
        assert torch.equal(q, qr) and torch.equal(s, sr), (rows, k)
    # halves: x * 127 / amax landing on .5 exactly rounds to even, as torch.round does
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, 126.5]], dtype=dtype)
    assert torch.equal(ops.quantize_rows(x)[0], quantize_rows_int8(x)[0])
    assert ops.quantize_rows(x)[0].tolist() == [[127, 0, 2, 2, -2, 126]]


def test_the_int8_sums_are_exact():
    """The GEMM (the native VNNI kernel, else `_int_mm`, else the reference) against exact int32 sums, at
    extreme codes, past 2**24 (where an fp32 sum would round), with k and n off the packing's multiples
    (k in quads, n in blocks of 64: the padding must add nothing)."""
    g = torch.Generator().manual_seed(2)
    for n, k in ((96, 40), (100, 37), (960, 576), (200, 4099)):
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        w[0] = 127  # the largest sums: 127 * 127 * k
        w[-1] = -127
        lin = Int8Linear(codes=w, scales=torch.ones(n))
        assert torch.equal(lin.weight_codes(), w)
        for rows in (1, 5, 7, 64, 300):
            xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
            xq[0] = 127
            xq[-1] = -127
            acc = lin.sums(xq)
            assert acc.dtype == torch.int32 and torch.equal(acc, int8_matmul_int32(xq, w)), (n, k, rows)
        assert acc[0, 0] == 127 * 127 * k and acc[-1, -1] == 127 * 127 * k
    assert 127 * 127 * 4099 > 2 ** 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_reference(dtype, bias):
    """The whole call (quantize, GEMM, rescale) equals int8_scaled_mm of the reference quantization: bitwise
    where the native ops run (the same fp32 operations in the same order)."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((96, 40), (3072, 576), (576, 1536)):
        w = torch.randn(n, k, generator=g).mul(0.05).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        lin = Int8Linear(w, b)
        wq, ws = quantize_weight_int8(w)
        assert torch.equal(lin.weight_codes(), wq) and torch.equal(lin.scales, ws)
        for rows in (1, 7, 300):
            x = _rows(g, rows, k, dtype)
            xq, xs = quantize_rows_int8(x)
            ref = int8_scaled_mm(xq, xs, wq, ws, b, dtype)
            out = lin(x)
            assert out.dtype == dtype and out.shape == (rows, n)
            if native_scaled_mm() is not None:
                assert torch.equal(out, ref), (n, k, rows)
            else:
                torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
        assert torch.equal(lin(x.view(3, 100, k)), lin(x).view(3, 100, n))  # any leading dims


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (49152, 576)])
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(shape):
    """SmolLM2's shapes, its LM head among them: a row's output bitwise the same alone, in batches of 2 to
    300 rows at any position, on 1 or 2 threads (oneDNN's blocking changes with the rows; integer sums do not)."""
    g = torch.Generator().manual_seed(4)
    lin = Int8Linear(torch.randn(*shape, generator=g).bfloat16())
    x = torch.randn(300, shape[1], generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = lin(x[:1])
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 2, 3, 16, 17, 33, 64, 65, 300):
                assert torch.equal(lin(x[:rows])[:1], alone), (t, rows)
            assert torch.equal(lin(torch.cat([x[5:40], x[:1]]))[-1:], alone), t  # last of 36 rows
            assert torch.equal(lin(torch.cat([x[5:150], x[:1], x[150:]]))[145:146], alone), t  # in the middle of 300
    finally:
        torch.set_num_threads(threads)


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


def test_the_native_kernel_runs_where_the_cpu_has_vnni():
    """The whole call in one native op on a CPU with AVX512-VNNI (both development machines); elsewhere
    `_int_mm` with the native quantize/rescale. Only one copy of the weight is kept."""
    lin = Int8Linear(torch.randn(16, 8))
    ops = native_scaled_mm()
    if ops is not None and ops.has_gemm:
        assert lin.kernel == "native-vnni" and lin._codes is None
    else:
        assert lin.kernel == ("int_mm" if _int_mm_exact() else "reference")
