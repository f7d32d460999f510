"""The failures a run reports in one line and exit 1 (`batchjob run`, a Ray actor's shard), as opposed to a bug."""
from __future__ import annotations


def job_failures(with_torch: bool = True) -> tuple[type[Exception], ...]:
    """The errors that end a run with one line and exit 1, imported when asked for: some of their modules import
    torch, which the preflight's (`with_torch=False`) must not."""
    from batchjob.errors import KvBudgetError, ModelLoadError, RankLostError
    from batchjob.io.recovery import SinkError
    from batchjob.io.sources import SourceError
    from batchjob.job.error_budget import TooManyErrors

    light = (SourceError, ModelLoadError, SinkError, TooManyErrors, KvBudgetError, RankLostError)
    if not with_torch:
        return light
    from batchjob.kernels import KernelError
    from batchjob.models.config import UnsupportedModelError

    return (*light, UnsupportedModelError, KernelError)
