"""What a model is, for a job's fingerprint (job/options/fingerprint.py), read from its files without loading its weights
and without importing torch: so that a rerun of a finished job can be recognised before anything heavy starts
(job/process/preflight.py), and the loaders record the same dict (hf_folder.py, gguf_file.py). Also where a GGUF file is
opened, with the errors a damaged one gets."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import gguf
import numpy as np

from batchjob.errors import ModelLoadError

HF_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def model_identity(source: Path, architecture: str) -> dict:
    """The identity of the HF folder or .gguf file `source` (location.model_source). `architecture` is the
    family's name for it (ModelConfig.architecture), which only the model registry knows (it imports torch); it
    follows from the files hashed here, so a caller without it passes the one recorded before."""
    if source.is_dir():
        return hf_identity(source, safetensors_files(source), architecture)
    return gguf_identity(source, open_gguf(source), architecture)


def hf_identity(folder: Path, shards: list[Path], architecture: str) -> dict:
    """Small files hashed whole; weight shards named and sized (hashing GBs is too slow), plus their header (names,
    dtypes, shapes, offsets) and 3 MiB of the weights, so retrained weights of the same shapes are a different model."""
    return {
        "format": "hf",
        "path": str(folder),
        "architecture": architecture,
        "files": [
            {"name": p.name, "size": p.stat().st_size}
            for p in sorted({*shards, *(folder / n for n in HF_SMALL_FILES)})
            if p.is_file()
        ],
        "sha256": {n: sha256_file(folder / n) for n in HF_SMALL_FILES if (folder / n).is_file()},
        "weights_sample_sha256": {p.name: _sample_sha256(p) for p in shards},
    }


def gguf_identity(path: Path, reader: gguf.GGUFReader, architecture: str) -> dict:
    """The header, metadata and tensor table (names, types, shapes, offsets, tokenizer and template) hashed."""
    return {
        "format": "gguf",
        "path": str(path),
        "architecture": architecture,
        "files": [{"name": path.name, "size": path.stat().st_size}],
        "gguf_header_sha256": sha256_file(path, limit=int(reader.data_offset)),
    }


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return _FastGGUFReader(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - the reader fails in many ways on a short file (IndexError, reshape)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)") from None
        raise ModelLoadError(f"{path}: the GGUF file is truncated or damaged: its header or a tensor runs past the "
                             f"end of the file ({path.stat().st_size:,} bytes; {type(e).__name__}: {e}); copy or "
                             f"download it again") from None


class _FastGGUFReader(gguf.GGUFReader):
    """gguf's reader, with the same fields, parts and tensors, made fast where a file is large in metadata.

    GGUFReader builds an array field one element at a time (a vocabulary: ~150k calls, each making several numpy views
    of its np.memmap): SmolLM2's 49k tokens, merges, scores and types took 1.6-2.0 s of its 2.9-s load on a 2-core
    Zen 3. Here an array of numbers is one view split into its elements, and an array of strings is walked over the
    file's bytes, each element's parts (its length and its bytes) views of the same mapping as gguf's: 0.1 s. Nested
    arrays and byte-swapped files take gguf's own path."""

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        # memmap slicing is slow (~100k slices for a vocabulary): a plain ndarray view of the same mapping
        self._data = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        if count == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        types = [gguf.GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError(f"array field at {orig_offs} runs past the end of the file")
            # one part per element, as gguf makes them: rows of an (n, 1) view
            return 12 + int(values.nbytes), [raw_itype, alen, *values.reshape(count, 1)], list(range(2, 2 + count)), types
        if itype != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, end = self._data, len(self._data)
        raw = memoryview(data)
        parts: list = [raw_itype, alen]
        for _ in range(count):
            if offs + 8 > end:
                raise ValueError(f"string array at {orig_offs} runs past the end of the file")
            size = int.from_bytes(raw[offs:offs + 8], "little")
            if offs + 8 + size > end:
                raise ValueError(f"string array at {orig_offs} runs past the end of the file")
            parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + size])
            offs += 8 + size
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types


def safetensors_files(folder: Path) -> list[Path]:
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
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{folder}: weights are only in pickle format ({', '.join(pickles)}); loading them could run "
            "arbitrary code, so they are refused. Convert the checkpoint to safetensors first."
        )
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def sha256_file(path: Path, limit: int | None = None) -> str:
    """SHA-256 of the file, or of its first `limit` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit if limit is not None else float("inf")
        while remaining > 0 and (chunk := f.read(int(min(1 << 20, remaining)))):
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


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
