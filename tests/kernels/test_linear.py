"""kernels/linear.py: the device-laid-out weight matmul against F.linear, its reference, and the batch
invariance a resume depends on (a row's result does not depend on the rows beside it)."""
import pytest
import torch
import torch.nn.functional as F

from batchjob.kernels import Linear
from batchjob.kernels.linear import _can_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 40, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.packed == _can_pack(w)
    ref = F.linear(x, w, b)
    if dtype == torch.bfloat16:  # oneDNN is F.linear's own bf16 path: bit for bit
        assert torch.equal(lin(x), ref)
    else:  # oneDNN's fp32 kernel vs MKL's: other blocking of the sums
        torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x.view(1, rows, 40)), lin(x).view(1, rows, 96))  # any leading dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (200, 64), (3072, 576), (49152, 576)])
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(dtype, shape):
    """SmolLM2's shapes among them: its fused gate/up (3072) and its LM head (49152), where oneDNN's AMX
    kernels change their sums at 33 rows and beyond unless the rows go in fixed tiles."""
    g = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(*shape, generator=g).to(dtype))
    if not lin.packed:
        pytest.skip("no oneDNN packing for this dtype on this CPU")
    x = torch.randn(300, shape[1], generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = lin(x[:1])
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 2, 3, 16, 33, 37, 64, 65, 300):
                assert torch.equal(lin(x[:rows])[:1], alone), (n, rows)
            assert torch.equal(lin(torch.cat([x[5:40], x[:1]]))[-1:], alone), n  # last of 36 rows
    finally:
        torch.set_num_threads(threads)


def test_unpacked_when_asked():
    w = torch.randn(8, 4).bfloat16()
    lin = Linear(w, pack=False)
    assert not lin.packed and lin.weight is w
