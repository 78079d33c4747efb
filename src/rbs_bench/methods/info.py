"""What the harness knows about a method besides its rule: names, table order, sweeps, styling.

Every selector class carries one `MethodInfo` as its class attribute `info`. Tables, figures, the
observations, the timing benchmarks and the config defaults read it through `rbs_bench.methods`
(`info(name)`, `display(name)`, `order_key(name)`), so adding a method means writing one file: its
selector class with its `info`. A class without `info` gets `MethodInfo(display=<name>)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The spacings of an observations sweep (see `MethodInfo.sweep`).
SPACINGS = ("log", "lin", "tail")


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
    style        (colour, marker) in figures; colour None: the plotting library's cycle
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

    def __post_init__(self) -> None:
        if self.sweep is not None and self.sweep[0] not in SPACINGS:
            raise ValueError(f"sweep spacing must be one of {SPACINGS}, got {self.sweep[0]!r}")

    def paper_row(self, table: str) -> str:
        """The method's row name in the paper table `table` (its display name by default)."""
        return self.paper_rows.get(table, self.display)
