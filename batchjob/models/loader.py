"""Loading a model: the spec found (location.py: a built-in name, a path, or an id in the local Hugging Face
cache), then an HF folder (hf_folder.py) or a GGUF file (gguf_file.py) read into a LoadedModel (weights.py).

Weights never come from pickle files: only safetensors and GGUF are read. Nothing here touches the network.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from batchjob.errors import ModelLoadError
from batchjob.models.config import UnsupportedModelError
from batchjob.models.gguf_file import gguf_config, load_gguf
from batchjob.models.hf_folder import folder_shard, hf_config, load_hf_folder
from batchjob.models.identity import gguf_identity, hf_identity, open_gguf, safetensors_files
from batchjob.models.location import (BUILTIN_MODELS, hf_cache_snapshot, hf_hub_cache, model_source, resolve_model_path,
                                      resolve_model_spec)
from batchjob.models.weights import LoadedModel

__all__ = ["BUILTIN_MODELS", "LoadedModel", "ModelLoadError", "UnsupportedModelError", "hf_cache_snapshot", "hf_hub_cache",
           "load_model", "resolve_model_path"]


def load_model(spec: str | Path = "smollm2", dtype: torch.dtype = torch.float32, int8_codes: bool = False,
               fp8_codes: bool = False, blocks: bool = False, rank_of: tuple[int, int] | None = None) -> LoadedModel:
    """`blocks`: a GGUF file's block-quantized matrices stay in their blocks, computed as stored (for a CPU model
    with --quantization auto; gguf_file.py). `int8_codes`: for a model built with --quantization int8, a GGUF file's Q8_0 matrices stay int8 codes with
    their block scales (gguf_file.py); a compressed-tensors folder's int8 codes always do. `fp8_codes`: for a
    device that computes fp8 (kernels/quantization.py keeps_fp8_codes), a compressed-tensors W8A8 fp8 folder's
    codes stay codes (LoadedModel.quantization "fp8"); else they are dequantized at load. `rank_of` (rank, world): that
    tensor-parallel rank's slice only (an HF folder's; models/tensor_parallel.py)."""
    path, hf_id = resolve_model_spec(str(spec))
    source = model_source(path)
    if source.is_dir():
        loaded = load_hf_folder(source, dtype, fp8_codes=fp8_codes, rank_of=rank_of)
        return dataclasses.replace(loaded, name=hf_id) if hf_id else loaded  # not the snapshot's commit hash
    if rank_of is not None:
        raise _gguf_split(source)
    return load_gguf(source, dtype, int8_codes=int8_codes, blocks=blocks)


def check_split(spec: str | Path, world: int) -> None:
    """Raises UnsupportedModelError unless the model splits over `world` tensor-parallel ranks (before any starts)."""
    path, _ = resolve_model_spec(str(spec))
    source = model_source(path)
    if not source.is_dir():
        raise _gguf_split(source)
    folder_shard(source, *hf_config(source), 0, world)


def _gguf_split(source: Path) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: tensor parallel over a GGUF file is not implemented; it reads Hugging Face "
                                 "folders (safetensors) only")


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What a model is without its weights: LoadedModel's identity, name and what a pre-quantized checkpoint fixes."""
    identity: dict
    name: str
    quantization: str | None = None
    quantization_scheme: str = ""


def describe_model(spec: str | Path = "smollm2", fp8_codes: bool = False) -> ModelDescription:
    """The model's LoadedModel fields but its weights and tokenizer, read from its config and headers only (for a
    job with nothing to compute: an empty input)."""
    path, hf_id = resolve_model_spec(str(spec))
    source = model_source(path)
    if source.is_dir():
        config, quant = hf_config(source, fp8_codes)
        identity = hf_identity(source, safetensors_files(source), config.architecture)
        if quant is None:
            return ModelDescription(identity, hf_id or source.name)
        return ModelDescription(identity, hf_id or source.name, quant.quantization, quant.scheme)
    reader = open_gguf(source)
    _, config = gguf_config(source, reader)
    return ModelDescription(gguf_identity(source, reader, config.architecture), source.stem)
