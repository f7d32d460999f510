"""The default thread count (the CPUs this process may use: affinity capped by a cgroup quota) and the OpenMP wait
policy set before torch is imported (job/process/threads.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from batchjob.job.process.threads import cgroup_cpu_quota, job_threads, other_work_share, usable_cpus


def test_a_cgroup_v2_quota_caps_the_threads_and_the_tightest_one_wins(tmp_path):
    root = tmp_path / "cgroup"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs: 3 threads
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/job/step\n")
    assert cgroup_cpu_quota(root, proc) == 2.5
    proc.write_text("0::/\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_a_cgroup_v1_quota_is_read_too(tmp_path):
    root = tmp_path / "cgroup"
    (root / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(root, proc) == 1.0
    (root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_quota(root, proc) is None


def test_the_default_is_the_cpus_this_process_may_use():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
    assert job_threads(0) == usable_cpus() and job_threads(3) == 3


def test_other_work_on_these_cpus_is_seen_in_a_short_sample(tmp_path):
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0))
    line = lambda n, busy, idle: f"cpu{n} {busy} 0 0 {idle} 0 0 0 0 0 0\n"  # noqa: E731
    stat.write_text("".join(line(n, 100, 100) for n in cpus))
    import threading

    later = threading.Timer(0.05, lambda: stat.write_text("".join(line(n, 130, 110) for n in cpus)))
    later.start()
    assert other_work_share(0.2, stat) == 0.75  # 30 busy ticks of 40 on each CPU
    later.join()
    assert other_work_share(0.01, tmp_path / "missing") is None


def test_a_shared_machine_gets_a_short_spin_and_an_idle_one_keeps_libgomps(tmp_path):
    """In a fresh interpreter (the choice is made before torch loads): with two processes spinning on every CPU of
    this one, the CPUs are shared; what the environment says is kept as it is."""
    code = ("import os; from batchjob.job.process.threads import choose_wait_policy; p = choose_wait_policy(0.3); "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), '|', p.words())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,  # noqa: E731
                                     text=True, check=True).stdout.strip()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * len(os.sched_getaffinity(0)))]
    try:
        busy = run(env)
    finally:
        for hog in hogs:
            hog.kill()
    if cgroup_cpu_quota() is None:
        assert busy.startswith("1000 None | idle workers sleep: other work uses "), busy
    else:
        assert busy.startswith("1000 None | idle workers sleep: a cgroup CPU quota"), busy
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "None ACTIVE |"
    assert run({**env, "GOMP_SPINCOUNT": "50000"}) == "50000 None |"
    after_torch = "import torch; " + code  # too late once OpenMP is loaded: then nothing is set
    assert subprocess.run([sys.executable, "-c", after_torch], env=env, cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip() == "None None |"
