"""Weight matmuls (`y = x @ W.T + b`) with the weight laid out once, at load time, for the device.

On a CPU with oneDNN, a bf16 (where the CPU has bf16 support) or fp32 weight is reordered into oneDNN's
blocked layout (the packing torch's inductor does when it freezes weights). The matmul then streams the
weight in the order its AVX-512/AMX kernels read it instead of repacking it on every call: measured on
the 2-core development machine, SmolLM2-135M's 121 bf16 weight matmuls per step took 12 ms instead of
26 ms at 8 rows, 28 instead of 48 ms at 64 rows; fp32 [576x1536] at 64 rows 0.55 vs 0.79 ms (MKL), the
fp32 LM head 18 vs 32 ms.

Batch invariance: a row's result must not depend on how many rows share the call (a resumed job batches
rows differently). Measured with torch 2.13 (tests/kernels/test_linear.py): oneDNN's packed bf16 and fp32
kernels give each row bitwise the same result for 2 to 2048 rows and 1 or 2 threads, but a single row
takes another code path (different sums, e.g. [11008x4096] bf16, every fp32 shape with K >= 1536), so a
lone row is computed as two. MKL's fp32 `F.linear` varies with the row count at every shape tried, so it
is only the reference and the path on CUDA and for fp16.

On a CPU with AMX (Intel Sapphire Rapids and later) oneDNN's bf16 kernels change their blocking with the
row count (at 33 rows, and again at several larger counts), so a row's sums depend on its batch. There a
bf16 matmul always runs in calls of exactly ROW_TILE rows (the last one padded with zeros): a call of a
fixed shape gives each row bitwise the same result whatever its position and its neighbours
(tests/kernels/test_linear.py). At 64 rows this keeps most of AMX's speed (SmolLM2's LM head: 1.9 ms
for 64 rows against 15.8 ms on the AVX-512 kernels; 256 rows: 7.7 ms as four calls, 5.4 ms as one).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ROW_TILE = 64  # rows per oneDNN call for bf16 on an AMX CPU (see above)


@functools.cache
def _amx() -> bool:
    from batchjob.kernels.native.build import cpu_identity

    return "amx_bf16" in cpu_identity()[1]


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class Linear:
    """One weight matrix [out, in] (and optional bias [out]), callable on x [..., in] -> [..., out]."""

    __slots__ = ("weight", "bias", "packed", "out_features", "row_tile")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = pack and _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight
        self.row_tile = ROW_TILE if self.packed and weight.dtype == torch.bfloat16 and _amx() else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if x.dim() != 2:
                return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
            if self.row_tile:
                return self._tiled(x)
            if x.shape[0] == 1:  # one row runs as two: the same kernel, and the same sums, as in a batch
                return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.weight, self.bias, "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def memory(self) -> dict[str, int]:
        """Bytes in memory per format: the weight (and bias) in their dtype."""
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return {str(self.weight.dtype).removeprefix("torch."): self.weight.numel() * self.weight.element_size() + b}

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] in calls of exactly `row_tile` rows, the last padded with zeros."""
        rows, tile = x.shape[0], self.row_tile
        pad = -rows % tile
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        x = x.contiguous()
        outs = [torch.ops.mkldnn._linear_pointwise(x[s:s + tile], self.weight, self.bias, "none", [], "")
                for s in range(0, x.shape[0], tile)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:rows] if pad else out
