"""kernels/linear.py: the device-laid-out weight matmul against F.linear, its reference."""
import pytest
import torch
import torch.nn.functional as F

from batchjob.kernels import Linear
from batchjob.kernels.linear import _can_pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_bit_for_bit(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 40, generator=g).to(dtype)
    lin = Linear(w, b)
    assert lin.packed == (dtype == torch.bfloat16 and _can_pack(w))  # bf16 on a CPU with oneDNN bf16 support
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(lin(x.view(1, rows, 40)), F.linear(x, w, b).view(1, rows, 96))  # any leading dims


def test_unpacked_when_asked():
    w = torch.randn(8, 4).bfloat16()
    lin = Linear(w, pack=False)
    assert not lin.packed and lin.weight is w
