"""The errors a caller can catch, the API's chat warning, and the exit codes of `batchjob run`: one leaf module
that every layer may import, so an error keeps its type from the layer that raises it to the command line or
the Python API."""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # every row failed, --max-errors was exceeded, or the job could not start
EXIT_USAGE = 2  # as click's own usage errors: a bad flag, job file or value
EXIT_RESUMABLE = 75  # EX_TEMPFAIL, "try again later": stopped by a signal after committing; rerun to continue
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped at once (a second Ctrl-C, or Ctrl-C during start-up)


class ConfigError(ValueError):
    """A job file, flag or argument that cannot run as given; the message names the field and what to do."""


class ModelLoadError(Exception):
    """A model that cannot be found or read: the message names the file and what to do."""


class KvBudgetError(RuntimeError):
    """The model and its largest step leave no room for a KV cache on this device (engine/worker/kv_budget.py)."""


class RankLostError(RuntimeError):
    """A tensor-parallel rank ended mid-job (engine/tensor_parallel.py): the model lost its slice, so the job stops;
    what it committed stays, and a rerun resumes."""


class ChatHintWarning(UserWarning):
    """`generate()` of plain prompts into a model with a chat template gave texts that ended at their first
    token: the model probably expects chat input (`chat=True` or `LLM.chat`)."""
