"""The package's shape, as layer rules: no import cycle, each layer imports only the layers below it, the
engine's core is pure Python, kernels are leaf code, at most six modules sit directly in batchjob/. Static:
reads the sources, imports nothing."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"batchjob": "batchjob", "kernels": "batchjob.kernels"}  # folder -> import name (pyproject package-dir)
# the modules directly in batchjob/, each with what it may import of ours: the leaves (version, errors), device (the
# start-up choices), the API over the job and the engine, and the package's lazy surface
TOP_LEVEL: dict[str, tuple[str, ...]] = {
    "batchjob.version": (),
    "batchjob.errors": (),
    "batchjob.notices": (),  # one line to the operator, for every layer (kernels included)
    "batchjob.device": ("batchjob.errors",),
    "batchjob.api": ("batchjob.job", "batchjob.engine", "batchjob.models", "batchjob.kernels", "batchjob.images",
                     "batchjob.device", "batchjob.errors", "batchjob.version", "batchjob.launch"),
    "batchjob": ("batchjob.api", "batchjob.errors", "batchjob.version"),
    "batchjob.__main__": ("batchjob.cli",),
}

# what each layer may import of ours, besides itself (a prefix matches a package and everything in it)
LAYERS = {
    "batchjob.kernels": ("batchjob.notices",),
    "batchjob.models": ("batchjob.kernels", "batchjob.errors", "batchjob.notices"),
    "batchjob.engine": ("batchjob.models", "batchjob.kernels", "batchjob.errors", "batchjob.notices"),
    "batchjob.io": ("batchjob.errors", "batchjob.notices", "batchjob.version"),
    "batchjob.images": ("batchjob.errors", "batchjob.notices",),  # reading and decoding a row's images, pixel values
    "batchjob.sharding": ("batchjob.io", "batchjob.errors", "batchjob.notices"),  # a job cut into shards: outputs, progress, Slurm arrays
    "batchjob.tool_calls": (),  # a row's tools, the call parsers and grammars: plain data and text
    "batchjob.reasoning": ("batchjob.engine", "batchjob.errors", "batchjob.notices"),  # thinking split from answers; budgets as grammars
    "batchjob.lora": ("batchjob.models", "batchjob.kernels", "batchjob.errors", "batchjob.notices"),  # adapters read and put on a model
    "batchjob.job": ("batchjob.engine", "batchjob.models", "batchjob.kernels", "batchjob.io", "batchjob.sharding",
                     "batchjob.images", "batchjob.device", "batchjob.errors", "batchjob.notices", "batchjob.version", "batchjob.tool_calls",
                     "batchjob.reasoning", "batchjob.lora"),
    # a process that runs shards, the driver's loop, data parallel on this node
    "batchjob.launch": ("batchjob.job", "batchjob.engine", "batchjob.sharding", "batchjob.io", "batchjob.errors",
                        "batchjob.notices"),
    # shards on Ray; LLMStage, an LLM (the API) as a Ray Data stage
    "batchjob.ray": ("batchjob.api", "batchjob.launch", "batchjob.job", "batchjob.sharding", "batchjob.io",
                     "batchjob.errors", "batchjob.notices"),
    "batchjob.cli": ("batchjob.job", "batchjob.engine", "batchjob.models", "batchjob.kernels", "batchjob.io",
                     "batchjob.sharding", "batchjob.launch", "batchjob.ray", "batchjob.images", "batchjob.errors", "batchjob.notices", "batchjob.version", "batchjob.bench"),
    "batchjob.bench": ("batchjob.api", "batchjob.job", "batchjob.engine", "batchjob.models", "batchjob.kernels",
                       "batchjob.io", "batchjob.sharding", "batchjob.ray", "batchjob.images", "batchjob.device", "batchjob.errors",
                       "batchjob.notices", "batchjob.version"),
}
# what the job, the API, the command line and the cluster code may import of the engine: its surface (requests in,
# outputs out, the Engine, and the config it is built with); never engine/core, worker, sample, spec_decode, structured
ENGINE_SURFACE = ("batchjob.engine", "batchjob.engine.engine", "batchjob.engine.requests", "batchjob.engine.config",
                  "batchjob.engine.placement", "batchjob.engine.tensor_parallel")
ENGINE_CORE = "batchjob.engine.core"  # scheduler, lanes, block pool, sequences: plain Python, no tensors


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of ours that `name` imports, at module level or inside functions (a lazy import is still an edge)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
        for target in targets:
            while target and target not in mods:  # `import batchjob.io.sink as s` -> batchjob.io.sink
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert _cycles(_graph()) == []


ENGINE_PARTS = ("core", "worker", "sample", "spec_decode", "structured")  # engine/'s folders


def _part(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["batchjob", "engine"] and parts[2] in ENGINE_PARTS else None


def test_the_engines_parts_import_each_other_in_one_direction():
    """engine/'s folders, each taken as one node (type-only imports included): no loop. What a row asks of the engine
    (SamplingParams, PoolingParams, ImageSlot) lives in engine/params.py beside them; what the core asks of a row's
    grammar and of a step's mask is a Protocol in the core; a proposer keeps its rows' state itself."""
    parts: dict[str, set[str]] = {p: set() for p in ENGINE_PARTS}
    for name, deps in _graph().items():
        if (a := _part(name)) is not None:
            parts[a] |= {b for d in deps if (b := _part(d)) is not None and b != a}
    assert _cycles(parts) == []


def test_the_job_asks_a_source_through_its_interface():
    """job/, the API and the command line never ask which Source class they hold (isinstance on a *Source, or a
    shard's `inner` read around it): what they need is a method of io/sources/base.py's Source."""
    found = []
    for name, path in _modules().items():
        if not (_under(name, "batchjob.job") or _under(name, "batchjob.cli") or name == "batchjob.api"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if node.func.id == "isinstance" and any(ast.unparse(k).endswith("Source") for k in kinds):
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and any(isinstance(a, ast.Constant) and a.value == "inner" for a in node.args):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_only_the_model_and_the_engine_read_a_models_adapters():
    """The adapters on a model are the decoder's (each step's slots) and the engine's (their digests), typed by
    models/adapters.py's ModelAdapters; the job knows the slots it asked for (job/engine_setup.py adapter_slots) and
    never reads them back through the engine's model."""
    found = []
    for name, path in _modules().items():
        if _under(name, "batchjob.models") or _under(name, "batchjob.lora") or name == "batchjob.engine.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "adapters" and \
                    re.search(r"(model|models\[\d+\])$", ast.unparse(node.value)):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_layer_imports_only_the_layers_below_it():
    graph = _graph()
    leaks = {}
    for layer, allowed in LAYERS.items():
        for name, deps in graph.items():
            if _under(name, layer):
                bad = sorted(d for d in deps if not _under(d, layer) and not any(_under(d, a) for a in allowed))
                if bad:
                    leaks[name] = bad
    assert leaks == {}


def test_the_top_level_modules_import_only_what_they_may():
    graph = _graph()
    leaks = {name: sorted(d for d in graph[name] if not any(_under(d, a) for a in allowed))
             for name, allowed in TOP_LEVEL.items()}
    assert {name: bad for name, bad in leaks.items() if bad} == {}


def test_outside_the_engine_only_its_surface_is_imported():
    graph = _graph()
    callers = [n for n in graph if n == "batchjob.api" or any(_under(n, p) for p in ("batchjob.job", "batchjob.cli",
                                                                                    "batchjob.sharding"))]
    leaks = {n: sorted(d for d in graph[n] if _under(d, "batchjob.engine") and d not in ENGINE_SURFACE)
             for n in callers}
    assert {n: bad for n, bad in leaks.items() if bad} == {}


def test_every_module_belongs_to_a_layer_or_the_top_level():
    stray = sorted(n for n in _modules() if n not in TOP_LEVEL and not any(_under(n, layer) for layer in LAYERS))
    assert stray == []


def test_at_most_seven_modules_sit_directly_in_batchjob():
    """The package's face and its leaves: __init__, __main__, api, device, errors, notices, version."""
    direct = [p.name for p in (ROOT / "batchjob").glob("*.py")]
    assert len(direct) <= 7, direct


def _kernels_surface() -> tuple[dict[str, str], set[str]]:
    """The names kernels/__init__.py serves, each with its home module, and the modules it lets the rest import
    whole (read, not imported)."""
    tree = ast.parse((ROOT / "kernels" / "__init__.py").read_text())
    values = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
              if isinstance(t, ast.Name)}
    homes = {k.value: v.value for k, v in zip(values["_HOMES"].keys, values["_HOMES"].values)}
    modules = {e.value for e in values["SURFACE_MODULES"].elts}
    return homes, modules


# outside kernels/, what reaches past the surface, and why
KERNELS_INSIDE = {"batchjob.bench.kv_quality": "sets the int4 KV scale group of the reference (kv_quant.GROUP4) to "
                                               "compare layouts: an experiment on the reference itself"}


def test_outside_kernels_only_its_surface_is_imported():
    """Nothing outside kernels/ imports kernels.reference, native, triton, dispatch or interface: only the names
    kernels/__init__.py serves and its SURFACE_MODULES."""
    names, modules = _kernels_surface()
    surface = {"batchjob.kernels", *(f"batchjob.kernels.{m}" for m in modules)}
    bad = []
    for name, path in _modules().items():
        if _under(name, "batchjob.kernels") or name in KERNELS_INSIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and _under(node.module, "batchjob.kernels"):
                if node.module not in surface:
                    bad.append(f"{name}: from {node.module} import ...")
                elif node.module == "batchjob.kernels":
                    bad += [f"{name}: {a.name} is not on the kernels' surface" for a in node.names if a.name not in names]
            elif isinstance(node, ast.Import):
                bad += [f"{name}: import {a.name}" for a in node.names
                        if _under(a.name, "batchjob.kernels") and a.name not in surface]
    assert not bad, "\n".join(bad)


def test_the_kernels_surface_names_resolve():
    homes, modules = _kernels_surface()
    for module in modules:
        assert (ROOT / "kernels" / f"{module}.py").is_file(), module
    for name, home in homes.items():  # each name's home defines it (read, not imported: no torch here)
        source = (ROOT / "kernels" / (home.replace(".", "/") + ".py")).read_text()
        assert re.search(rf"^(def|class) {name}\b|^{name}\b\s*[:=]|^from .* import .*\b{name}\b", source, re.M), (name, home)


def test_the_engine_core_imports_no_torch_or_numpy():
    heavy = {}
    for name, path in _modules().items():
        if _under(name, ENGINE_CORE):
            found = sorted(m for m in _third_party(path) if m.split(".")[0] in ("torch", "numpy", "triton"))
            if found:
                heavy[name] = found
    assert heavy == {}


def test_the_bench_calls_the_library_not_the_command_line():
    graph = _graph()
    assert {n: sorted(d for d in deps if _under(d, "batchjob.cli"))
            for n, deps in graph.items() if _under(n, "batchjob.bench") and any(_under(d, "batchjob.cli") for d in deps)} == {}


def _third_party(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found
