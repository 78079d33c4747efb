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

**Isolation.** A plugin's import and check run in a thread of their own, bounded by
RBS_BENCH_PLUGIN_IMPORT_S seconds (IMPORT_S by default): whatever they raise, SystemExit and
KeyboardInterrupt included, skips the plugin with its one line, and so does an import that is
still running at the bound (it is left behind in its thread, which never blocks the exit). A
SIGINT or SIGTERM to the command itself still stops it (errors.stop_on_signals).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from rbs_bench.errors import first_line

IMPORT_S = 30.0  # the longest a plugin's import and check may take (RBS_BENCH_PLUGIN_IMPORT_S)


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
        obj, problem = _load_checked(ep, check)
        if problem is not None:
            report(kind, ep, problem)
            continue
        out[ep.name] = obj
    return out


def import_bound() -> float:
    """The seconds a plugin's import and check may take (RBS_BENCH_PLUGIN_IMPORT_S, else
    IMPORT_S)."""
    try:
        bound = float(os.environ.get("RBS_BENCH_PLUGIN_IMPORT_S", IMPORT_S))
    except ValueError:
        bound = IMPORT_S
    return bound if bound > 0 else IMPORT_S


def _load_checked(ep: EntryPoint, check: Callable[[str, Any], None]) -> tuple[Any, str | None]:
    """(the entry point's object, None), or (None, what is wrong) when its import or check
    raises anything or outlasts `import_bound()`. Both run in a daemon thread: someone else's
    code cannot end or hang the command."""
    got: dict[str, Any] = {}

    def work() -> None:
        try:
            got["obj"] = ep.load()
        except BaseException as e:  # SystemExit, KeyboardInterrupt too: skip, not crash
            got["problem"] = (
                f"cannot import {ep.value} ({first_line(e, typed=True)}); fix or uninstall it"
            )
            return
        try:
            check(ep.name, got["obj"])
        except PluginError as e:
            got["problem"] = str(e)
        except BaseException as e:  # the check runs the plugin's code (a select)
            got["problem"] = f"its check raised {first_line(e, typed=True)}; fix or uninstall it"

    bound = import_bound()
    thread = threading.Thread(target=work, name=f"plugin {ep.name}", daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        return None, (
            f"its import of {ep.value} took longer than {bound:g} s and was left behind; fix it, "
            "uninstall it, or raise RBS_BENCH_PLUGIN_IMPORT_S"
        )
    return got.get("obj"), got.get("problem")
