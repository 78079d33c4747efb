"""Benchmark registry: each entry satisfies `Benchmark` (a module or any object with its members).

The shipped benchmarks are modules of this package. Installed distributions add theirs through the
entry-point group `rbs_bench.benchmarks`, e.g. in their pyproject.toml:

    [project.entry-points."rbs_bench.benchmarks"]
    mybench = "my_package.my_bench"

so that `benchmark=mybench` runs it (with a config generated from `BenchmarkCfg` when there is no
conf/benchmark/mybench.yaml: its first task, no context lengths set). docs/benchmarks.md describes
the shipped ones.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

BENCHMARKS = {
    "ruler": "rbs_bench.benchmarks.ruler",
    "longbench_v2": "rbs_bench.benchmarks.longbench_v2",
    "infinitebench": "rbs_bench.benchmarks.infinitebench",
    "videomme": "rbs_bench.benchmarks.videomme",
}
ENTRY_POINT_GROUP = "rbs_bench.benchmarks"


@runtime_checkable
class Benchmark(Protocol):
    """What the runner, calibration and tables need of a benchmark.

    VERSION     written into every record; change it whenever prompts or scoring change
    TASKS       task name -> its spec (anything; the runner only checks names against it)
    generate    (task, context_length, num_samples, tokenizer, *, seed, wrap, max_new_tokens,
                data) -> list of rbs_bench.benchmarks._text.Sample, each prompt fitted so that it
                and its generation fit in context_length tokens of `tokenizer` (an encoder adding
                no special tokens); `wrap` puts text in the model's chat format, `data` holds the
                config's named data sources
    score_one   (task, prediction, references) -> one sample's score, 0-100
    check_data  (task, data) -> None, or ValueError with one line when a data source the task
                needs is missing or unreadable; called before any model is loaded
    aggregate   (records DataFrame) -> the benchmark's summary DataFrame

    Optional: MAX_SAMPLES, the most samples `generate` can make for one task and length (a
    benchmark that generates its prompts); a larger benchmark.num_samples stops before anything
    is generated.
    """

    VERSION: str
    TASKS: Mapping[str, Any]

    def generate(
        self,
        task: str,
        context_length: int,
        num_samples: int,
        tokenizer: Any,
        seed: int = 42,
        wrap: Callable[..., str] | None = None,
        max_new_tokens: int | None = None,
        data: dict | None = None,
    ) -> list: ...

    def score_one(self, task: str, prediction: str, references: Sequence[str]) -> float: ...

    def check_data(self, task: str, data: dict | None) -> None: ...

    def aggregate(self, df) -> Any: ...


# The last scan of the entry points and the sys.path it read: scanning the installed
# distributions takes milliseconds, and tables look a benchmark up once per cell.
_SCAN: tuple[tuple[str, ...], dict[str, Callable[[], Any]]] | None = None


def _registered() -> dict[str, Callable[[], Any]]:
    """name -> loader of every benchmark: this package's, then the entry points' (read again
    whenever sys.path changed since the last read, as when a distribution is put on it)."""
    global _SCAN
    key = tuple(sys.path)
    if _SCAN is None or _SCAN[0] != key:
        out: dict[str, Callable[[], Any]] = {
            name: (lambda mod=mod: importlib.import_module(mod)) for name, mod in BENCHMARKS.items()
        }
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in out:
                raise ValueError(f"a plugin registers benchmark {ep.name!r}, which already exists")
            out[ep.name] = ep.load
        _SCAN = (key, out)
    return dict(_SCAN[1])


def available() -> list[str]:
    return sorted(_registered())


def get(name: str) -> Benchmark:
    """The benchmark registered under `name` (checked against the `Benchmark` protocol)."""
    loaders = _registered()
    if name not in loaders:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(sorted(loaders))}")
    bench = loaders[name]()
    missing = [m for m in _MEMBERS if not hasattr(bench, m)]
    if missing:
        raise ValueError(f"benchmark {name!r} lacks {', '.join(missing)} (see Benchmark)")
    return bench


_MEMBERS = ("VERSION", "TASKS", "generate", "score_one", "check_data", "aggregate")
