"""`batchjob verify OUT`: the full check a resume skips. Reopening an output folder sizes every part
and hashes only the newest (what a crash can have touched), so resuming costs the same at 100 parts as
at 100,000; this reads every byte of every part of every result folder below OUT and compares it with
its SHA-256. `repair` sets damaged parts aside (`.corrupt`) under the folder's lock: the next run finds
them missing and generates their rows again."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchjob.io.disk import disk
from batchjob.io.lock import OutputLock
from batchjob.io.manifest import Manifest, result_folders
from batchjob.io.recovery import check_part


@dataclass(slots=True)
class FolderCheck:
    folder: Path
    parts: int = 0
    rows: int = 0
    bytes: int = 0
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (part, what is wrong)
    set_aside: bool = False


def verify(out: str | Path, repair: bool = False) -> list[FolderCheck]:
    """Every result folder below `out`; raises ManifestError for a folder whose manifest is unreadable."""
    checks = []
    for folder in result_folders(out):
        manifest = Manifest.load(folder)
        if manifest is None:
            continue
        check = FolderCheck(folder, len(manifest.parts), manifest.num_rows(), sum(p.bytes for p in manifest.parts))
        for part in manifest.parts:
            problem = check_part(folder / part.name, part)
            if problem is not None:
                check.damaged.append((part.name, problem))
        if repair and check.damaged:
            with OutputLock(folder):
                for name, problem in check.damaged:
                    path = folder / name
                    if path.exists():
                        disk().rename(path, path.with_name(name + ".corrupt"))
                disk().fsync_dir(folder)
            check.set_aside = True
        checks.append(check)
    return checks


def format_checks(checks: list[FolderCheck]) -> str:
    lines = []
    for c in checks:
        state = "every part whole" if not c.damaged else f"{len(c.damaged)} damaged"
        lines.append(f"{c.folder}: {c.parts:,} parts, {c.rows:,} rows, {c.bytes:,} bytes: {state}")
        for name, problem in c.damaged:
            lines.append(f"  {name}: {problem}" + (" -> set aside as .corrupt" if c.set_aside else ""))
    if any(c.damaged for c in checks):
        lines.append("rerun the job to generate the rows of the parts set aside" if any(c.set_aside for c in checks)
                     else "run `batchjob verify OUT --repair` to set the damaged parts aside; the next run of the job "
                          "then generates their rows again")
    return "\n".join(lines)
