"""Which family runs a model: HF `architectures` / `model_type` and GGUF `general.architecture` -> a Family,
which reads its config, names its weights and builds its layers (models/families/). The engine, the job and
the bench get a CausalLM from `build_model` and never name a family."""
from __future__ import annotations

from collections.abc import Collection

import torch

from batchjob.kernels.linear_quant import Int4Weight, PackedWeight
from batchjob.kernels.quantization import MatmulFormat, QuantizedWeight, check_quantization, lm_head_linear
from batchjob.kernels.modes import Quantization
from batchjob.models.adapters import ModelAdapters
from batchjob.models.causal_lm import CausalLM
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.decoder import DecoderLM
from batchjob.models.family import BuildSpec, Family
from batchjob.models.tensor_parallel import RankGroup
from batchjob.models.families import gemma, gemma3, idefics3, llama, llava, moe, olmo2, phi3, qwen2_vl


FAMILIES: list[Family] = [llama.FAMILY, gemma.FAMILY, phi3.FAMILY, olmo2.FAMILY, moe.FAMILY, llava.FAMILY, idefics3.FAMILY,
                          qwen2_vl.FAMILY, gemma3.FAMILY]


def supported() -> list[str]:
    """Every HF architecture we run, for error messages and the docs."""
    return [a for f in FAMILIES for a in f.hf_architectures]


def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    archs = cfg.get("architectures") or []
    for fam in FAMILIES:
        variant = next((fam.hf_architectures[a] for a in archs if a in fam.hf_architectures), None)
        if variant is not None:
            return fam.parse_hf(cfg, variant, source)
    for fam in FAMILIES:
        if cfg.get("model_type") in fam.model_types:
            return fam.parse_hf(cfg, fam.model_types[cfg["model_type"]], source)
    raise UnsupportedModelError(f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                                f"supported: {', '.join(supported())}")


def config_from_gguf(meta: dict, tensor_names: Collection[str], source: str = "GGUF") -> ModelConfig:
    arch = meta.get("general.architecture")
    for fam in FAMILIES:  # in order: one GGUF architecture can be two families' (`llama`: Llama, or with experts Mixtral)
        if arch in fam.gguf_architectures and fam.parse_gguf is not None:
            config = fam.parse_gguf(meta, tensor_names, fam.gguf_architectures[arch], source)
            if config is not None:
                return config
    known = dict.fromkeys(a for f in FAMILIES if f.parse_gguf is not None for a in f.gguf_architectures)
    raise UnsupportedModelError(f"{source}: GGUF architecture {arch!r} is not supported; supported: {', '.join(known)}")


def family_of(config: ModelConfig) -> Family:
    for fam in FAMILIES:
        if config.architecture in (*fam.hf_architectures.values(), *fam.model_types.values(), *fam.gguf_architectures.values()):
            return fam
    raise UnsupportedModelError(f"architecture {config.architecture!r} belongs to no family")


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return family_of(config).weight_shapes(config)


def canonical_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights under the names its family's weight_shapes uses."""
    rename = family_of(config).canonical_name
    return weights if rename is None else {rename(name): t for name, t in weights.items()}


# matmuls that run in the compute dtype whatever the checkpoint stores: the MoE routers (routing is sensitive to them)
FLOAT_MATMULS = (".gate.weight", "shared_expert_gate.weight")
_EMBEDDINGS = "embed_tokens.weight"  # a lookup: in the compute dtype, unless packed (looked up as stored)


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu",
                kernels: str = "auto", block_size: int = 16, kv_cache_dtype: str = "auto", quantization: str = "none",
                quantize_lm_head: bool = True, prequantized: bool = False,
                adapters: ModelAdapters | None = None, parallel: RankGroup | None = None) -> CausalLM:
    """The model for `config` from HF-named weights. Raises kernels.KernelError for kernels that cannot run here,
    QuantizationError for a `quantization` (none | int8 | fp8, kernels/quantization.py) that cannot. Under int8
    the weight matmuls are quantized as they are built, the LM head among them unless `quantize_lm_head` is False
    (no job option: for bench/int8_quality.py's comparison, docs/guide/quantization.md); under fp8 too, the LM
    head kept in the compute dtype. `prequantized`: the checkpoint's int8 or fp8 codes are the model's
    (LoadedModel.prequantized): its float weights (the LM head, what its `ignore` list names) stay in the compute
    dtype. A QuantizedWeight (a checkpoint's codes) runs under int8 or fp8 and is dequantized to `dtype`
    otherwise; the embeddings and MoE routers always are. A PackedWeight (GGUF blocks, int4 groups) is computed as
    stored on a CPU, embeddings included (looked up as stored), unless int8 or fp8 asks for those kernels (then it is
    dequantized first and quantized as they do); on another device, and for the routers, it is dequantized.
    `adapters`: LoRA adapters the model is built with (lora/apply.py AdapterSet), on the projections they target.
    `parallel`: the weights are one tensor-parallel rank's (models/tensor_parallel.py: `config` is its shard_config);
    the model sums and gathers across the ranks where its forward needs to.

    The model takes the weights: `weights` is emptied, and the family takes each layer's tensors out as it lays
    them out (fused projections, packed matmul weights), so a source tensor is freed once its final form
    exists and loading peaks near one copy of the weights. To build twice from one load, pass a copy of the
    dict (`dict(loaded.weights)`): its tensors are then kept."""
    if not weights:
        raise ValueError("build_model: no weights (a model took them already; pass dict(loaded.weights) to build "
                         "more than one model from a load)")
    dev = torch.device(device)
    check_quantization(quantization, dev)
    if prequantized and quantization not in (Quantization.INT8, Quantization.FP8, Quantization.INT4):
        raise ValueError(f"build_model: a pre-quantized checkpoint runs with its own quantization (int8, fp8 or int4), "
                         f"not {str(quantization)!r}")
    w = {}
    w8 = quantization in (Quantization.INT8, Quantization.FP8)
    requantized = w8 or quantization == Quantization.INT4  # what the checkpoint stores is quantized another way
    for name in list(weights):
        t = weights.pop(name)
        if isinstance(t, PackedWeight) and (dev.type != "cpu" or requantized or name.endswith(FLOAT_MATMULS)):
            t = t.dequantized(dtype)
        elif isinstance(t, QuantizedWeight) and (not w8 or name.endswith((*FLOAT_MATMULS, _EMBEDDINGS))):
            t = t.dequantized(dtype)
        elif isinstance(t, Int4Weight) and (quantization != Quantization.INT4 or name.endswith((*FLOAT_MATMULS, _EMBEDDINGS))):
            t = t.dequantized(dtype)
        w[name] = t.to(device=dev, dtype=dtype)
    family = family_of(config)
    spec = BuildSpec(dtype, dev, MatmulFormat(quantization, lm_head=quantize_lm_head, prequantized=prequantized))
    parts = family.build(config, w, spec)
    for rope in parts.rotaries:
        rope.to(dev)
    return DecoderLM(config, parts.layers, parts.embed, parts.final_norm, lm_head_linear(spec.matmuls, parts.lm_head),
                     parts.rotaries, dtype, dev, kernels=kernels, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                     quantization=quantization, features=family.features, image_encoder=parts.image_encoder,
                     adapters=adapters, parallel=parallel)
