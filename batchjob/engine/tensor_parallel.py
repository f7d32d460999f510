"""Tensor parallel on this node (`--tensor-parallel N`): the job's process is rank 0 and starts ranks 1..N-1 as
processes of their own (`python -m batchjob.engine.tensor_parallel`), each pinned to its share of the cores (or its
GPU), all in one torch.distributed group (gloo on a CPU, NCCL on CUDA) over a local TCP store. Rank 0 loads its slice
of the model and sends the others a ModelRequest: each loads its own slice (models/tensor_parallel.py), builds the
same model on it, then runs the steps rank 0's scheduler sends (engine/worker/tensor_parallel.py serve).

A rank that dies ends the job: rank 0 cannot go on without its heads, so a watchdog stops it at once (exit 1; what
was committed stays, and a rerun resumes). The ranks die with rank 0 (PR_SET_PDEATHSIG), and leave when it exits."""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from batchjob.errors import ConfigError
from batchjob.engine.placement import die_with_parent, gpu_count, place, visible_gpu

WAIT = timedelta(hours=24)  # how long a rank waits in a collective: rank 0 may wait on its input, or on an API caller
WATCH_S = 0.5  # how often rank 0 looks at its ranks
GRACE_S = 30.0  # after a rank ends, how long rank 0 has to fail its step and commit before the watchdog ends it


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """What every rank builds: the model's source and build_model's arguments (rank 0's, sent as they are)."""
    source: str
    dtype: str  # torch dtype name: "float32", "bfloat16"
    device: str
    kernels: str
    block_size: int
    kv_cache_dtype: str


class TensorRanks:
    """Rank 0's view of the group: the other ranks' processes, watched."""

    def __init__(self, world: int, processes: list[subprocess.Popen]):
        self.world = world
        self.processes = processes
        self.stopping = False
        threading.Thread(target=self._watch, name="batchjob-tp-watch", daemon=True).start()
        atexit.register(self.stop)

    def request(self, request: ModelRequest) -> None:
        from batchjob.engine.worker.tensor_parallel import broadcast

        broadcast(request)

    def lost(self, wait_s: float = 0.0) -> str | None:
        """Which rank ended, in words, looking for up to `wait_s` seconds; None while all run."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None:
                    how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
                    return f"tensor-parallel rank {rank} ended ({how})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """A rank that ends while rank 0 is in a step fails the step (RankLostError: the job commits and stops). One
        that ends while rank 0 waits elsewhere (its input, an API caller) stops this process after GRACE_S."""
        while not self.stopping:
            why = self.lost()
            if why is not None:
                print(f"batchjob: {why}; the job stops (what was committed stays: rerun the same command to resume)",
                      file=sys.stderr, flush=True)
                time.sleep(GRACE_S)
                if not self.stopping:
                    os._exit(1)
                return
            time.sleep(WATCH_S)

    def stop(self) -> None:
        """The other ranks leave (at exit, or when the job is done)."""
        if self.stopping:
            return
        self.stopping = True
        from batchjob.engine.worker.tensor_parallel import Stop, broadcast

        try:
            broadcast(Stop())
        except Exception:  # a rank already gone: the others die with this process anyway
            pass
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        _leave()


_ranks: TensorRanks | None = None  # this process's group: torch.distributed has one default group a process


def tensor_ranks(world: int, device: str) -> TensorRanks:
    """The group of `world` ranks this process leads, started on first use (one per process)."""
    global _ranks
    if _ranks is not None:
        if _ranks.world != world:
            raise ConfigError(f"tensor_parallel: this process already leads {_ranks.world} ranks; a process runs one "
                              f"tensor-parallel group (asked for {world})")
        return _ranks
    cpus = set(os.sched_getaffinity(0))
    gpus = gpu_count(device)
    placements = place(world, device, gpus, cpus, option="tensor_parallel")
    port = _free_port()
    processes = []
    for p in placements[1:]:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(p.rank),
               "WORLD_SIZE": str(world), "BATCHJOB_TP_CPUS": ",".join(map(str, p.cpus))}
        if p.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_gpu(p.gpu)
        processes.append(subprocess.Popen([sys.executable, "-m", "batchjob.engine.tensor_parallel"], env=env,
                                          stdin=subprocess.DEVNULL))
    _pin(placements[0].cpus)
    _join(0, world, port, gpus > 0 and device != "cpu")
    _ranks = TensorRanks(world, processes)
    return _ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cpus: tuple[int, ...]) -> None:
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def _join(rank: int, world: int, port: int, cuda: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=WAIT)


def _rank_main() -> None:
    """A rank other than 0: join the group, then build the model rank 0 names and serve its steps."""
    die_with_parent()
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    import torch

    from batchjob.engine.worker.tensor_parallel import serve

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpus = tuple(int(c) for c in os.environ.get("BATCHJOB_TP_CPUS", "").split(",") if c)
    _pin(cpus)
    cuda = "CUDA_VISIBLE_DEVICES" in os.environ and torch.cuda.is_available()
    _join(rank, world, int(os.environ["MASTER_PORT"]), cuda)

    def build(request: ModelRequest):
        return build_rank_model(request, rank, world)

    try:
        serve(build)
    except RuntimeError as e:  # rank 0 is gone (its connection closed): nothing left to serve
        print(f"batchjob: tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
    print(f"batchjob: tensor-parallel rank {rank} done (peak RSS {peak:.2f} GiB)", file=sys.stderr, flush=True)
    _leave()


def _leave() -> None:
    """Leave the group (its threads end before the interpreter does)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def build_rank_model(request: ModelRequest, rank: int, world: int):
    """Rank `rank`'s slice of the model `request` names, built as rank 0 builds its own."""
    import torch

    from batchjob.models.loader import load_model
    from batchjob.models.registry import build_model
    from batchjob.models.tensor_parallel import RankGroup

    dtype = getattr(torch, request.dtype)
    loaded = load_model(request.source, dtype=dtype, rank_of=(rank, world))
    return build_model(loaded.shard.shard_config(), loaded.weights, dtype, request.device, kernels=request.kernels,
                       block_size=request.block_size, kv_cache_dtype=request.kv_cache_dtype,
                       parallel=RankGroup(loaded.shard))


if __name__ == "__main__":
    _rank_main()
