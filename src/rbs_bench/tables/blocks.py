"""The registry of generated documentation blocks, and what block functions share.

A block is a named piece of Markdown that `python -m rbs_bench.tables.docs` (`make docs`, run by
`make tables`) writes between two markers in a documentation file, from the records and CSVs under
results/ only:

    <!-- generated: NAME (make docs; do not edit) -->
    ...
    <!-- end generated: NAME -->

Adding one: write a function that takes a `Sources` and returns Markdown, decorate it with
`@block("NAME")` in one of the `blocks_*` modules (or a new one listed in docs.MODULES), and put the
two markers where the block belongs. The function reads only files under `src.results` (and, for
the embedded model's card, its training records under `src.root`), never runs a model, and names
the files it read (`sources_line`), so that a reader can check every figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rbs_bench.errors import UserError


@dataclass(frozen=True)
class Sources:
    """Where a block reads from: the repository root and its results directory."""

    root: Path
    results: Path

    def rel(self, path: Path) -> str:
        """`path` as the docs name it: relative to the repository root where it lies inside."""
        path = Path(path)
        try:
            return path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return path.as_posix()

    def need(self, path: Path) -> Path:
        """`path`, which must exist (one line naming it otherwise)."""
        if not Path(path).exists():
            raise UserError(f"generated docs read {self.rel(path)}, which is missing")
        return Path(path)


BlockFn = Callable[[Sources], str]
BLOCKS: dict[str, BlockFn] = {}


def block(name: str) -> Callable[[BlockFn], BlockFn]:
    """Register `fn` as the block `name` (a name is registered once)."""

    def register(fn: BlockFn) -> BlockFn:
        if name in BLOCKS:
            raise ValueError(f"generated block {name!r} is registered twice")
        BLOCKS[name] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------------------
# Formatting shared by the blocks.

MISSING = "–"


def num(value, spec: str = ".2f") -> str:
    """`value` formatted, or – where it is missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or pd.isna(value):
        return MISSING
    return format(value, spec)


def times(value, spec: str = ".2f") -> str:
    """A ratio as '5.33x'."""
    text = num(value, spec)
    return text if text == MISSING else f"{text}x"


def pct(value, spec: str = ".0f") -> str:
    """A share in [0, 1] as a percentage: '84%'."""
    text = num(None if value is None else 100 * value, spec)
    return text if text == MISSING else f"{text}%"


def span(values, spec: str = ".2f", unit: str = "") -> str:
    """The range of `values` as 'lo-hi' (one value when they agree at this precision)."""
    vals = [v for v in values if v is not None and not pd.isna(v)]
    if not vals:
        return MISSING
    lo, hi = format(min(vals), spec), format(max(vals), spec)
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def md_table(header: list[str], rows: list[list[str]], keys: int = 1) -> str:
    """A Markdown table: the first `keys` columns left-aligned, the rest right-aligned."""
    esc = lambda s: str(s).replace("|", "\\|")
    align = ["---"] * keys + ["---:"] * (len(header) - keys)
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def speed_file(src: Sources, name: str) -> Path:
    """A timing CSV or figure under results/speed/."""
    return src.results / "speed" / name


def kilo(n) -> str:
    """A context length as the tables name it: 131072 -> "128K"."""
    return f"{int(n) // 1024}K"


def sources_line(src: Sources, paths) -> str:
    """'From `a`, `b`.': the files a block read, as the docs name them."""
    names = list(dict.fromkeys(src.rel(p) for p in paths))
    return "From " + ", ".join(f"`{n}`" for n in names) + "."


_MEMO: dict = {}


def memo(key, fn):
    """`fn()`, computed once per pass of `make docs` (docs.stale and docs.rewrite clear it):
    several blocks read the same records. Callers must not modify what it returns."""
    if key not in _MEMO:
        _MEMO[key] = fn()
    return _MEMO[key]


def clear_memo() -> None:
    """Forget what `memo` holds (records may have changed since)."""
    _MEMO.clear()


def read_csv(src: Sources, path: Path) -> pd.DataFrame:
    """A committed CSV (one line naming it where it is missing)."""
    return pd.read_csv(src.need(path))


def last_rows(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last row of each key: a later run of the same setting replaces an earlier one."""
    return df.drop_duplicates(keys, keep="last")
