"""An HF model folder: config.json, safetensors weights (one file or an index of shards), tokenizer files.
Pickle checkpoints are refused: loading them could run arbitrary code."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from batchjob.models.compressed_tensors import compressed_tensors
from batchjob.models.registry import config_from_hf
from batchjob.models.tokenizer import Tokenizer
from batchjob.models.weights import LoadedModel, ModelLoadError, checked_weights, sha256_file

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


MAP_BYTES = 64 << 20  # bytes read through one mapping of a shard before it is closed and reopened


def load_hf_folder(folder: Path, dtype: torch.dtype, fp8_codes: bool = False) -> LoadedModel:
    """A compressed-tensors checkpoint's codes and scales are read as stored (models/compressed_tensors.py; W8A8
    fp8 ones kept as codes only with `fp8_codes`, else dequantized here)."""
    config_json = json.loads((folder / "config.json").read_text())
    # refused before reading weights
    quant = compressed_tensors(config_json, source=str(folder / "config.json"), fp8_codes=fp8_codes)
    config = config_from_hf(config_json, source=str(folder / "config.json"))
    shards = _safetensors_files(folder)
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
                        t = f.get_tensor(name)
                        taken += t.numel() * t.element_size()
                        weights[name] = t if quant is not None and quant.keeps(t, name) else t.to(dtype)
        except Exception as e:  # the Rust reader raises its own error type for every kind of damage
            raise ModelLoadError(f"{shard}: not a readable safetensors file, probably truncated or damaged "
                                 f"({shard.stat().st_size:,} bytes; {e}); copy or download it again") from None
    if quant is not None:
        weights = quant.weights(weights, dtype)
    weights = checked_weights(config, weights, source=str(folder))
    try:
        tokenizer = Tokenizer.from_hf_dir(folder)
    except FileNotFoundError as e:
        raise ModelLoadError(str(e)) from e

    small = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    identity = {
        "format": "hf",
        "path": str(folder),
        "architecture": config.architecture,
        "files": [
            {"name": p.name, "size": p.stat().st_size}
            for p in sorted({*shards, *(folder / n for n in small)})
            if p.is_file()
        ],
        # small files are hashed whole; weight shards are named and sized only (hashing GBs is too slow)
        "sha256": {n: sha256_file(folder / n) for n in small if (folder / n).is_file()},
        # ... plus their header (names, dtypes, shapes, offsets) and 3 MiB of the weights, so retrained
        # weights of the same shapes are a different model too
        "weights_sample_sha256": {p.name: _sample_sha256(p) for p in shards},
    }
    if quant is None:
        return LoadedModel(config, weights, tokenizer, identity, name=folder.name)
    return LoadedModel(config, weights, tokenizer, identity, name=folder.name, quantization=quant.quantization,
                       quantization_scheme=quant.scheme)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in {index.name} are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{folder}: weights are only in pickle format ({', '.join(pickles)}); loading them could run "
            "arbitrary code, so they are refused. Convert the checkpoint to safetensors first."
        )
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _sample_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a safetensors file's header and of `chunk` bytes at the start, middle and end of its data."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(0)
        h.update(f.read(min(8 + header, size)))
        for at in (8 + header, max(8 + header, size // 2), max(8 + header, size - chunk)):
            f.seek(at)
            h.update(f.read(chunk))
    return h.hexdigest()
