"""The blocks decoder families are made of, each a typed holder of its weights (laid out once at load) with
its own forward: attention (fused QKV, optional q/k norm per head or over the whole projection, partial
rotary, a per-layer window and rotary table, logit soft-capping) and a gated MLP with its activation.
Families (models/families/) differ in which blocks, norms and constants they use, not in flags here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.kernels import AttentionMetadata, Linear, LoraWeights, rms_norm
from batchjob.kernels.linear_quant import Int4Weight, PackedWeight
from batchjob.kernels.quantization import QuantizedWeight, WeightMatmul
from batchjob.kernels.profiling import scope
from batchjob.kernels import apply_rotary
from batchjob.models.adapters import LoraStep, adapted

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(slots=True)
class Attention:
    qkv: WeightMatmul  # q, k and v projections fused: one matmul
    o: WeightMatmul
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None  # RMSNorm weight of q (per head: [head_dim]; whole projection: [H * D])
    k_norm: torch.Tensor | None = None
    qk_norm_per_head: bool = True  # Qwen3 and Gemma 3 norm each head; OLMo 2 the whole projection
    window: int | None = None  # sliding window of this layer (None: full attention)
    rope: int = 0  # which of the model's rotary tables this layer uses (Gemma 3: local vs global)
    rotary_dim: int = 0  # dims rotated from the start of each head; 0: all (Phi-3 partial rotary: fewer)
    softcap: float | None = None  # attention logit soft-cap: tanh(s / cap) * cap (Gemma 2)
    # LoRA adapters' weights on the projections (every slot's), given while the model is built (models/adapters.py)
    qkv_lora: LoraWeights | None = None
    o_lora: LoraWeights | None = None

    def __call__(self, x: torch.Tensor, ropes: list, meta: AttentionMetadata, k_cache, v_cache, ops, eps: float,
                 lora: LoraStep | None = None) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        with scope("linear"):
            qkv = adapted(ops, x, self.qkv(x), self.qkv_lora, lora)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        with scope("rotary"):
            if self.q_norm is not None and not self.qk_norm_per_head:
                q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
            q = q.reshape(t, self.num_heads, d)
            k = k.reshape(t, self.num_kv_heads, d)
            v = v.reshape(t, self.num_kv_heads, d)
            if self.q_norm is not None and self.qk_norm_per_head:
                q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
            if self.rotary_dim and self.rotary_dim < d:  # partial rotary: the reference on the rotated dims
                rd = self.rotary_dim
                cos, sin = ropes[self.rope][1]
                q_rot, k_rot = apply_rotary(q[..., :rd], k[..., :rd], cos, sin)
                q, k = torch.cat([q_rot, q[..., rd:]], dim=-1), torch.cat([k_rot, k[..., rd:]], dim=-1)
            else:
                q, k = ops.rotary(q, k, ropes[self.rope][0])
        with scope("kv_store"):
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        with scope("attention"):
            o = ops.attention(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap)
        with scope("linear"):
            o = o.reshape(t, q_size)
            return adapted(ops, o, self.o(o), self.o_lora, lora)


@dataclass(slots=True)
class MLP:
    gate_up: WeightMatmul  # gate and up projections fused: one matmul
    down: WeightMatmul
    act: str = "silu"  # silu | gelu_tanh
    gate_up_lora: LoraWeights | None = None  # LoRA adapters' weights, as Attention's
    down_lora: LoraWeights | None = None

    def __call__(self, x: torch.Tensor, ops, lora: LoraStep | None = None) -> torch.Tensor:
        with scope("linear"):
            gate_up = adapted(ops, x, self.gate_up(x), self.gate_up_lora, lora)
        with scope("silu_mul"):
            x = ops.silu_mul(gate_up) if self.act == "silu" else ops.gelu_tanh_mul(gate_up)
        with scope("linear"):
            return adapted(ops, x, self.down(x), self.down_lora, lora)


@dataclass(slots=True)
class DecoderLayer:
    """One layer and where its norms sit. Pre-norm (Llama): `attn_norm` before attention, `mlp_norm` before
    the MLP. Gemma adds `post_attn_norm` / `post_mlp_norm` on each block's output (four norms); OLMo 2 has
    only the post norms."""
    attn: Attention
    mlp: MLP | MoE
    attn_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    mlp_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None


def fused(w: dict[str, torch.Tensor], *names: str) -> torch.Tensor | QuantizedWeight | PackedWeight:
    """The weights (or biases) under `names`, concatenated along the output dim: one matmul for all. Takes them
    out of `w`, so each part is freed once the fused copy exists (build_model's weights are the model's own).
    A checkpoint's quantized parts concatenate their codes and scales (QuantizedWeight.cat); packed parts (GGUF blocks
    computed as stored) stay parts of one PackedWeight, each in its own format; a packed part among float ones is
    dequantized (no file we read mixes them in one projection)."""
    parts = [w.pop(n) for n in names]
    if all(isinstance(p, PackedWeight) for p in parts):
        return PackedWeight.cat(parts)
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight.cat(parts)
    if any(isinstance(p, (PackedWeight, Int4Weight)) for p in parts):
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        parts = [p.dequantized(dtype) if isinstance(p, (PackedWeight, Int4Weight)) else p for p in parts]
    if any(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)
    return torch.cat(parts)


@dataclass(slots=True)
class MoE:
    """A sparse MLP: a router picks `top_k` experts per token (softmax over all experts, then the top k,
    renormalised where the family does: Mixtral always, Qwen with norm_topk_prob), each expert a gated MLP;
    Qwen2-MoE adds a shared expert scaled by a sigmoid gate. Tokens are grouped by expert so each expert runs
    one matmul over its tokens; a token's expert outputs are summed in the fixed order of their top-k rank,
    so a row's result does not depend on which rows share the step."""
    router: Linear  # [experts, hidden]
    experts: list[MLP]
    top_k: int
    renormalize: bool
    shared: MLP | None = None
    shared_gate: Linear | None = None  # [1, hidden]

    def __call__(self, x: torch.Tensor, ops, lora: LoraStep | None = None) -> torch.Tensor:
        """`lora`: unused (adapters are refused on mixture-of-experts layers: lora/apply.py)."""
        t, k = x.shape[0], self.top_k
        with scope("linear"):
            probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, k, dim=-1)  # [T, k], by rank
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).reshape(-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, rank) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                out[pairs] = self.experts[e](x[pairs // k], ops) * weights[pairs, None]
                start += n
        out = out.view(t, k, -1)
        y = out[:, 0]
        for r in range(1, k):  # rank order, whatever the batch
            y = y + out[:, r]
        if self.shared is not None:
            with scope("linear"):
                gate = torch.sigmoid(self.shared_gate(x))
            y = y + gate * self.shared(x, ops)
        return y
