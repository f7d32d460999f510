"""The job fingerprint: what makes a rerun the same job (the input by content, the model, the parameters),
recorded in the manifest so that a resume into results of another job is refused."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import Quantization, Task
from batchjob.job.options.options import DEFAULTS, OPTIONS, Identity
from batchjob.io.sources import Source
from batchjob.version import __version__

CONTENT_HASH_WHOLE_BYTES = 64 << 20  # an input file up to this size is hashed whole; a larger one by samples:
CONTENT_SAMPLES = 64  # this many windows spread evenly over the file, the first and the last bytes included,
CONTENT_SAMPLE_BYTES = 64 << 10  # of this size (4 MiB read per huge file)
_content_hashes: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> hash: a sharded run asks twice

# the options that make a rerun the same job (job/options/options.py): always recorded, or only when set (an option added
# later: without it, an older job's fingerprint stays the same)
PARAM_FIELDS = tuple(name for name, o in OPTIONS.items() if o.identity is Identity.ALWAYS)
WHEN_SET_FIELDS = tuple(name for name, o in OPTIONS.items() if o.identity is Identity.WHEN_SET)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a fingerprint knows of the model that runs: its identity (models/identity.py), the compute dtype's
    name ("bfloat16") and the format its weight matmuls run in (none | int8 | fp8: a pre-quantized checkpoint's
    own under --quantization auto; job/options/resolved.py ResolvedJob.quantization)."""
    identity: dict
    dtype: str
    quantization: str


def fingerprint(cfg: JobConfig, source: Source, input_path: str, model: ModelFacts) -> dict:
    """Plain data, no torch: a rerun can be told from another job before torch is imported (job/process/preflight.py)."""
    params = {k: v for k, v in asdict(cfg).items() if k in PARAM_FIELDS}
    params["dtype"] = model.dtype
    params.update({name: getattr(cfg, name) for name in WHEN_SET_FIELDS if getattr(cfg, name) != DEFAULTS[name]})
    if model.quantization != Quantization.NONE:  # int8 compute changes the text (absent: the compute dtype, as before)
        params["quantization"] = model.quantization
    if cfg.adapters:  # each LoRA adapter by content: a retrained adapter under the same path is another job
        params["adapters"] = {name: [path, *(content_hash(Path(path) / f) for f in ("adapter_config.json",
                                                                                   "adapter_model.safetensors")
                                             if (Path(path) / f).is_file())]
                              for name, path in cfg.adapters.items()}
    structured = cfg.structured_outputs()
    if structured is not None:  # the job's grammar (a schema file's content, not its name); absent: none, as before
        params["structured_outputs"] = structured
    if cfg.task == Task.EMBED:  # absent: generate, as before
        params["task"] = {"task": cfg.task, "pooling": cfg.pooling, "normalize": cfg.normalize,
                          "dimensions": cfg.dimensions, "embed_prefix": cfg.embed_prefix,
                          **({"truncate": True} if cfg.truncate else {})}  # absent: off, as before
    elif cfg.task == Task.SCORE:
        params["task"] = {"task": cfg.task, "continuation_column": cfg.continuation_column}
    fp = {"batchjob": __version__, "input": input_identity(Path(input_path), source),
          "model": model.identity, "params": json.loads(json.dumps(params))}  # as the manifest holds it: modes as text
    if (shard := source.shard()) is not None:
        fp["shard"] = shard
    return fp


def input_identity(path: Path, source: Source) -> dict:
    """The input as the job fingerprint knows it: the format, the columns, and each data file's name
    (under the input folder), size and content hash. By content, not by mtime or location: a copied,
    moved or touched input still resumes; a changed byte forces --restart (in a huge file, a changed
    size or a byte inside a sampled window)."""
    files = [[f.relative_to(path).as_posix() if path.is_dir() else f.name, f.stat().st_size, content_hash(f)]
             for f in source.whole.files]  # a shard reads its whole input's files
    return {"format": source.format_name, "files": files, "columns": list(source.columns)}


def content_hash(file: Path) -> str:
    """SHA-256 of the file, or of CONTENT_SAMPLES windows of it when it is over CONTENT_HASH_WHOLE_BYTES."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _content_hashes:
        return _content_hashes[key]
    with open(file, "rb") as f:
        if st.st_size <= CONTENT_HASH_WHOLE_BYTES:
            digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
        else:
            h = hashlib.sha256()
            last = max(st.st_size - CONTENT_SAMPLE_BYTES, 0)
            for i in range(CONTENT_SAMPLES):
                f.seek(last * i // max(CONTENT_SAMPLES - 1, 1))
                h.update(f.read(CONTENT_SAMPLE_BYTES))
            digest = f"sha256-sampled-{CONTENT_SAMPLES}x{CONTENT_SAMPLE_BYTES}:" + h.hexdigest()
    _content_hashes[key] = digest
    return digest
