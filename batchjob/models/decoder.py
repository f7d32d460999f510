"""DecoderLM: a decoder-only model over a flattened token batch, the one CausalLM every family builds
(models/families/): embeddings (optionally scaled), its DecoderLayers, a final norm and the LM head (with an
optional final logit soft-cap).

`forward(step)` reads one StepContext (models/step_context.py): flat tensors, no request objects, no padding of
the batch, no per-row loops; a step that uses a feature the family does not declare is refused by name. The KV
store and paged attention run on the kernel set chosen at load
(kernels/dispatch.py: torch, native or triton); residual adds are fused into the next norm where a block
has one (`add_rms_norm`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from batchjob.kernels import RotaryEmbedding, mrope_rows, select_kernels
from batchjob.notices import notice
from batchjob.kernels.linear_quant import BlockQuantLinear, PackedWeight
from batchjob.kernels.profiling import scope
from batchjob.kernels.quantization import WeightMatmul
from batchjob.models.adapters import ModelAdapters
from batchjob.models.config import ModelConfig
from batchjob.models.layers import MLP, DecoderLayer, MoE
from batchjob.models.tensor_parallel import RankGroup
from batchjob.models.step_context import DECODER_FEATURES, ModelFeature, StepContext


class DecoderLM:
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], embed: torch.Tensor | PackedWeight,
                 final_norm: torch.Tensor,
                 lm_head: WeightMatmul, rotaries: list[RotaryEmbedding], dtype: torch.dtype, device: torch.device,
                 kernels: str = "auto", block_size: int = 16, kv_cache_dtype: str = "auto", quantization: str = "none",
                 features: frozenset[ModelFeature] = DECODER_FEATURES, image_encoder=None,
                 adapters: ModelAdapters | None = None, parallel: RankGroup | None = None):
        """`kernels`: auto | torch | native | triton (kernels/dispatch.py), for KV blocks of `block_size`
        tokens (the engine refits them to its own, `fit_kernels`). Raises kernels.KernelError for a choice
        that cannot run here. `adapters`: LoRA adapters, put on the projections now (lora/apply.py raises
        LoraError for one that does not fit). `parallel`: this model is one rank's slice of a model split over tensor-parallel
        ranks (models/tensor_parallel.py): `config` gives its own sizes but the vocabulary, which is the whole
        model's (the logits it returns are)."""
        self.parallel = parallel
        self.config = config if parallel is None else dataclasses.replace(config, vocab_size=parallel.shard.config.vocab_size)
        self.dtype = dtype
        self.device = device
        self.kernel_choice = kernels
        self.kv_cache_dtype = kv_cache_dtype  # auto (the compute dtype) | int8 | int4 (kernels/reference/kv_quant.py)
        self.quantization = quantization  # the weight matmuls' format (none | int8 | fp8), as build_model built them
        self.features = features  # what a step may carry (the family's declaration)
        # a vision-language family's: pixel values [B, 3, S, S] -> [B, tokens per image, hidden] (models/vision/)
        self.image_encoder = image_encoder
        self.adapters = adapters  # LoRA adapters on its projections (lora/apply.py), or None
        self.layers = layers
        self.embed = embed  # [vocab, hidden] in the compute dtype, or as a GGUF file stores it (looked up as stored)
        self.embed_scale = None if config.embed_scale is None else torch.tensor(config.embed_scale, dtype=dtype)
        self.final_norm = final_norm
        self.lm_head = lm_head  # in the format build_model built it (kernels/quantization.py lm_head_linear)
        self.rotaries = rotaries
        self.partial_rotary = any(layer.attn.rotary_dim and layer.attn.rotary_dim < config.head_dim for layer in layers)
        self.block_size = -1
        self.fit_kernels(block_size)
        if adapters is not None:
            self.features = features | {ModelFeature.LORA}
            adapters.put_on(self)

    def fit_kernels(self, block_size: int) -> None:
        """Choose the kernels for KV blocks of `block_size` tokens, when they differ from the ones chosen."""
        if block_size == self.block_size:
            return
        c = self.config
        self.kernels = select_kernels(self.kernel_choice, self.device, self.dtype, c.head_dim, c.num_heads // c.num_kv_heads,
                                      block_size, kv_cache_dtype=self.kv_cache_dtype, softcap=c.attn_logit_softcap)
        self.block_size = block_size

    def fit_context(self, max_model_len: int) -> None:
        rope = self.config.long_rope
        if rope is None:
            return
        long = max_model_len > rope.original
        for r in self.rotaries:
            r.use_long(long)
        if long:  # as vLLM warns: the long factors serve long contexts at some cost to short ones
            notice(f"{self.config.architecture}: longrope's long factors for a {max_model_len:,}-token context "
                        f"(over the {rope.original:,} it was pre-trained for); --max-model-len {rope.original} "
                        "uses the short ones, better for short rows")

    @torch.inference_mode()
    def forward(self, step: StepContext) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normed); logits are computed only where needed."""
        step.check(self.features, self.config.architecture)
        # the step's adapters (a step's own input, handed down to the layers: no state kept between steps)
        lora = None if step.adapter_ids is None else self.adapters.step(step.adapter_ids, self.dtype)
        ops, eps, positions, meta = self.kernels, self.config.rms_norm_eps, step.positions, step.meta
        h = self.embeddings(step)  # the residual stream, updated in place by add_rms_norm
        rotaries = self.rotaries
        if positions.dim() == 2:  # M-RoPE: each token's rotary row composed from its (t, h, w) positions
            rotaries = [mrope_rows(r, positions, self.config.extra["mrope_section"]) for r in rotaries]
            positions = torch.arange(positions.shape[1], device=positions.device)  # rows of the step's own tables
        ropes = [(ops.prepare_rotary(r, positions), r.table(positions) if self.partial_rotary else None)
                 for r in rotaries]
        first = self.layers[0].attn_norm
        with scope("norm"):
            x = ops.rms_norm(h, first, eps) if first is not None else h
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, step.kv_caches)):
            o = layer.attn(x, ropes, meta, k_cache, v_cache, ops, eps, lora)
            if self.parallel is not None:  # each rank's heads' share of the output projection
                o = self.parallel.all_reduce(o)
            with scope("norm"):
                if layer.post_attn_norm is not None:
                    o = ops.rms_norm(o, layer.post_attn_norm, eps)
                x = _add_norm(ops, o, h, layer.mlp_norm, eps)
            x = layer.mlp(x, ops, lora)
            if self.parallel is not None:
                x = self.parallel.all_reduce(x)
            with scope("norm"):
                if layer.post_mlp_norm is not None:
                    x = ops.rms_norm(x, layer.post_mlp_norm, eps)
                after = self.final_norm if i + 1 == len(self.layers) else self.layers[i + 1].attn_norm
                x = _add_norm(ops, x, h, after, eps)
        return x

    def weight_memory(self) -> dict[str, int]:
        """Bytes the language model's weights hold in memory per format ("Q4_K", "int8", "bfloat16", ...): every
        matmul as built (packed copies included), the embeddings (once where the LM head shares them) and the
        norms; not an image encoder's."""
        out: dict[str, int] = {}

        def add(memory: dict[str, int]) -> None:
            for fmt, n in memory.items():
                out[fmt] = out.get(fmt, 0) + n

        def tensor(t: torch.Tensor | None) -> None:
            if t is not None:
                add({str(t.dtype).removeprefix("torch."): t.numel() * t.element_size()})

        for layer in self.layers:
            a, mlp = layer.attn, layer.mlp
            add(a.qkv.memory())
            add(a.o.memory())
            for w in (a.qkv_lora, a.o_lora, *((mlp.gate_up_lora, mlp.down_lora) if isinstance(mlp, MLP) else ())):
                if w is not None:
                    add({"lora": w.memory()})
            for t in (a.q_norm, a.k_norm, layer.attn_norm, layer.post_attn_norm, layer.mlp_norm, layer.post_mlp_norm):
                tensor(t)
            mlps = [mlp] if isinstance(mlp, MLP) else [*mlp.experts, *([mlp.shared] if mlp.shared else [])]
            if isinstance(mlp, MoE):
                add(mlp.router.memory())
                if mlp.shared_gate is not None:
                    add(mlp.shared_gate.memory())
            for m in mlps:
                add(m.gate_up.memory())
                add(m.down.memory())
        tensor(self.final_norm)
        shared = isinstance(self.lm_head, BlockQuantLinear) and self.lm_head.weight is self.embed
        if isinstance(self.embed, PackedWeight):
            if not shared:
                add(self.embed.memory())
        else:
            tensor(self.embed)
        add(self.lm_head.memory())
        return out

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids' input embeddings (scaled as the family does): what a step's inputs_embeds start from."""
        here = None
        if self.parallel is not None:  # this rank's vocabulary rows; the others' tokens are zero here
            ids, here = self.parallel.embed_mask(ids)
        h = self.embed.rows(ids, self.dtype) if isinstance(self.embed, PackedWeight) else F.embedding(ids, self.embed)
        h = h if self.embed_scale is None else h * self.embed_scale
        return h if here is None else self.parallel.all_reduce(h * here)

    def embeddings(self, step: StepContext) -> torch.Tensor:
        """The step's input embeddings: given (a copy: the residual stream is written in place), or looked up and
        scaled where the family scales them (Gemma)."""
        if step.inputs_embeds is not None:
            return step.inputs_embeds.to(self.dtype, copy=True)
        return self.embed_tokens(step.input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs to (greedy rows take the
        argmax of bf16 logits as of their fp32 copy: the widening is exact and keeps the order). A final
        logit soft-cap (Gemma 2) applies here, before logprobs and sampling."""
        with scope("logits"):
            logits = self.lm_head(hidden)
            if self.parallel is not None:
                logits = self.parallel.gather_vocab(logits)
            cap = self.config.final_logit_softcap
            return logits if cap is None else self.kernels.softcap(logits, cap)


def _add_norm(ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """residual += x; then the next block's input: the norm of the residual, or the residual itself."""
    if weight is not None:
        return ops.add_rms_norm(x, residual, weight, eps)
    residual.add_(x)
    return residual
