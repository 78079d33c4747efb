"""Entry points of installed distributions: load and check each; skip a broken one with one line.

The method and benchmark registries (rbs_bench.methods, rbs_bench.benchmarks) read their entry-point
groups through `load`. An entry point that fails to import, or whose object fails the registry's
check, is left out: every other method and benchmark keeps working, and stderr gets one line that
names the entry point, its distribution and what to fix, e.g.

    rbs-bench: warning: skipped method plugin 'meandot' (entry point meandot = mdot:MeanDot of
    distribution mdot 0.1): lacks knob_direction; add the class attribute knob_direction = 1 or -1

(one line on the terminal). A registry reads its group once per process (again after
`rbs_bench.methods.refresh()` or a change of sys.path), so each problem is printed once;
`problems()` lists those of the last read (for `--help` and tests).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from rbs_bench.errors import first_line


class PluginError(ValueError):
    """What is wrong with a plugin and what to change, in one line."""


@dataclass(frozen=True)
class Problem:
    kind: str  # "method" or "benchmark"
    name: str  # the entry point's name
    where: str  # entry point and distribution
    message: str  # what is wrong and what to fix

    def line(self) -> str:
        what = f"{self.kind} plugin {self.name!r} ({self.where})"
        return f"rbs-bench: warning: skipped {what}: {self.message}"


_PROBLEMS: dict[tuple[str, str], Problem] = {}  # (kind, name) -> the last scan's problem


def describe(ep: EntryPoint) -> str:
    """`entry point <name> = <value> of distribution <dist> <version>` (the owner when known)."""
    dist = getattr(ep, "dist", None)
    owner = f" of distribution {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value}{owner}"


def report(kind: str, ep: EntryPoint, message: str) -> None:
    """Record a broken plugin and print its line."""
    problem = Problem(kind, ep.name, describe(ep), " ".join(message.split()))
    _PROBLEMS[(kind, ep.name)] = problem
    print(problem.line(), file=sys.stderr, flush=True)


def problems(kind: str | None = None) -> list[Problem]:
    """The plugins skipped so far in this process (of one kind, or all)."""
    return [p for p in _PROBLEMS.values() if kind is None or p.kind == kind]


def load(
    group: str, kind: str, check: Callable[[str, Any], None], taken: set[str] = frozenset()
) -> dict[str, Any]:
    """name -> object of every entry point of `group` that imports and passes `check(name, obj)`
    (which raises PluginError). A name in `taken` (already registered) is skipped too."""
    for key in [key for key in _PROBLEMS if key[0] == kind]:  # this scan's problems replace them
        del _PROBLEMS[key]
    out: dict[str, Any] = {}
    for ep in entry_points(group=group):
        if ep.name in taken or ep.name in out:
            taker = f"the name {ep.name!r} is taken by another {kind}"
            report(kind, ep, f"{taker}; rename the entry point")
            continue
        try:
            obj = ep.load()
        except Exception as e:  # any import failure of someone else's code: skip, not crash
            why = first_line(e, typed=True)
            report(kind, ep, f"cannot import {ep.value} ({why}); fix or uninstall it")
            continue
        try:
            check(ep.name, obj)
        except PluginError as e:
            report(kind, ep, str(e))
            continue
        out[ep.name] = obj
    return out
