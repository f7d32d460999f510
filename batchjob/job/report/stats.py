"""StatsRecorder: per-step engine counters and per-lane waits, written to OUTPUT/stats.jsonl every few
seconds (one JSON object a line) and summarized at the end; the process's peak resident memory."""
from __future__ import annotations

import json
import logging
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.engine.engine import StepStats
from batchjob.engine.requests import RequestOutput
from batchjob.io.disk import File, disk

RESERVOIR = 10_000  # wait samples kept per lane for percentiles; memory stays flat on any row count


_highest_read = (0, 0)  # (pid, the largest peak that process read): what peak_rss_bytes returns never goes down


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes: on Linux VmHWM, the high-water mark of its own address
    space (getrusage's ru_maxrss carries a parent's peak across fork and exec, so a job started by a big
    process would read that one's); elsewhere ru_maxrss (bytes on macOS, KiB on other systems). Linux updates
    the mark lazily and reports the larger of it and the current RSS, so two reads can go down by a few pages
    (seen: 4 KiB between the manifest's record and the summary); the largest read so far is returned."""
    global _highest_read
    peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024  # kB
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not peak:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
    pid, highest = _highest_read
    highest = max(highest, peak) if pid == os.getpid() else peak  # a forked child starts from its own reads
    _highest_read = (os.getpid(), highest)
    return highest


@dataclass(slots=True)
class LaneWaits:
    count: int = 0
    total: float = 0.0
    worst: float = 0.0
    samples: list[float] = field(default_factory=list)

    def add(self, wait: float, rng: random.Random) -> None:
        self.count += 1
        self.total += wait
        self.worst = max(self.worst, wait)
        if len(self.samples) < RESERVOIR:
            self.samples.append(wait)
        else:
            j = rng.randrange(self.count)
            if j < RESERVOIR:
                self.samples[j] = wait

    def summary(self) -> dict:
        s = sorted(self.samples)
        pick = (lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 4)) if s else (lambda q: None)
        return {"rows": self.count, "mean_wait_s": round(self.total / self.count, 4) if self.count else None,
                "p50_wait_s": pick(0.5), "p95_wait_s": pick(0.95), "max_wait_s": round(self.worst, 4)}


class StatsRecorder:
    def __init__(self, path: Path | None, interval: float = 5.0, kernels: str = ""):
        self.path = path
        self.kernels = kernels
        self.interval = interval
        self.t0 = time.monotonic()
        self.started_unix = time.time()
        self.first_row_unix: float | None = None  # when the first row finished (a resume's first new row)
        self.sequences_finished = 0
        self.model_s = 0.0
        self.last_write = self.t0
        self.rng = random.Random(0)
        self.steps = 0
        self.tokens = 0
        self.decode_tokens = 0
        self.prefill_tokens = 0
        self.preempted = 0
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.spec_proposed = self.spec_accepted = 0  # speculative tokens proposed and kept
        self.generated = 0  # tokens sampled (kept)
        self.images_encoded, self.encoder_s = 0, 0.0  # image placeholder runs (images or tiles) and the encoder's time
        self.images_cached = 0  # placeholder runs whose encoder output the encoder cache held (not encoded again)
        self.step_s = 0.0
        self.forward_s = 0.0
        self.lanes: dict[str, LaneWaits] = {}
        self.last: StepStats | None = None
        self._window = [0, 0]  # steps, tokens since the last line
        self._write_failed = False

    def step(self, st: StepStats, finished: list[RequestOutput]) -> None:
        self.steps += 1
        self.tokens += st.num_tokens
        self.decode_tokens += st.num_decode
        self.prefill_tokens += st.num_prefill_tokens
        self.preempted += st.num_preempted
        self.prefix_hits += st.prefix_hit_tokens
        self.prefix_queries += st.prefix_query_tokens
        self.spec_proposed += st.num_proposed
        self.spec_accepted += st.num_accepted
        self.generated += st.num_sampled
        self.images_encoded += st.num_images
        self.encoder_s += st.encoder_s
        self.images_cached += st.num_images_cached
        self.step_s += st.step_s
        self.forward_s += st.forward_s
        self.model_s += st.model_s
        if finished:
            self.sequences_finished += len(finished)
            if self.first_row_unix is None:
                self.first_row_unix = time.time()
        self._window[0] += 1
        self._window[1] += st.num_tokens
        self.last = st
        for out in finished:
            if out.queued_s is not None:
                self.lanes.setdefault(out.lane, LaneWaits()).add(out.queued_s, self.rng)
        now = time.monotonic()
        if now - self.last_write >= self.interval:
            self.write(self.snapshot(now))
            self.last_write = now
            self._window = [0, 0]

    def snapshot(self, now: float | None = None) -> dict:
        now = now or time.monotonic()
        st = self.last
        return {
            "t": round(now - self.t0, 3), "steps": self.steps,
            "running": st.num_running if st else 0, "waiting": st.num_waiting if st else 0,
            "preempted_total": self.preempted,
            "batch_tokens_mean": round(self._window[1] / self._window[0], 1) if self._window[0] else 0,
            "kv_blocks_used": st.blocks_used if st else 0, "kv_blocks_free": st.blocks_free if st else 0,
            "prefix_hit_rate": round(self.prefix_hits / self.prefix_queries, 4) if self.prefix_queries else 0.0,
            "lanes": {name: w.summary() for name, w in self.lanes.items()},
        }

    def summary(self) -> dict:
        out = self.snapshot()
        out.update({
            "summary": True, "kernels": self.kernels, "tokens": self.tokens, "decode_tokens": self.decode_tokens,
            "prefill_tokens": self.prefill_tokens, "prefix_hit_tokens": self.prefix_hits,
            "speculative_proposed": self.spec_proposed, "speculative_accepted": self.spec_accepted,
            "acceptance_rate": round(self.spec_accepted / self.spec_proposed, 4) if self.spec_proposed else None,
            # generated tokens per row per forward (1.0 without speculation)
            "tokens_per_row_forward": round(self.generated / (self.generated - self.spec_accepted), 4)
            if self.generated else None,
            "outside_forward_share": round(1 - self.forward_s / self.step_s, 4) if self.step_s else None,
            # where this run's time went: the job (from after the model load), the engine's steps, the runner
            # (inputs + forward + sampling) and the model alone (forward + logits); wall-clock stamps in Unix time
            "job_s": round(time.monotonic() - self.t0, 4), "step_s": round(self.step_s, 4),
            "forward_s": round(self.forward_s, 4), "model_s": round(self.model_s, 4),
            "images_encoded": self.images_encoded, "encoder_s": round(self.encoder_s, 4),  # within model_s
            "images_cached": self.images_cached,
            "sequences_finished": self.sequences_finished, "started_unix": round(self.started_unix, 4),
            "first_row_unix": round(self.first_row_unix, 4) if self.first_row_unix else None,
            # the process's, over its life so far: a process that ran jobs before (the API, a Ray actor) counts theirs
            "peak_rss_bytes": peak_rss_bytes(),
        })
        return out

    def write(self, record: dict) -> None:
        if self.path is not None:
            try:
                with File(disk(), self.path, append=True) as f:  # not fsynced: diagnostics, not results
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # diagnostics only: a full disk shows up where results are committed
                if not self._write_failed:
                    self._write_failed = True
                    logging.getLogger(__name__).warning("cannot write %s: %s", self.path, e)
