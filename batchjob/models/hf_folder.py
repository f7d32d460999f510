"""An HF model folder: config.json, safetensors weights (one file or an index of shards), tokenizer files.
Pickle checkpoints are refused: loading them could run arbitrary code."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from batchjob.models.compressed_tensors import CompressedTensors, compressed_tensors
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.registry import canonical_weights, config_from_hf
from batchjob.models.tensor_parallel import TensorShard
from batchjob.models.tokenizer import Tokenizer
from batchjob.models.identity import hf_identity, safetensors_files
from batchjob.models.weights import LoadedModel, ModelLoadError, checked_weights



MAP_BYTES = 64 << 20  # bytes read through one mapping of a shard before it is closed and reopened


def hf_config(folder: Path, fp8_codes: bool = False) -> tuple[ModelConfig, CompressedTensors | None]:
    """The folder's config.json read: the model config and, for a compressed-tensors checkpoint, its quantization."""
    config_json = json.loads((folder / "config.json").read_text())
    quant = compressed_tensors(config_json, source=str(folder / "config.json"), fp8_codes=fp8_codes)
    return config_from_hf(config_json, source=str(folder / "config.json")), quant


def folder_shard(folder: Path, config: ModelConfig, quant: CompressedTensors | None, rank: int,
                 world: int) -> TensorShard:
    """Rank `rank` of `world` of the folder's model; raises UnsupportedModelError for one that does not split so."""
    if quant is not None:
        raise UnsupportedModelError(f"{folder}: tensor parallel over a quantized checkpoint ({quant.scheme}) is not "
                                    "implemented; use a float checkpoint")
    return TensorShard.of(config, rank, world, source=str(folder))


def load_hf_folder(folder: Path, dtype: torch.dtype, fp8_codes: bool = False,
                   rank_of: tuple[int, int] | None = None) -> LoadedModel:
    """A compressed-tensors checkpoint's codes and scales are read as stored (models/compressed_tensors.py: W8A8
    int8 codes and W4A16 packed ones kept as they are, W8A8 fp8 ones only with `fp8_codes`, else dequantized here).
    `rank_of` (rank, world): only that tensor-parallel rank's slice of each weight is read (models/tensor_parallel.py);
    the LoadedModel's `shard` says which."""
    config, quant = hf_config(folder, fp8_codes)  # refused before reading weights
    split = None if rank_of is None else folder_shard(folder, config, quant, *rank_of)
    shards = safetensors_files(folder)
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                names = list(f.keys())
            # reopened every MAP_BYTES: the file's pages read so far leave this process's memory at each close
            # (a mapping keeps them resident), so loading peaks near one copy of the weights, not file + copy
            while names:
                with safe_open(str(shard), framework="pt") as f:
                    taken = 0
                    while names and taken < MAP_BYTES:
                        name = names.pop(0)
                        if split is None:
                            t = f.get_tensor(name)
                        else:
                            part = f.get_slice(name)
                            t = split.take(name, tuple(part.get_shape()), part.__getitem__)
                        taken += t.numel() * t.element_size()
                        weights[name] = t if quant is not None and quant.keeps(t, name) else t.to(dtype)
        except Exception as e:  # the Rust reader raises its own error type for every kind of damage
            raise ModelLoadError(f"{shard}: not a readable safetensors file, probably truncated or damaged "
                                 f"({shard.stat().st_size:,} bytes; {e}); copy or download it again") from None
    if quant is not None:
        weights = quant.weights(weights, dtype)
    weights = checked_weights(config if split is None else split.shard_config(), canonical_weights(config, weights),
                              source=str(folder))
    try:
        tokenizer = Tokenizer.from_hf_dir(folder)
    except FileNotFoundError as e:
        raise ModelLoadError(str(e)) from e

    identity = hf_identity(folder, shards, config.architecture)
    if quant is None:
        return LoadedModel(config, weights, tokenizer, identity, name=folder.name, shard=split)
    return LoadedModel(config, weights, tokenizer, identity, name=folder.name, quantization=quant.quantization,
                       quantization_scheme=quant.scheme)
