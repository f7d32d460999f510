"""Where the ranks of a run on this node go (data parallel: launch/local.py; tensor parallel: engine/tensor_parallel.py):
each rank its GPU, or its own set of cores, inside one NUMA node where the machine has several; and a rank process
that dies with the process that started it."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from batchjob.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank runs: its cores (its torch threads) and its GPU, if any."""
    rank: int
    cpus: tuple[int, ...]
    gpu: int | None = None  # an index among the GPUs this process sees
    numa_node: int | None = None

    def describe(self) -> str:
        cores = f"{len(self.cpus)} core{'s' if len(self.cpus) > 1 else ''} ({_ranges(self.cpus)})"
        where = f"GPU {self.gpu}" if self.gpu is not None else cores
        return where + (f", NUMA node {self.numa_node}" if self.numa_node is not None else "")


def numa_nodes(cpus: set[int]) -> list[tuple[int, tuple[int, ...]]]:
    """This machine's NUMA nodes with the cores of `cpus` in each (those with none left out); one node when the
    kernel shows none."""
    root = Path("/sys/devices/system/node")
    nodes = []
    for folder in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            listed = _parse_cpulist((folder / "cpulist").read_text())
        except OSError:
            continue
        mine = tuple(sorted(listed & cpus))
        if mine:
            nodes.append((int(folder.name[4:]), mine))
    return nodes or [(0, tuple(sorted(cpus)))]


def place(ranks: int | str, device: str, gpus: int, cpus: set[int],
          nodes: list[tuple[int, tuple[int, ...]]] | None = None, option: str = "data_parallel") -> list[Placement]:
    """Each rank's device. GPUs (device cuda, or auto with GPUs): one rank per GPU ('auto': every GPU), the cores
    shared out among them. CPU: 'auto' is one rank per NUMA node; N ranks get the cores in equal contiguous sets, each
    inside one node when N is a multiple of the node count. `nodes`: the NUMA nodes' cores (default: this machine's);
    `option`: the option asking, as errors name it."""
    nodes = nodes or numa_nodes(cpus)
    if device == "cuda" and gpus == 0:
        raise ConfigError(f"{option}: --device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver)")
    if gpus and device != "cpu":
        n = gpus if ranks == "auto" else ranks
        if n > gpus:
            raise ConfigError(f"{option}: {n} ranks, but {gpus} GPUs are visible: at most one rank per GPU")
        shares = _split(tuple(sorted(cpus)), n)
        return [Placement(r, shares[r], gpu=r) for r in range(n)]
    n = len(nodes) if ranks == "auto" else ranks
    if n > len(cpus):
        raise ConfigError(f"{option}: {n} ranks, but this process may use {len(cpus)} cores: at most one rank "
                          "per core")
    if n % len(nodes) == 0:
        per_node = n // len(nodes)
        placements = []
        for node, node_cpus in nodes:
            if per_node > len(node_cpus):
                break
            for share in _split(node_cpus, per_node):
                placements.append(Placement(len(placements), share, numa_node=node if len(nodes) > 1 else None))
        if len(placements) == n:
            return placements
    return [Placement(r, share) for r, share in enumerate(_split(tuple(sorted(cpus)), n))]


def _split(cpus: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """`cpus` in n contiguous sets as even as they go (the first ones one larger)."""
    size, extra = divmod(len(cpus), n)
    out, at = [], 0
    for r in range(n):
        take = size + (r < extra)
        out.append(cpus[at:at + take] or cpus[r % len(cpus):r % len(cpus) + 1])
        at += take
    return out


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def _ranges(cpus: tuple[int, ...]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 and cpus[-1] - cpus[0] == len(cpus) - 1 else \
        ",".join(map(str, cpus))


def visible_gpu(index: int) -> str:
    """The index-th GPU of those the driver sees, as CUDA_VISIBLE_DEVICES names it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def gpu_count(device: str) -> int:
    """The NVIDIA GPUs this process sees, from the driver's /proc entries and CUDA_VISIBLE_DEVICES: the driver
    process does not import torch (seconds, and memory) only to count them."""
    if device == "cpu":
        return 0
    try:
        installed = len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    return len([v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")])


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux: PR_SET_PDEATHSIG), so a rerun never meets an orphan
    holding a shard's lock, nor a tensor-parallel rank waiting for a rank 0 that is gone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child may outlive a killed parent
        pass
