"""kernels/linear_fp8.py and the reference's quantize_weight_fp8 on the CPU (the torch references are the backend
here): the weight quantization's scales and round trip, Fp8Linear equal to fp8_scaled_mm of the reference
quantization bitwise, its checkpoint constructor (codes as given, a per-tensor scale broadcast), and the
`check_quantization` gate. The Triton backend runs under the interpreter in tests/kernels/triton_cases.py
("fp8 scaled mm: Fp8Linear ..."); nothing here has run on a GPU."""
import logging

import pytest
import torch

from batchjob.kernels.linear_fp8 import Fp8Linear, _backend
from batchjob.kernels.linear_int8 import QuantizationError
from batchjob.kernels.quantization import check_quantization, fp8_capable, keeps_fp8_codes
from batchjob.kernels.reference import scaled_mm as reference
from batchjob.kernels.reference.scaled_mm import FP8_MAX, fp8_scaled_mm, quantize_rows_fp8, quantize_weight_fp8


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float8 codes as their bytes: torch.equal has no float8 kernel on the CPU."""
    return t.view(torch.uint8)


def test_quantize_weight_fp8_scales_and_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 200, generator=g) * torch.rand(64, 1, generator=g).mul(8).exp2()
    w[3] = 0  # an all-zero channel: scale 1, codes 0
    w[5, 7] = -1e3  # an outlier sets its channel's scale
    q, s = quantize_weight_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (64,)
    amax = w.abs().amax(dim=1)
    assert torch.equal(s[amax > 0], amax[amax > 0] / FP8_MAX) and s[3] == 1 and (q[3].float() == 0).all()
    assert (q.float().abs().amax(dim=1)[amax > 0] == FP8_MAX).all()  # each channel's amax is the code 448
    assert q[5, 7].float() == -FP8_MAX
    back = q.float() * s[:, None]
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a normal value; below 2**-6 * scale the codes are
    # subnormal, spaced 2**-9 * scale apart
    bound = torch.maximum(w.abs() / 16, s[:, None] * 2.0 ** -10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    # the rows' rule, per output channel (as quantize_weight_int8 is quantize_rows_int8's)
    rq, rs = quantize_rows_fp8(w)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs.squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_reference(dtype, bias):
    g = torch.Generator().manual_seed(1)
    for n, k in ((96, 40), (320, 576)):
        w = torch.randn(n, k, generator=g).mul(0.05).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        lin = Fp8Linear(w, b)
        wq, ws = quantize_weight_fp8(w)
        assert torch.equal(_bits(lin.codes), _bits(wq)) and torch.equal(lin.scales, ws)
        for rows in (1, 7, 65):
            x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
            x[rows // 2] = 0
            xq, xs = quantize_rows_fp8(x)
            out = lin(x)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert torch.equal(out, fp8_scaled_mm(xq, xs, wq, ws, b, dtype)), (n, k, rows)
            assert torch.equal(out, lin.reference(x))
        assert torch.equal(lin(x.view(5, 13, k)), lin(x).view(5, 13, n))  # any leading dims


def test_fp8_linear_from_codes_keeps_them_and_broadcasts_a_tensor_scale():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g)
    q, s = quantize_weight_fp8(w)
    lin = Fp8Linear(codes=q, scales=s)
    assert torch.equal(_bits(lin.codes), _bits(q)) and torch.equal(lin.scales, s)
    x = torch.randn(4, 64, generator=g)
    assert torch.equal(lin(x), Fp8Linear(w)(x))
    one = Fp8Linear(codes=q, scales=torch.tensor([0.25]))  # a checkpoint's per-tensor scale
    assert torch.equal(one.scales, torch.full((48,), 0.25))
    assert torch.equal(one(x), Fp8Linear(codes=q, scales=torch.full((48,), 0.25))(x))
    assert torch.equal(Fp8Linear(codes=q, scales=torch.tensor(0.25)).scales, one.scales)  # a 0-d scale too
    with pytest.raises(ValueError, match="either a float weight or float8_e4m3fn codes"):
        Fp8Linear(w, codes=q, scales=s)
    with pytest.raises(ValueError, match="codes must be float8_e4m3fn"):
        Fp8Linear(codes=q.float(), scales=s)
    with pytest.raises(ValueError, match=r"\(47,\) scales for 48 output channels"):
        Fp8Linear(codes=q, scales=s[:47])


def test_off_cuda_the_backend_is_the_reference_with_one_log_line(caplog):
    _backend.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert Fp8Linear(torch.randn(8, 16)).backend is reference
        assert Fp8Linear(torch.randn(8, 16)).backend is reference
    lines = [r.message for r in caplog.records if "fp8 on cpu" in r.message]
    assert len(lines) == 1 and "running the torch references" in lines[0] and "int8" in lines[0]


def test_fp8_is_refused_off_cuda_and_below_compute_capability_8_9(monkeypatch):
    """The user-facing gate: a clear error on the CPU (use int8), and on an older GPU; a GPU with fp8 passes
    (the capability is faked: no GPU here)."""
    with pytest.raises(QuantizationError, match=r"'fp8' compute needs a GPU with fp8 \(CUDA compute capability "
                                                r">= 8.9\); on the CPU use --quantization int8"):
        check_quantization("fp8", "cpu")
    assert not fp8_capable("cpu") and not keeps_fp8_codes("auto", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(QuantizationError, match="capability >= 8.9, this GPU has 8.0; use --quantization int8 or none"):
        check_quantization("fp8", "cuda")
    assert not keeps_fp8_codes("auto", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization("fp8", "cuda")
    assert fp8_capable("cuda:0") and keeps_fp8_codes("auto", "cuda") and keeps_fp8_codes("fp8", "cuda")
    assert keeps_fp8_codes("int8", "cuda")  # so the conflict names what the checkpoint runs as: fp8
    assert not keeps_fp8_codes("none", "cuda")  # none: dequantized at load, the compute dtype
