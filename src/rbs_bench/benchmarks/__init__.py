"""Benchmark registry: each entry satisfies `Benchmark` (a module or any object with its members).

The shipped benchmarks are modules of this package. Installed distributions add theirs through the
entry-point group `rbs_bench.benchmarks`, e.g. in their pyproject.toml:

    [project.entry-points."rbs_bench.benchmarks"]
    mybench = "my_package.my_bench"

so that `benchmark=mybench` runs it (with a config generated from `BenchmarkCfg` when there is no
conf/benchmark/mybench.yaml: its first task, no context lengths set). A plugin that fails to import
or lacks a member of `Benchmark` is skipped with one line on stderr (rbs_bench.plugins); every other
benchmark keeps working. A plugin builds its samples as `Sample` (and may fit text to a length with
`fit_middle`), both exported here. docs/benchmarks.md describes the shipped ones.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rbs_bench import plugins
from rbs_bench.benchmarks._text import Encoder, Sample, fit_middle
from rbs_bench.plugins import PluginError

__all__ = [
    "BENCHMARKS",
    "ENTRY_POINT_GROUP",
    "Benchmark",
    "Encoder",
    "Sample",
    "available",
    "check_benchmark",
    "fit_middle",
    "get",
    "plugin_names",
]

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
                data) -> list of rbs_bench.benchmarks.Sample, each prompt fitted so that it
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
_MEMBERS = ("VERSION", "TASKS", "generate", "score_one", "check_data", "aggregate")
_FUNCTIONS = ("generate", "score_one", "check_data", "aggregate")


def check_benchmark(name: str, bench) -> None:
    """Raise PluginError (one line: what to change) unless `bench` satisfies `Benchmark`."""
    missing = [m for m in _MEMBERS if not hasattr(bench, m)]
    if missing:
        raise PluginError(
            f"lacks {', '.join(missing)}; define {', '.join(missing)} as rbs_bench.benchmarks."
            "Benchmark describes (VERSION: a string written into every record)"
        )
    if not isinstance(bench.VERSION, str) or not bench.VERSION:
        raise PluginError(f"VERSION is {bench.VERSION!r}; set it to a non-empty string")
    if not isinstance(bench.TASKS, Mapping) or not bench.TASKS:
        raise PluginError("TASKS is empty or not a mapping; map each task name to its spec")
    for fn in _FUNCTIONS:
        if not callable(getattr(bench, fn)):
            raise PluginError(f"{fn} is not callable; define {fn}() as Benchmark describes")


def _registered() -> dict[str, Callable[[], Any]]:
    """name -> loader of every benchmark: this package's, then the entry points' that import and
    pass `check_benchmark` (read again whenever sys.path changed since the last read, as when a
    distribution is put on it). A broken plugin is skipped with one line on stderr."""
    global _SCAN
    key = tuple(sys.path)
    if _SCAN is None or _SCAN[0] != key:
        out: dict[str, Callable[[], Any]] = {
            name: (lambda mod=mod: importlib.import_module(mod)) for name, mod in BENCHMARKS.items()
        }
        loaded = plugins.load(ENTRY_POINT_GROUP, "benchmark", check_benchmark, set(out))
        out.update({name: (lambda b=b: b) for name, b in loaded.items()})
        _SCAN = (key, out)
    return dict(_SCAN[1])


def available() -> list[str]:
    return sorted(_registered())


def plugin_names() -> list[str]:
    """The registered benchmarks that come from entry points."""
    return sorted(set(_registered()) - set(BENCHMARKS))


def get(name: str) -> Benchmark:
    """The benchmark registered under `name` (checked against the `Benchmark` protocol)."""
    loaders = _registered()
    if name not in loaders:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(sorted(loaders))}")
    bench = loaders[name]()
    try:
        check_benchmark(name, bench)
    except PluginError as e:
        raise ValueError(f"benchmark {name!r}: {e}") from None
    return bench
