"""The package's modules import one way: no module reaches itself through its imports, and each
layer of the list in src/rbs_bench/__init__.py imports only from the layers above it.

Every import counts, also one inside a function (a lazy import that breaks a cycle at run time
still ties the two modules together). `from pkg import sub` of a submodule depends on the
submodule, not on the package's __init__.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rbs_bench

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "rbs_bench": ROOT / "src" / "rbs_bench",
    "rbs_bench.kernels": ROOT / "kernels",
    "rbs_bench.baselines": ROOT / "baselines",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".")
                if path.name != "__init__.py":
                    here = here[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            out.update(subs)
            if len(subs) < len(node.names) and base in mods:
                out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_graph_sees_lazy_and_submodule_imports():
    graph = _graph()
    # a function-level import counts (session imports models.generate inside warm_up)
    assert "rbs_bench.models.generate" in graph["rbs_bench.session"]
    # `from rbs_bench.tables import timing` depends on the submodule
    assert "rbs_bench.tables.timing" in graph["rbs_bench.tables.build"]
    # the shared layer imports nothing that stands on it
    for low in ("rbs_bench.session", "rbs_bench.budget", "rbs_bench.calibrations"):
        assert not graph[low] & {"rbs_bench.runner", "rbs_bench.calibrate", "rbs_bench.checks"}


def _layers() -> list[list[str]]:
    """The layer list of the package docstring: one layer per line that starts with four spaces
    and a name; a line indented six spaces continues the layer above (names before the first run
    of two spaces)."""
    layers = []
    for line in rbs_bench.__doc__.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        if line.startswith("      ") and layers and not line.startswith("       "):
            layers[-1] += [n.strip() for n in names.split(",") if n.strip()]
        elif re.match(r"    [_a-z]", line):
            layers.append([n.strip() for n in names.split(",") if n.strip()])
    return layers


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


PIPELINES = "runner"  # the layer whose modules must not import each other


def test_layers_import_only_from_the_layers_above():
    layers = _layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    units = {_unit(m) for m in _modules() if m != "rbs_bench"}
    assert units <= rank.keys(), f"not in the docstring's layers: {sorted(units - rank.keys())}"
    pipelines = next(layer for layer in layers if PIPELINES in layer)
    wrong = []
    for module, targets in _graph().items():
        if module == "rbs_bench":
            continue
        a = _unit(module)
        for target in targets:
            b = _unit(target)
            if b == "rbs_bench" or a == b:
                continue
            if rank[b] > rank[a] or (rank[a] == rank[b] and a in pipelines):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Modules that read files only: importing one must load neither torch nor Triton (errors.py
# holds UserError for them, paths.py the results layout).
LIGHT = (
    "rbs_bench.errors",
    "rbs_bench.paths",
    "rbs_bench.records",
    "rbs_bench.loggers",
    "rbs_bench.tables",
    "rbs_bench.tables.paper",
)


@pytest.mark.parametrize("module", LIGHT)
def test_reading_records_loads_neither_torch_nor_triton(module):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "print(len(heavy), heavy[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("0 "), f"import {module} loaded {out.stdout.strip()}"
