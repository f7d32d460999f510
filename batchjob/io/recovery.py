"""Opening an output folder that holds results: is it the same job (fingerprints), is its manifest
readable (else rebuilt from the previous snapshot and the logs), are its listed parts whole, and what a
crash left behind (temp files, parts never committed). Also `clear_results` for --restart."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from batchjob.io.disk import disk
from batchjob.io.manifest import MANIFEST, PREVIOUS, Manifest, ManifestError, ManifestVersionError, PartEntry
from batchjob.io.parts import PART_NAME, TEMP_NAME, adopt_part
from batchjob.io.ranges import RowRanges

log = logging.getLogger(__name__)
VERIFY_LAST = 2  # listed parts hashed on reopening (the newest: what a crash can have left torn); all are sized


class SinkError(Exception):
    """The output folder cannot be used: not creatable, corrupt manifest, another job's results."""


class FingerprintMismatch(SinkError):
    """The output folder holds results of a different job."""


START_OVER = ("rerun the original job unchanged to continue it, or add --restart to delete this folder's "
              "results and start over, or write to another --output folder")


def same_job(old: dict, new: dict) -> bool:
    """Fingerprints of the same job. An input identity written before inputs were fingerprinted by content
    (the path, then [name, size, mtime] per file) still matches when the names, sizes and columns do:
    a folder from an earlier version resumes without --restart."""
    if old == new:
        return True
    o, n = old.get("input"), new.get("input")
    if not (isinstance(o, dict) and isinstance(n, dict) and "path" in o and "format" not in o):
        return False
    legacy = [f[:2] for f in o.get("files", [])] == [f[:2] for f in n.get("files", [])] and o.get("columns") == n.get("columns")
    return legacy and {**old, "input": None} == {**new, "input": None}


def check_same_job(out_dir: Path, manifest: Manifest, fingerprint: dict, total_rows: int | None) -> bool:
    """Raises when `manifest` is another job's; True when its fingerprint was of an older form (now updated)."""
    upgraded = manifest.fingerprint != fingerprint
    if same_job(manifest.fingerprint, fingerprint):
        manifest.fingerprint = fingerprint
    else:
        changes = fingerprint_changes(manifest.fingerprint, fingerprint)
        raise FingerprintMismatch(f"{out_dir} holds results of a different job (differs in: {'; '.join(changes)}); "
                                  + START_OVER)
    if manifest.total_rows is not None and total_rows is not None and manifest.total_rows != total_rows:
        raise FingerprintMismatch(f"{out_dir} was written for an input of {manifest.total_rows} rows, "
                                  f"the input now has {total_rows}; " + START_OVER)
    return upgraded


_ABSENT = object()


def fingerprint_changes(old: dict, new: dict, limit: int = 8) -> list[str]:
    """What differs between two fingerprints, as 'path: old -> new' lines (at most `limit`)."""
    changes: list[str] = []

    def walk(a, b, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted({*a, *b}, key=str):
                x, y = a.get(key, _ABSENT), b.get(key, _ABSENT)
                if x != y:
                    walk(x, y, f"{path}.{key}" if path else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and not (_flat(a) and _flat(b)):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    walk(x, y, f"{path}[{i}]")
        else:
            changes.append(f"{path}: {_short(a)} -> {_short(b)}")

    walk(old, new, "")
    more = len(changes) - limit
    return changes[:limit] + ([f"and {more} more"] if more > 0 else [])


def _flat(value: list) -> bool:
    """A list of plain values (an input file's [name, bytes, mtime], a column list) is shown whole."""
    return not any(isinstance(v, (dict, list)) for v in value)


def _short(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def load_manifest(out_dir: Path) -> tuple[Manifest | None, str | None]:
    """The committed manifest, or None for a fresh folder. When manifest.json is damaged (or gone while
    a previous generation exists), the previous generation and why; the damaged file is kept aside."""
    try:
        manifest = Manifest.load(out_dir)
        if manifest is not None:
            return manifest, None
        problem = f"{out_dir / MANIFEST} is missing"
    except ManifestVersionError as e:
        raise SinkError(f"{e}: use that batchjob version for this folder, or another output folder") from e
    except ManifestError as e:
        problem = str(e)
    try:
        previous = Manifest.load(out_dir, PREVIOUS)
    except ManifestError as e:
        raise SinkError(f"{problem}, and its previous generation is damaged too ({e}); the results in {out_dir} "
                        "cannot be verified: add --restart to delete them and start over, or use another output folder") from e
    if previous is None:
        if (out_dir / MANIFEST).exists():
            raise SinkError(f"{problem}; there is no previous generation to repair it from: add --restart to "
                            "delete this folder's results and start over, or use another output folder")
        if any(PART_NAME.fullmatch(p.name) for p in out_dir.iterdir()):
            raise SinkError(f"{out_dir} holds part files but no manifest.json, so they cannot be verified; add "
                            "--restart to delete them and start over, or use another output folder")
        return None, None
    if (out_dir / MANIFEST).exists():
        disk().rename(out_dir / MANIFEST, out_dir / (MANIFEST + ".corrupt"))  # durable with the rebuilt snapshot
    log.warning("%s; rebuilding it from %s and the part files it does not list", problem, PREVIOUS)
    return previous, problem


def check_part(path: Path | str, part: PartEntry) -> str | None:
    """None when the part is whole: its size and its SHA-256 as listed."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    if size != part.bytes:
        return f"{size} bytes, not {part.bytes}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != part.sha256:
        return "damaged (SHA-256 mismatch)"
    return None


def recover(out_dir: Path, manifest: Manifest, adopt: bool) -> tuple[list[str], list[str], int]:
    """Sweep temp files and unlisted parts (adopt verifiable ones instead when the manifest was
    rebuilt from its previous generation), and set aside listed parts that fail their check. Returns
    (the parts set aside, the parts adopted, the next part number)."""
    listed = {part.name for part in manifest.parts}
    names = os.listdir(out_dir)  # names, not Path objects: 100,000 parts cost milliseconds
    unlisted = []
    for name in sorted(n for n in names if n not in listed):
        if TEMP_NAME.fullmatch(name):
            log.info("removing %s: written but never committed", out_dir / name)
            disk().unlink(out_dir / name)
        elif PART_NAME.fullmatch(name):
            unlisted.append(out_dir / name)
    present, folder, stat = set(names), str(out_dir), os.stat
    if adopt:
        suspect = listed  # a rebuilt manifest: every listed part is hashed
    else:  # the hot loop of a resume after 100,000 parts: one stat each, in one comprehension
        suspect = {p.name for p in manifest.parts if p.name not in present or stat(f"{folder}/{p.name}").st_size != p.bytes}
        suspect.update(p.name for p in manifest.parts[-VERIFY_LAST:])  # and the newest, what a crash can have touched
    repaired, kept = [], []
    for part in manifest.parts:  # the suspect ones sized and hashed
        if part.name not in suspect or (problem := check_part(f"{folder}/{part.name}", part)) is None:
            kept.append(part)
            continue
        path = out_dir / part.name
        repaired.append(part.name)
        log.warning("%s is %s; its %d rows will be generated again", path, problem, part.num_rows)
        if path.exists():
            disk().rename(path, path.with_name(path.name + ".corrupt"))
    manifest.parts = kept
    adopted = []
    done = manifest.done_rows() if adopt and unlisted else RowRanges()
    for path in unlisted:
        entry = adopt_part(path, done) if adopt else None
        if entry is None:
            log.info("removing %s: written but never committed", path)
            disk().unlink(path)
            continue
        log.warning("%s was not in the previous manifest; verified and kept (%d rows)", path, entry.num_rows)
        manifest.parts.append(entry)
        done = done.union(entry.row_ranges())
        adopted.append(path.name)
    if adopted:
        manifest.parts.sort(key=lambda p: p.name)
    numbers = [int(name[5:name.index(".")]) for name in (*listed, *adopted)]  # part-<number>.<format>
    return repaired, adopted, max(numbers, default=-1) + 1


def clear_results(out_dir: str | Path) -> int:
    """Delete what batchjob wrote in `out_dir` (parts, manifests, temp and set-aside files); other files
    stay. Returns how many files went."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return 0
    ours = re.compile(r"(part-\d{5,}\.(arrow|parquet)|manifest\.json(\.prev)?|commits\.log(\.prev)?)(\.corrupt)?")
    removed = 0
    for path in out_dir.iterdir():
        if path.is_file() and (ours.fullmatch(path.name) or TEMP_NAME.fullmatch(path.name)):
            disk().unlink(path)
            removed += 1
    if removed:
        disk().fsync_dir(out_dir)  # a power cut must not bring the old results back under the new job
    return removed


