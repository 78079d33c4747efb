"""What the harness knows about a method besides its rule: names, table order, sweeps, styling.

Every selector class carries one `MethodInfo` as its class attribute `info`. Tables, figures, the
observations, the timing benchmarks and the config defaults read it through `rbs_bench.methods`
(`info(name)`, `display(name)`, `order_key(name)`), so adding a method means writing one file: its
selector class with its `info`. A class without `info` gets `MethodInfo(display=<name>)`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The spacings of an observations sweep (see `MethodInfo.sweep`).
SPACINGS = ("log", "lin", "tail")


@dataclass(frozen=True)
class FastPath:
    """What `rbs_bench.bench.fast_paths` checks and times of one selector besides its calibrated
    setting's two selector paths.

    also       further field settings whose two paths are checked and timed too, e.g.
               ({"tau": 1.0},); every row of the method records the fields they set
    compare    (Triton selection, PyTorch selection) -> (kept entries in one and not the other,
               entries the PyTorch selection keeps); None: their block masks are compared
    executors  executors of the selection's own `attend`, timed on the calibrated Triton
               selection; the first is the reference: its run on fp32 inputs is the truth every
               executor's error is measured against
    """

    also: tuple[Mapping[str, Any], ...] = ()
    compare: Callable[[Any, Any], tuple[int, int]] | None = None
    executors: tuple[str, ...] = ()


@dataclass(frozen=True)
class MethodInfo:
    """Class-level metadata of one selector.

    display      its name in tables, figures and the paper's tables
    order        its position in tables and figures (ascending; ties and unknown methods by name)
    paper_rows   paper-table label -> the row's name in that table where it differs from display
                 (e.g. {"tab:selector_ablation": "RBS adaptive union"})
    threshold_field  the field a table shows as the calibrated threshold (None: the knob)
    sweep        (spacing, lo, hi) of the knob values the observations trace its curve at:
                 "log" geometric, "lin" linear, "tail" 1 - geometric from 1 - lo to 1 - hi
                 (coverage fractions, dense near 1); None: geometric over the knob range
    style        (colour, marker) in figures; colour None: a colour of PALETTE picked by a hash
                 of the name (`colour`), so that no method's colour depends on which others exist
    overlay      its curves coincide with another method's (the same rule at another default):
                 drawn dotted with hollow markers
    headline     the method under study: the default of method-valued tool options, drawn
                 strongest in figures
    own_executor its selection is not made of blocks and brings its own `attend`
    throughput   compared at batch > 1 in the prompt-throughput table by default
    reference    an upper reference rather than a prefill method (it reads the dense attention):
                 tables never mark it best
    compare      in the default method lists of the comparison studies (observations, timing);
                 False for methods that are not a prefill contender (e.g. one that reads the
                 dense attention itself)
    fast_path    a `FastPath`: `rbs_bench.bench.fast_paths` checks its Triton selector path
                 (impl="triton") against its PyTorch path (impl="torch") and times both; None:
                 not part of that check
    """

    display: str
    order: float = 1000.0
    paper_rows: Mapping[str, str] = field(default_factory=dict)
    threshold_field: str | None = None
    sweep: tuple[str, float, float] | None = None
    style: tuple[str | None, str] = (None, "o")
    overlay: bool = False
    headline: bool = False
    own_executor: bool = False
    throughput: bool = False
    reference: bool = False
    compare: bool = True
    fast_path: FastPath | None = None

    def __post_init__(self) -> None:
        if self.sweep is not None and self.sweep[0] not in SPACINGS:
            raise ValueError(f"sweep spacing must be one of {SPACINGS}, got {self.sweep[0]!r}")

    def paper_row(self, table: str) -> str:
        """The method's row name in the paper table `table` (its display name by default)."""
        return self.paper_rows.get(table, self.display)


# Colours of methods that declare none: matplotlib's tab20, darker shade first, less the shades the
# shipped methods declare; picked by a hash of the name, never by position.
PALETTE = (
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
    "#bcbd22", "#dbdb8d", "#17becf", "#9edae5", "#393b79", "#637939", "#8c6d31", "#843c39",
)  # fmt: skip


def colour(name: str, info: MethodInfo) -> str:
    """The method's figure colour: its declared `style` colour, else a PALETTE entry chosen by a
    hash of its name (the same in every process and whatever other methods are drawn)."""
    declared = info.style[0]
    if declared is not None:
        return declared
    digest = hashlib.sha1(name.encode()).digest()
    return PALETTE[int.from_bytes(digest[:4], "big") % len(PALETTE)]


def line_style(name: str, info: MethodInfo) -> dict:
    """matplotlib keyword arguments of a method's line: its label (display name), colour and
    marker; the headline method drawn thicker, larger and on top; an overlay dotted and hollow."""
    col = colour(name, info)
    head = info.headline
    return {
        "label": info.display,
        "color": col,
        "marker": info.style[1],
        "ls": ":" if info.overlay else "-",
        "mfc": "none" if info.overlay else col,
        "lw": 2.6 if head else 1.4,
        "ms": 7.5 if head else 5.0,
        "zorder": 4 if head else 2,
    }
