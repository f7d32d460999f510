"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a flattened token batch.

`forward(input_ids, positions, meta, kv_caches)` sees only flat tensors: no request objects, no padding
of the batch, no per-row loops. Each layer's weights are a typed `DecoderLayer` built once at load, with
Q/K/V and gate/up fused into one matmul each and every weight laid out for the device (`kernels/linear.py`);
the KV store and paged attention run on the kernel set chosen at load (`kernels/dispatch.py`: torch,
native or triton).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.kernels import AttentionMetadata, Linear, RotaryEmbedding, rms_norm, select_kernels
from batchjob.kernels.profiling import scope
from batchjob.models.config import ModelConfig


@dataclass(slots=True)
class Attention:
    qkv: Linear  # q, k and v projections fused: one matmul
    o: Linear
    q_norm: torch.Tensor | None  # per-head RMSNorm of q and k before rotary (Qwen3); None elsewhere
    k_norm: torch.Tensor | None


@dataclass(slots=True)
class MLP:
    gate_up: Linear  # gate and up projections fused: one matmul
    down: Linear


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    attn: Attention
    post_attention_norm: torch.Tensor
    mlp: MLP

    @classmethod
    def from_hf(cls, w: dict[str, torch.Tensor], i: int, attention_bias: bool) -> DecoderLayer:
        """Layer `i` from weights under HF names (model.layers.{i}.*), already on the model's device and dtype."""
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]) if attention_bias else None
        return cls(
            input_norm=w[p + "input_layernorm.weight"],
            attn=Attention(
                qkv=Linear(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]), qkv_bias),
                o=Linear(w[a + "o_proj.weight"]),
                q_norm=w.get(a + "q_norm.weight"),
                k_norm=w.get(a + "k_norm.weight"),
            ),
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
            mlp=MLP(
                gate_up=Linear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                down=Linear(w[p + "mlp.down_proj.weight"]),
            ),
        )


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu",
                 kernels: str = "auto", block_size: int = 16, kv_cache_dtype: str = "auto"):
        """`kernels`: auto | torch | native | triton (kernels/dispatch.py), for KV blocks of `block_size`
        tokens (the engine refits them to its own, `fit_kernels`). Raises kernels.KernelError for a choice
        that cannot run here."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.kernel_choice = kernels
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype  # auto (the compute dtype) | int8 | int4 (kernels/reference/kv_quant.py)
        self.kernels = select_kernels(kernels, self.device, dtype, c.head_dim, c.num_heads // c.num_kv_heads, block_size,
                                      kv_cache_dtype=kv_cache_dtype)
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = Linear(self.embed if c.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"])
        self.final_norm = w["model.norm.weight"]
        self.layers = [DecoderLayer.from_hf(w, i, c.attention_bias) for i in range(c.num_layers)]
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype)
        self.rotary.cos = self.rotary.cos.to(self.device)
        self.rotary.sin = self.rotary.sin.to(self.device)
        self.scale = c.head_dim ** -0.5
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.window = c.sliding_window

    def fit_kernels(self, block_size: int) -> None:
        """Choose the kernels again for KV blocks of `block_size` tokens, when they differ from the ones chosen."""
        if block_size != self.block_size:
            c = self.config
            self.kernels = select_kernels(self.kernel_choice, self.device, self.dtype, c.head_dim, c.num_heads // c.num_kv_heads,
                                          block_size, kv_cache_dtype=self.kv_cache_dtype)
            self.block_size = block_size

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normed); logits are computed only where needed."""
        c = self.config
        ops = self.kernels
        eps = c.rms_norm_eps
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place by add_rms_norm
        rope = ops.prepare_rotary(self.rotary, positions)
        with scope("norm"):
            x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            attn, mlp = layer.attn, layer.mlp
            with scope("linear"):
                qkv = attn.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            with scope("rotary"):
                if attn.q_norm is not None:
                    q = rms_norm(q, attn.q_norm, eps)
                    k = rms_norm(k, attn.k_norm, eps)
                q, k = ops.rotary(q, k, rope)
            with scope("kv_store"):
                ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            with scope("attention"):
                o = ops.attention(q, k_cache, v_cache, meta, self.scale, self.window)
            with scope("linear"):
                o = attn.o(o.view(t, self.q_size))
            with scope("norm"):
                x = ops.add_rms_norm(o, h, layer.post_attention_norm, eps)
            with scope("linear"):
                gate_up = mlp.gate_up(x)
            with scope("silu_mul"):
                x = ops.silu_mul(gate_up)
            with scope("linear"):
                x = mlp.down(x)
            with scope("norm"):
                last = i + 1 == len(self.layers)
                x = ops.add_rms_norm(x, h, self.final_norm if last else self.layers[i + 1].input_norm, eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs to (greedy rows take the
        argmax of bf16 logits as of their fp32 copy: the widening is exact and keeps the order)."""
        with scope("logits"):
            return self.lm_head(hidden)
