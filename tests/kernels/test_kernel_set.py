"""The KernelSet contract (kernels/interface.py): every backend is one; an elementwise op a backend lacks runs
the torch reference for that op alone, and dispatch says so in one line."""
from __future__ import annotations

import shutil

import pytest
import torch

from batchjob.kernels import KernelSet
from batchjob.kernels.reference import elementwise
from batchjob.kernels.reference.kernel_set import TorchKernels
from batchjob.kernels.dispatch import select_kernels


class HalfDone(KernelSet):
    """A backend with its own cache layout (the reference's here) and SiLU only: the rest of the elementwise ops
    come from the references."""
    name = "half-done"
    kv_cache_shapes, store_kv, attention = TorchKernels.kv_cache_shapes, TorchKernels.store_kv, TorchKernels.attention

    def silu_mul(self, gate_up):
        return elementwise.silu_mul(gate_up) * 1.0


def test_a_missing_op_falls_back_to_its_reference_alone():
    kernels = HalfDone()
    assert isinstance(kernels, KernelSet)
    assert kernels.reference_ops() == [op for op in KernelSet.ELEMENTWISE_OPS if op != "silu_mul"]
    g = torch.Generator().manual_seed(0)
    gate_up, logits = torch.randn(5, 32, generator=g), torch.randn(3, 256, generator=g) * 40
    assert torch.equal(kernels.gelu_tanh_mul(gate_up), elementwise.gelu_tanh_mul(gate_up))
    assert torch.equal(kernels.softcap(logits, 30.0), torch.tanh(logits / 30.0) * 30.0)
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))


def test_the_references_borrow_nothing_and_dispatch_logs_only_what_a_backend_lacks():
    lines: list[str] = []
    assert select_kernels("torch", "cpu", torch.float32, 64, 1, log=lines.append).reference_ops() == []
    assert lines == []
    if shutil.which("g++"):
        native = select_kernels("native", "cpu", torch.float32, 64, 1, log=lines.append)
        assert native.reference_ops() == [] and not [line for line in lines if "from the torch references" in line]


def test_only_the_triton_set_captures_graphs():
    assert not TorchKernels().captures_graphs
    with pytest.raises(NotImplementedError, match="torch kernels plan each step on the host"):
        TorchKernels().graph_plan(512)
