"""How the driver runs shards on Ray (worker.py has what runs on the workers): ActorRunner, the default, keeps one
long-lived ShardWorker actor per shard slot and hands each the next shard when it finishes one (the model stays
loaded between them); TaskRunner submits one Ray task per shard and lets Ray queue and retry them. Either way a shard
is retried up to `max_retries` times, whether its process or node died or its run failed, and each shard's outcome
comes back as it ends."""
from __future__ import annotations

from collections import deque
from enum import Enum

from batchjob.errors import EXIT_RESUMABLE
from batchjob.launch.driver import Retries, ShardRunner
from batchjob.launch.shard_worker import ShardCall, ShardOutcome, ShardWorker
from batchjob.ray.worker import run_shard


class Runner(str, Enum):
    ACTORS = "actors"  # a long-lived actor per shard slot, the model loaded once (the default: docs/guide/ray.md)
    TASKS = "tasks"  # a Ray task per shard, each a `batchjob run` process of its own


def shard_slots(resources: dict, cpus_per_shard: int, gpus_per_shard: float) -> int:
    """How many shards the cluster runs at once: its GPUs, or its CPUs, over what a shard reserves (at least 1)."""
    if gpus_per_shard:
        return max(1, int(resources.get("GPU", 0) // gpus_per_shard))
    return max(1, int(resources.get("CPU", 1) // cpus_per_shard))


def outcome(ray, ref, index: int) -> ShardOutcome:
    try:
        return ray.get(ref)
    except ray.exceptions.TaskCancelledError:
        return ShardOutcome(index, EXIT_RESUMABLE)
    except ray.exceptions.RayActorError as e:  # the actor's process or node died, or it cannot be reached
        return ShardOutcome(index, 1, f"{type(e).__name__}: {e}", worker_lost=True)
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None)
        return ShardOutcome(index, 1, str(cause) if cause is not None else f"{type(e).__name__}: {e}")


class TaskRunner:
    """A Ray task per shard (`num_cpus`, `num_gpus`, `max_retries`, `retry_exceptions`): Ray queues them on the
    resources; each starts `batchjob run` as a child process, which loads the model."""

    def __init__(self, ray, call: ShardCall, *, cpus: int, gpus: float, max_retries: int) -> None:
        self.ray, self.call = ray, call
        self.task = ray.remote(run_shard).options(num_cpus=cpus, num_gpus=gpus, max_retries=max_retries,
                                                  retry_exceptions=True)
        self.refs: dict = {}  # ObjectRef -> shard

    def submit(self, shards: list[int]) -> None:
        self.refs.update({self.task.remote(self.call, k): k for k in shards})

    def poll(self, timeout: float) -> list[ShardOutcome]:
        if not self.refs:
            return []
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        return [outcome(self.ray, ref, self.refs.pop(ref)) for ref in ready]

    @property
    def busy(self) -> bool:
        return bool(self.refs)

    def stop(self) -> list[ShardOutcome]:
        for ref in self.refs:  # a task not started yet is cancelled; a running one drains (exit 75)
            self.ray.cancel(ref)
        ended = [outcome(self.ray, ref, k) for ref, k in self.refs.items()]
        self.refs.clear()
        return ended


class ActorRunner:
    """`slots` ShardWorker actors (`num_cpus`, `num_gpus`). The driver hands an idle actor the next shard, so shards
    balance over the actors as they finish and each actor loads its model once. The driver retries a failed shard
    itself, up to `max_retries` times, from its last commit: a shard whose run raised goes back to the front of the
    queue; a shard whose actor was lost (its process or node died, or it cannot be reached: Ray's restart of an actor
    waits until the node is declared dead, and does not retry every such call) gets a new actor in the lost one's
    place, wherever Ray finds it room (`max_restarts=0`, `max_task_retries=0`: what Ray would retry, the driver
    does). Once no shard is left to hand out, an idle actor is let go: a new actor may need its CPUs and GPUs."""

    def __init__(self, ray, call: ShardCall, *, cpus: int, gpus: float, max_retries: int, slots: int, log) -> None:
        self.ray, self.call = ray, call
        self.worker = ray.remote(ShardWorker).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                                                      max_task_retries=0)
        self.idle = [self.worker.remote(call) for _ in range(slots)]  # the last is handed a shard first
        self.queue: deque[int] = deque()
        self.refs: dict = {}  # ObjectRef -> (actor, shard)
        self.retries = Retries(max_retries, log, "actor")

    def submit(self, shards: list[int]) -> None:
        self.queue.extend(shards)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.idle and self.queue:
            actor, k = self.idle.pop(), self.queue.popleft()
            self.refs[actor.run.remote(k)] = (actor, k)

    def poll(self, timeout: float) -> list[ShardOutcome]:
        if not self.refs:
            return []
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        ended = []
        for ref in ready:
            actor, k = self.refs.pop(ref)
            result = outcome(self.ray, ref, k)
            if result.worker_lost:
                self.ray.kill(actor)  # if it is still there somewhere
                actor = self.worker.remote(self.call)
            final = self.retries.settle(result, self.queue)
            if final is not None:
                ended.append(final)
            self.idle.append(actor)
        self._dispatch()
        if not self.queue:
            for actor in self.idle:
                self.ray.kill(actor)
            self.idle.clear()
        return ended

    @property
    def busy(self) -> bool:
        return bool(self.refs or self.queue)

    def stop(self) -> list[ShardOutcome]:
        ended = [ShardOutcome(k, EXIT_RESUMABLE) for k in self.queue]  # never started
        self.queue.clear()
        ended += [outcome(self.ray, ref, k) for ref, (_, k) in self.refs.items()]  # they drain on the stop file
        self.refs.clear()
        return ended


def make_runner(runner: Runner, ray, call: ShardCall, *, cpus: int, gpus: float, max_retries: int, slots: int,
                log) -> ShardRunner:
    if runner == Runner.TASKS:
        return TaskRunner(ray, call, cpus=cpus, gpus=gpus, max_retries=max_retries)
    return ActorRunner(ray, call, cpus=cpus, gpus=gpus, max_retries=max_retries, slots=slots, log=log)
