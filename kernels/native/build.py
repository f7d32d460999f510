"""Compiling the C++ kernels in kernels/native/csrc/ at first use, for the best instruction set the CPU has, and
caching the result per CPU.

The kernels are written once over vec.h, which has three paths: `avx512` (AVX-512 F/BW/VL/DQ, with BF16 and
VNNI where the CPU has them), `avx2` (AVX2 + FMA + F16C, with AVX-VNNI where present) and `generic` (no
intrinsics: what the compiler makes of plain C++; it stands in for Arm). `cpu_isa()` picks the best path this
CPU runs; `BATCHJOB_CPU_ISA=avx512|avx2|generic` forces one (a lower one for tests and comparisons; one the CPU
lacks is refused). On x86 `generic` is built for the baseline x86-64 (SSE2 only, no vector extensions).

Nothing is compiled at install (pip stays pure Python). The first run on a machine compiles each needed
specialisation (head_dim, GQA group) with the system compiler into the user's cache folder
(`$BATCHJOB_CACHE_DIR`, else `$XDG_CACHE_HOME/batchjob`, else `~/.cache/batchjob`), under a key of the
source hash, the flags, the compiler's version and the CPU's model and flags: a build made with
`-march=native` on one node is never loaded on a node with other instructions (a shared home directory
across a mixed Slurm cluster is safe). A build is written under a temporary name and renamed into place,
and concurrent builders of the same key wait on one lock file, so parallel shards compile once.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-fopenmp", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
         "-fno-strict-aliasing"]  # the kernels read caches and bf16 pairs through other types
ISAS = ("avx512", "avx2", "generic")  # best first
ISA_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2": ("avx2", "fma", "f16c"), "generic": ()}
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "generic": "generic C++"}
# what a path is compiled with when only compiled, not run (tests/kernels: the AVX-512 path compiles on any x86)
ISA_TARGET_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                               "-mfma", "-mf16c"],
                    "avx2": ["-mavx2", "-mfma", "-mf16c"], "generic": []}


class BuildError(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why in one line."""


def cache_dir() -> Path:
    if os.environ.get("BATCHJOB_CACHE_DIR"):
        return Path(os.environ["BATCHJOB_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchjob" / "kernels"


@functools.cache
def cpu_identity() -> tuple[str, frozenset[str]]:
    """(model name, instruction-set flags) of this machine's CPU, from /proc/cpuinfo."""
    model, flags = "unknown", frozenset()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"no C++ compiler: {cxx!r} not found (install g++ or set CXX)")
    return path


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"C++ compiler {cxx} does not run: {e}") from None
    if out.returncode != 0:
        raise BuildError(f"C++ compiler {cxx} does not run: {out.stderr.strip()[:200]}")
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def isa_runs_here(isa: str) -> bool:
    """Whether this CPU runs the `isa` path (generic runs everywhere)."""
    return isa == "generic" or (_x86() and set(ISA_NEEDS[isa]) <= cpu_identity()[1])


def cpu_isa() -> str:
    """The instruction-set path the kernels are built for: $BATCHJOB_CPU_ISA (avx512, avx2, generic), or the best this
    CPU runs. Raises BuildError for an unknown name or a path this CPU lacks."""
    asked = os.environ.get("BATCHJOB_CPU_ISA", "").strip().lower() or "auto"
    if asked == "auto":
        return next(isa for isa in ISAS if isa_runs_here(isa))
    if asked not in ISAS:
        raise BuildError(f"BATCHJOB_CPU_ISA={asked!r} is not one of auto, {', '.join(ISAS)}")
    if not isa_runs_here(asked):
        missing = [f for f in ISA_NEEDS[asked] if f not in cpu_identity()[1]] or ["x86-64"]
        raise BuildError(f"BATCHJOB_CPU_ISA={asked}: this CPU lacks {', '.join(missing)}; use auto or a lower path "
                         f"({', '.join(ISAS[ISAS.index(asked) + 1:])})")
    return asked


def optimization(isa: str) -> str:
    """The optimization level of the `isa` path's build: -O3, but -O2 for x86's generic path, the fallback of an x86
    CPU without AVX2 and FMA (before 2013) and what the tests force to check the generic code. There the -O3 passes
    doubled the compile time (paged_attention_quant.cpp 28.6 s at -O3, 12.2 s at -O2 on a Zen 3) for a job ~5% faster
    (SmolLM2, 32 rows x 48 tokens: 120 s at -O3, 126 s at -O2, docs/design/kernels.md). On Arm the generic path is
    the real one (NEON/SVE from the compiler) and keeps -O3."""
    return "-O2" if isa == "generic" and _x86() else "-O3"


def isa_flags(isa: str, native: bool = True) -> list[str]:
    """Compiler flags for the `isa` path: tuned for this CPU (`native`), or the path's own target flags (to compile a
    path this CPU cannot run)."""
    define = f"-DBJ_ISA_{isa.upper()}"
    if not native:
        return [*ISA_TARGET_FLAGS[isa], define]
    if isa == "generic":  # x86: the baseline, no vector extensions; elsewhere (Arm) the CPU's own (NEON, SVE)
        return ["-mcpu=native", define] if platform.machine().lower() in ("aarch64", "arm64") else [define]
    if isa == "avx2" and "avx512f" in cpu_identity()[1]:
        return ["-march=native", "-mno-avx512f", define]  # an AVX-512 CPU running the AVX2 path (tests, comparisons)
    return ["-march=native", define]


def compile_only(source: str, defines: dict[str, int], isa: str) -> None:
    """Compile `source` for the `isa` path with its target flags to an object thrown away: a path this CPU cannot run
    is still checked to build. Raises BuildError with the compiler's first error.

    At -O1, not the build's -O3: what decides whether a path compiles (its types, its intrinsics and the target
    flags they need, always-inline helpers' targets) is checked before the optimizer runs, and -O1 keeps
    `__OPTIMIZE__` defined, so the intrinsics headers are read as in the real build; the -O3 passes only cost time
    (paged_attention_quant.cpp for AVX-512: 11.5 s at -O3, 3.7 s at -O1)."""
    cxx = compiler()
    args = (["-O1"] + [a for a in FLAGS if a != "-shared"] + isa_flags(isa, native=False)
            + [f"-D{k}={v}" for k, v in sorted(defines.items())])
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([cxx, *args, "-c", str(CSRC / source), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        first = next((ln for ln in out.stderr.splitlines() if "error" in ln), out.stderr.strip()[:300])
        raise BuildError(f"compiling {source} for {isa} failed: {first}")


def build_all(specs: list[tuple[str, dict[str, int]]], log=None) -> list[Path]:
    """`build` for several sources; what had to be compiled is reported in one line."""
    built: list[str] = []
    t0 = time.perf_counter()
    paths = [build(source, defines, log=log, built=built) for source, defines in specs]
    if built and log:
        log(f"compiled {ISA_NAMES[cpu_isa()]} kernels for this CPU ({'; '.join(built)}) in {time.perf_counter() - t0:.1f} s, "
            f"cached in {paths[0].parent}")
    return paths


def build(source: str, defines: dict[str, int], log=None, built: list[str] | None = None, isa: str | None = None) -> Path:
    """Path of the compiled shared library for `source` (a file in kernels/native/csrc/) with `defines`, for the
    `isa` path (default: `cpu_isa()`), compiling it first if this machine has no build of it yet. Raises
    BuildError. A compile is reported through `log` in one line, or appended to `built` for the caller to report."""
    isa = isa or cpu_isa()
    if not isa_runs_here(isa):
        raise BuildError(f"this CPU cannot run the {isa} path")
    cxx = compiler()
    src = CSRC / source
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # with the headers it includes
    args = [optimization(isa)] + FLAGS + isa_flags(isa) + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    model, flags = cpu_identity()
    key = hashlib.sha256(b"\0".join([
        text, " ".join(args).encode(), compiler_version(cxx).encode(), model.encode(), " ".join(sorted(flags)).encode(),
    ])).hexdigest()[:20]
    tag = "-".join([isa, *(f"{k.lower()}{v}" for k, v in sorted(defines.items()))])
    folder = cache_dir()
    lib = folder / f"{src.stem}-{tag}-{key}.so"
    if lib.is_file():
        return lib
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{lib.name}.lock", "a")
    except OSError as e:
        # a read-only cache: build into a private folder for this process only
        if log:
            log(f"kernel cache {folder} is not writable ({e.strerror}); compiling into a temporary folder "
                f"(set BATCHJOB_CACHE_DIR to cache builds)")
        folder = Path(tempfile.mkdtemp(prefix="batchjob-kernels-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # a loaded library outlives its file
        lib = folder / lib.name
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
            if lib.is_file():
                return lib
        t0 = time.perf_counter()
        tmp = folder / f".{lib.name}.{os.getpid()}.tmp"
        cmd = [cxx, *args, str(src), "-o", str(tmp)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"compiling {src.name} failed: {e}") from None
        if out.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = next((ln for ln in out.stderr.splitlines() if "error" in ln), out.stderr.strip()[:300])
            raise BuildError(f"compiling {src.name} failed: {first}")
        os.replace(tmp, lib)  # atomic: a reader sees the whole library or none
        what = " ".join([src.stem, *(f"{k.lower()} {v}" for k, v in sorted(defines.items()))])
        if built is not None:
            built.append(what)
        elif log:
            log(f"compiled {ISA_NAMES[isa]} kernels for this CPU ({what}) in {time.perf_counter() - t0:.1f} s, cached in {folder}")
        return lib
    finally:
        if lock is not None:
            lock.close()
