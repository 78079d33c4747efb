"""Benchmark registry: each entry is a module with `VERSION`, `TASKS`, `generate` and `score`."""

from __future__ import annotations

import importlib
from types import ModuleType

BENCHMARKS = {
    "ruler": "rbs_bench.benchmarks.ruler",
    "longbench_v2": "rbs_bench.benchmarks.longbench_v2",
    "infinitebench": "rbs_bench.benchmarks.infinitebench",
    "videomme": "rbs_bench.benchmarks.videomme",
}


def get(name: str) -> ModuleType:
    """The benchmark module registered under `name`."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(sorted(BENCHMARKS))}")
    return importlib.import_module(BENCHMARKS[name])
