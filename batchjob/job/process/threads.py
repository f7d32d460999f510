"""How many CPU threads a job computes on, and how long idle OpenMP workers spin: chosen before torch is imported.

The default is the CPUs this process may run on: its affinity (what Slurm's --cpus-per-task, taskset and numactl
set) capped by the cgroup's CPU quota (what `docker run --cpus`, Kubernetes limits and systemd's CPUQuota set, and
what torch's own default of every core ignores).

Between the engine's parallel regions libgomp's idle workers spin ~300,000 turns before they sleep: the fastest on
CPUs of the job's own, but where other work shares them the spinning workers lose their cores, and each step waits
for its slowest thread. So `batchjob run` looks first (unless the environment already says how workers wait): when
other processes keep those CPUs busy (over BUSY_SHARE of their time in a short sample of /proc/stat, steal time
included), or a cgroup quota caps them (spinning spends the quota), idle workers spin SPIN_COUNT turns, then
sleep. Measured (docs/guide/models-and-kernels.md, "Threads"): with one of 2 cores busy, 1.7x the default spin's
rate; on idle cores 13% below it, which is why an idle machine keeps the default."""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SPIN_COUNT = "1000"  # libgomp's spins before an idle worker sleeps on a shared machine (its default: 300,000)
BUSY_SHARE = 0.25  # of this process's CPUs' time, used by other work while it waits: the CPUs are shared
SAMPLE_S = 0.1  # how long the start looks


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """What `choose_wait_policy` found and set, for the start line."""
    spin_count: str | None  # GOMP_SPINCOUNT set here; None: the environment's or libgomp's own
    why: str = ""  # e.g. "other work uses 48% of these CPUs"

    def words(self) -> str:
        return f"idle workers sleep: {self.why}" if self.spin_count is not None else ""


chosen = WaitPolicy(None)  # this process's choice (the start line reads it)


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup CPU quota (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(cpus, 1)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota, in CPUs (quota / period), on this process's cgroup and its parents: cgroup v2's cpu.max
    or v1's cpu.cfs_quota_us; None when there is none."""
    quotas = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2), "N:cpu,cpuacct:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folder, read = root / path.lstrip("/"), _v2_quota
        elif "cpu" in controllers.split(","):
            folder, read = root / controllers / path.lstrip("/"), _v1_quota
            if not folder.is_dir():
                folder = root / "cpu" / path.lstrip("/")
        else:
            continue
        while True:
            quota = read(folder)
            if quota is not None:
                quotas.append(quota)
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    return min(quotas, default=None)


def _v2_quota(folder: Path) -> float | None:
    """cgroup v2's cpu.max: "QUOTA PERIOD", or "max PERIOD" for none."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us (a quota of -1: none)."""
    try:
        quota, period = (int((folder / name).read_text()) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def job_threads(requested: int) -> int:
    """--threads: a count, or 0 for the CPUs this process may use."""
    return requested or usable_cpus()


def choose_wait_policy(sample_s: float = SAMPLE_S) -> WaitPolicy:
    """Before torch is imported (libgomp reads its environment once, when it loads): a short spin when the CPUs
    are shared or quota-capped, else libgomp's default; nothing when the environment already says
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT) or torch is loaded."""
    global chosen
    if "torch" in sys.modules or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        return chosen
    why = ""
    quota = cgroup_cpu_quota()
    if quota is not None:
        why = f"a cgroup CPU quota of {quota:g}"
    else:
        share = other_work_share(sample_s)
        if share is not None and share >= BUSY_SHARE:
            why = f"other work uses {share:.0%} of these CPUs"
    if why:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        chosen = WaitPolicy(SPIN_COUNT, why)
    return chosen


def other_work_share(sample_s: float = SAMPLE_S, stat: Path = Path("/proc/stat")) -> float | None:
    """The share of this process's CPUs' time (its affinity) that was not idle over `sample_s` while this process
    slept: other work, or a hypervisor's steal. None where /proc/stat cannot be read."""
    try:
        cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        return None

    def ticks() -> tuple[int, int] | None:  # (all, idle) summed over `cpus`
        try:
            lines = stat.read_text().splitlines()
        except OSError:
            return None
        total = idle = 0
        for line in lines:
            name, *values = line.split()
            if name in cpus:
                numbers = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                total, idle = total + sum(numbers), idle + numbers[3] + numbers[4]
        return total, idle

    before = ticks()
    time.sleep(sample_s)
    after = ticks()
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1 - (after[1] - before[1]) / (after[0] - before[0])
