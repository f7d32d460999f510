"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a flattened token batch.

`forward(input_ids, positions, meta, kv_caches)` sees only flat tensors: no request objects, no padding
of the batch, no per-row loops. Q/K/V and gate/up projections are fused into one matmul each at load
time, every weight is laid out for the device once (`kernels/linear.py`), and the KV store and paged
attention run on the kernel set chosen at load (`kernels/dispatch.py`: torch, native or triton).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.kernels import AttentionMetadata, Linear, RotaryEmbedding, apply_rotary, rms_norm, select_kernels
from batchjob.kernels.profiling import scope
from batchjob.models.config import ModelConfig


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu",
                 kernels: str = "auto", block_size: int = 16):
        """`kernels`: auto | torch | native | triton (kernels/dispatch.py), for KV blocks of `block_size`
        tokens (the engine refits them to its own, `fit_kernels`). Raises kernels.KernelError for a choice
        that cannot run here."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.kernel_choice = kernels
        self.block_size = block_size
        self.kernels = select_kernels(kernels, self.device, dtype, c.head_dim, c.num_heads // c.num_kv_heads, block_size)
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = Linear(self.embed if c.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"])
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "in_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "qkv": Linear(
                    torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                    torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]) if c.attention_bias else None,
                ),
                "o": Linear(w[a + "o_proj.weight"]),
                "gate_up": Linear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                "down": Linear(w[p + "mlp.down_proj.weight"]),
                "q_norm": w.get(a + "q_norm.weight"),
                "k_norm": w.get(a + "k_norm.weight"),
            }
            self.layers.append(layer)
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
            self.kernels = select_kernels(self.kernel_choice, self.device, self.dtype, c.head_dim, c.num_heads // c.num_kv_heads, block_size)
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
            x = ops.rms_norm(h, self.layers[0]["in_norm"], eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            with scope("linear"):
                qkv = layer["qkv"](x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            with scope("rotary"):
                if layer["q_norm"] is not None:
                    q = rms_norm(q, layer["q_norm"], eps)
                    k = rms_norm(k, layer["k_norm"], eps)
                q, k = ops.rotary(q, k, rope)
            with scope("kv_store"):
                ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            with scope("attention"):
                o = ops.attention(q, k_cache, v_cache, meta, self.scale, self.window)
            with scope("linear"):
                o = layer["o"](o.view(t, self.q_size))
            with scope("norm"):
                x = ops.add_rms_norm(o, h, layer["post_norm"], eps)
            with scope("linear"):
                gate_up = layer["gate_up"](x)
            with scope("silu_mul"):
                x = ops.silu_mul(gate_up)
            with scope("linear"):
                x = layer["down"](x)
            with scope("norm"):
                last = i + 1 == len(self.layers)
                x = ops.add_rms_norm(x, h, self.final_norm if last else self.layers[i + 1]["in_norm"], eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs to (greedy rows take the
        argmax of bf16 logits as of their fp32 copy: the widening is exact and keeps the order)."""
        with scope("logits"):
            return self.lm_head(hidden)
