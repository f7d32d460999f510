"""Models kept loaded between runs of one process: a Ray actor or a data-parallel rank runs one shard of a job after
another (launch/shard_worker.py), and reloading the weights for each would cost seconds per shard. A run asks for its
models and gets the kept ones when they were built for the same job; each run still gets an engine of its own (a
fresh KV cache, scheduler and grammars: engine_setup.engine_for)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from batchjob.job.engine_setup import build_models
from batchjob.job.options.resolved import ResolvedJob
from batchjob.models.causal_lm import CausalLM
from batchjob.models.loader import LoadedModel


@dataclass(slots=True)
class BuiltModels:
    loaded: LoadedModel  # its weights moved into `model`; the tokenizer, config and identity stay
    model: CausalLM
    draft: CausalLM | None  # --speculative draft's proposer


class ModelKeeper:
    """The models of the last job asked for. Jobs are the same when their configs are equal apart from the shard
    (what one job's shards differ in) and their device, dtype and threads resolved alike."""

    def __init__(self) -> None:
        self._key: ResolvedJob | None = None
        self._models: BuiltModels | None = None
        self.loads = 0  # how many times a model was loaded (for tests and logs)

    def models(self, job: ResolvedJob) -> BuiltModels:
        key = replace(job, config=replace(job.config, shard=None))
        if self._models is None or self._key != key:
            self._models = None  # the old weights go before the new ones load
            loaded = job.load(job.config.model)
            self._models = BuiltModels(loaded, *build_models(job, loaded))
            self._key = key
            self.loads += 1
        return self._models
