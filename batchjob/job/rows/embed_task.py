"""The embed task's job-level part: the pooling a model folder asks for (sentence-transformers'
`1_Pooling/config.json`) when the job sets none. The pooling itself is the engine's (engine/worker/pooler.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from batchjob.job.options.config import ConfigError, JobConfig
from batchjob.job.options.modes import Pooling, Task

# sentence-transformers' pooling modes -> ours; the first one set wins (a config sets one)
_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


def folder_pooling(model_path: Path) -> str | None:
    """The pooling of an HF folder's `1_Pooling/config.json`, or None (no such file, or a .gguf file)."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    try:
        modes = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"pooling: cannot read {config}: {e}; pass --pooling last|mean|cls") from None
    for key, ours in _MODES:
        if modes.get(key):
            return ours
    unsupported = sorted(k for k, v in modes.items() if k.startswith("pooling_mode") and v)
    raise ConfigError(f"pooling: {config} asks for {', '.join(unsupported) or 'no pooling mode'}; supported: last, "
                      "mean, cls; pass --pooling")


def resolve_pooling(cfg: JobConfig, model_path: Path) -> JobConfig:
    """The job with its pooling resolved: an embed job without `pooling` takes the model folder's, else `last`
    (before the fingerprint)."""
    if cfg.task == Task.EMBED and cfg.pooling is None:
        return dataclasses.replace(cfg, pooling=Pooling(folder_pooling(model_path) or Pooling.LAST))
    return cfg
