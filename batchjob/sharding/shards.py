"""The input cut into shards, one contiguous slice per process (`--shard K/N`, one Slurm array task or one
Kubernetes Indexed Job pod each): which shard this is, planning the row ranges, and claiming one shard's slice of
the input.

OUT/job.json, written once by the first shard to start, pins the shard count, each shard's row range
(and JSONL byte offset) and the job fingerprint. Each shard writes its own OUT/shard-KKKKK-of-NNNNN/
(manifest, parts, lock) and keeps global row indices, so the shards merge back in input order
(`sharded_output.py` reads such a folder back).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from batchjob.errors import ConfigError
from batchjob.io.disk import File, disk
from batchjob.io.manifest import MANIFEST, atomic_write, utc_now
from batchjob.io.ranges import RowRanges
from batchjob.io.recovery import SinkError
from batchjob.io.sources import InputRow, JsonlSource, Source

JOB_FILE = "job.json"
JOB_VERSION = 1
SHARD_DIR = re.compile(r"shard-(\d{5,})-of-(\d{5,})")
OFF = ("none", "off", "no")
K8S_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in each pod of an Indexed Job
K8S_COUNT = "JOB_COMPLETIONS"  # set by the Job's manifest: its `completions` (Kubernetes does not pass them)


class ShardError(SinkError):
    """The output folder belongs to a different sharding or a different job."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    index: int  # 0-based
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"shard: {self.index}/{self.count} is not a shard; use K/N with 0 <= K < N")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def folder_name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m:
            raise ConfigError(f"shard: {text!r} is not K/N (e.g. 0/4: the first of 4 shards), or 'none'")
        return cls(int(m.group(1)), int(m.group(2)))

    @classmethod
    def resolve(cls, value: str | None, environ: Mapping[str, str] = os.environ) -> ShardSpec | None:
        """`--shard K/N`; 'none' for no sharding; unset: this Slurm array task's shard (K = (SLURM_ARRAY_TASK_ID -
        SLURM_ARRAY_TASK_MIN) / step, N = SLURM_ARRAY_TASK_COUNT), or this Kubernetes Indexed Job pod's (K =
        JOB_COMPLETION_INDEX, which Kubernetes sets; N = JOB_COMPLETIONS, which the manifest sets to its
        `completions`: docs/guide/kubernetes.md), if any."""
        if value is not None:
            return None if value.strip().lower() in OFF else cls.parse(value)
        task = environ.get("SLURM_ARRAY_TASK_ID")
        if task is not None and environ.get("SLURM_ARRAY_TASK_COUNT") is not None:
            try:
                first = int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
                step = int(environ.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
                return cls((int(task) - first) // step, int(environ["SLURM_ARRAY_TASK_COUNT"]))
            except (ValueError, ConfigError) as e:
                raise ConfigError(f"shard: cannot derive K/N from this Slurm array task ({e}); pass --shard K/N "
                                  "or --shard none") from None
        index = environ.get(K8S_INDEX)
        if index is None:
            return None
        count = environ.get(K8S_COUNT)
        if count is None:
            raise ConfigError(f"shard: this is a Kubernetes Indexed Job pod ({K8S_INDEX}={index}) but {K8S_COUNT} is not "
                              f"set: set it in the pod's env to the Job's completions (docs/guide/kubernetes.md), or "
                              f"pass --shard K/N or --shard none")
        try:
            return cls(int(index), int(count))
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"shard: cannot derive K/N from {K8S_INDEX}={index!r} and {K8S_COUNT}={count!r} ({e}); "
                              "pass --shard K/N or --shard none") from None


@dataclass(frozen=True, slots=True)
class ShardRange:
    start: int  # first global row_index
    end: int  # one past the last
    offset: int | None = None  # JSONL: byte offset where row `start` begins

    @property
    def num_rows(self) -> int:
        return self.end - self.start


# ---- planning ------------------------------------------------------------------------------------


def cut_points(total: int, count: int, unit_starts: list[int]) -> list[int]:
    """count + 1 increasing cuts from 0 to total. Each inner cut moves to the nearest unit start
    (row group / file) when that keeps the shard within a quarter of an even share, so shards do not
    share a unit; otherwise it stays at the even share (and the unit is read by both neighbours)."""
    starts = sorted({s for s in unit_starts if 0 < s < total})
    cuts = [0]
    for k in range(1, count):
        even = (total * k + count // 2) // count
        cut = even
        i = bisect_left(starts, even)
        near = starts[max(i - 1, 0):i + 1]  # the unit starts on either side of the even cut
        if near:
            best = min(near, key=lambda s: (abs(s - even), s))
            if abs(best - even) * 4 * count <= total:
                cut = best
        cuts.append(max(cut, cuts[-1]))
    cuts.append(max(total, cuts[-1]))
    return cuts


def plan_shards(source: Source, count: int) -> list[ShardRange]:
    """Split the input into `count` contiguous row ranges. A JSONL file is scanned (without parsing)
    to count its rows, then up to the last cut for the byte offsets where shards begin, so each shard
    can seek straight to its first row; memory stays constant."""
    if isinstance(source, JsonlSource):
        cuts = cut_points(sum(1 for _ in source.row_ends()), count, [])
        offsets = {0: 0}
        wanted = set(cuts[1:-1])
        for row, end in enumerate(source.row_ends(), start=1):
            if row in wanted:
                offsets[row] = end
                if len(offsets) > len(wanted):
                    break
        return [ShardRange(a, b, offsets.get(a, 0)) for a, b in zip(cuts, cuts[1:])]
    if source.num_rows is None:
        raise ShardError(f"{source.path} ({source.format_name}): its row count is not known before a full read, so it "
                         f"cannot be cut into shards; decompress it to .jsonl or convert it to Parquet, or run it unsharded")
    cuts = cut_points(source.num_rows, count, source.unit_starts())
    return [ShardRange(a, b) for a, b in zip(cuts, cuts[1:])]


# ---- one shard's rows -----------------------------------------------------------------------------


class ShardSource(Source):
    """The rows [start, end) of another source, with their global row indices. Parquet / datasets
    units outside the range are never read; a JSONL shard seeks to its first row and stops at its end."""

    def __init__(self, inner: Source, spec: ShardSpec, rng: ShardRange) -> None:
        super().__init__(inner.path)
        self.inner, self.spec, self.range = inner, spec, rng
        self.format_name = inner.format_name
        self.columns = inner.columns
        self.num_rows = rng.num_rows
        self._position = (rng.start, rng.offset or 0)

    def shard(self) -> dict:
        """What a shard manifest records (in its fingerprint) about the slice."""
        return {"index": self.spec.index, "count": self.spec.count, "start": self.range.start, "end": self.range.end}

    @property
    def whole(self) -> Source:
        return self.inner

    @property
    def seeks(self) -> bool:
        return self.inner.seeks

    def position(self) -> tuple[int, int]:
        """A seeking input's (next row_index, byte offset) after the last row this shard yielded."""
        return self._position

    def check_task(self, task: str) -> None:
        self.inner.check_task(task)

    def other_models(self, served: set[str]) -> Counter[str]:
        return self.inner.other_models(served)

    def carries_tools(self, column: str) -> bool:
        return self.inner.carries_tools(column)

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None,
             start_offset: tuple[int, int] | None = None) -> Iterator[InputRow]:
        start, end = self.range.start, self.range.end
        if start == end or (skip is not None and skip.covers(start, end)):
            return
        if self.inner.seeks:
            here = (start, self.range.offset or 0)
            if start_offset is not None and start_offset[0] > here[0]:
                here = start_offset  # a resume point recorded inside this shard
            rows = self.inner.rows(skip, columns=columns, start_offset=here)
        else:
            outside = RowRanges([(0, start), (end, max(end, self.inner.num_rows or end))])
            rows = self.inner.rows(outside if skip is None else skip.union(outside), columns=columns)
        try:
            for row in rows:
                if row.row_index >= end:
                    break
                yield row
                if self.inner.seeks:
                    self._position = self.inner.position()
        finally:
            rows.close()


# ---- the job folder ----------------------------------------------------------------------------------


@dataclass(slots=True)
class JobFile:
    """OUT/job.json: what every shard of OUT must agree on."""
    shards: int
    total_rows: int
    ranges: list[ShardRange]
    fingerprint: dict
    created: str = ""
    version: int = JOB_VERSION

    def to_json(self) -> dict:
        return {"version": self.version, "shards": self.shards, "total_rows": self.total_rows,
                "ranges": [asdict(r) for r in self.ranges], "fingerprint": self.fingerprint, "created": self.created}

    @classmethod
    def load(cls, out: str | Path) -> JobFile | None:
        path = Path(out) / JOB_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ShardError(f"{path} is unreadable ({e}); restore it or start over in a new output folder") from e
        try:
            if data["version"] != JOB_VERSION:
                raise ShardError(f"{path} has version {data['version']}; this batchjob reads version {JOB_VERSION}")
            return cls(shards=data["shards"], total_rows=data["total_rows"],
                       ranges=[ShardRange(**r) for r in data["ranges"]], fingerprint=data["fingerprint"],
                       created=data.get("created", ""), version=data["version"])
        except (KeyError, TypeError) as e:
            raise ShardError(f"{path} lacks a field or has an unknown one ({e}); it was not written by batchjob") from e

    def folder(self, out: str | Path, index: int) -> Path:
        return Path(out) / ShardSpec(index, self.shards).folder_name


def claim_shard(out: str | Path, spec: ShardSpec, source: Source, fingerprint: dict) -> ShardSource:
    """Plan the job on first use (under a lock, so concurrent shards plan once) or check that this
    shard agrees with OUT/job.json; return the shard's slice of `source`."""
    out = Path(out)
    try:
        disk().mkdir(out)
    except OSError as e:
        raise SinkError(f"cannot use output folder {out}: {e}") from e
    if (out / MANIFEST).exists():
        raise ShardError(f"{out} holds the results of an unsharded run; run without --shard, "
                         "or use a new output folder for the sharded job")
    fingerprint = json.loads(json.dumps(fingerprint))  # compare as it will read back
    with File(disk(), out / ".job.json.lock", append=True) as lock:
        fcntl.flock(lock.fd, fcntl.LOCK_EX)  # held only while planning: a JSONL scan at most
        job = JobFile.load(out)
        if job is None:
            job = JobFile(spec.count, 0, plan_shards(source, spec.count), fingerprint, created=utc_now())
            job.total_rows = job.ranges[-1].end if job.ranges else 0
            atomic_write(out / JOB_FILE, json.dumps(job.to_json(), indent=1).encode())
    if job.shards != spec.count:
        raise ShardError(f"{out} is a job of {job.shards} shards ({out / JOB_FILE}); this run is shard {spec} — "
                         f"use --shard K/{job.shards} (or `batchjob slurm submit --shards {job.shards}`), "
                         "or a new output folder for a different split")
    from batchjob.io.recovery import same_job

    if not same_job(job.fingerprint, fingerprint):
        keys = sorted(k for k in {*job.fingerprint, *fingerprint} if job.fingerprint.get(k) != fingerprint.get(k))
        raise ShardError(f"{out} holds the shards of a different job (differs in: {', '.join(keys)}); "
                         "use a new output folder, or delete this one to start over")
    return ShardSource(source, spec, job.ranges[spec.index])


def check_unsharded(out: str | Path) -> None:
    """An unsharded run must not write into a sharded job's folder."""
    job = JobFile.load(out)
    if job is not None:
        raise ShardError(f"{out} is a job of {job.shards} shards; run a shard with --shard K/{job.shards} "
                         f"(K = 0..{job.shards - 1}) or `batchjob slurm submit --shards {job.shards}`, "
                         "or use a new output folder")
