"""The paper's tables rebuilt from run records (Markdown and LaTeX), with the paper's values beside.

    python -m rbs_bench.tables [--results results] [--out results/tables]

For every results/runs/<experiment>/<model> directory it writes <out>/<experiment>_<model>.md and
.tex, built from the records on disk only (never by rerunning a model). An experiment with a table
spec (SPECS) gets the paper's layout; any other gets a summary table (report.summarize);
calibration_cost reads its calibration records (LOADERS). Where the run's setting is the paper's
(model, context length) a cell shows "ours (paper)", with the paper's numbers read from
results/paper/paper_values.csv. Every table lists the records files it used. The timing
experiments' tables (speed, memory, throughput, selector_time) come from
rbs_bench.bench.timing_tables, which this command also runs when it is installed.

    experiment         paper table                               layout
    ruler_budget       Table 2 (tab:ruler_budget)                targets x methods, density / acc.
    longbench_v2       Table 3 (tab:longbench_dual)              methods x length classes, density
    ruler_main         Table 4 (tab:ruler)                       methods (+ density row) x lengths
    infinitebench      Table 5 (tab:InfiniteBench)               tasks x methods, macro average
    videomme           Table 6 (tab:videomme)                    methods x durations
    selector_ablation  Tables 7, 12 (tab:selector_ablation,      selectors: density, accuracy,
                       tab:selector_breakdown)                   bootstrap 95% CI; task groups
    strict_density     Table 8 (tab:strict_density)              methods x anchors
    block_size         Table 9 (tab:block_sensitivity)           selector x block size
    thresholds         Table 10 (tab:threshold_sensitivity)      threshold pairs
    calibration_cost   Table 11 (tab:calibration)                methods: cost and max error

The paper values file is built from the paper's LaTeX source by `paper_values_from_tex` and checked
by hand; `--paper-tex PATH` re-parses the source and reports every cell that differs from the file
(`--write-paper-values` rewrites the file instead).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rbs_bench import methods
from rbs_bench.config import UserError
from rbs_bench.records import write_atomic
from rbs_bench.report import CELL, NOISE_HALF_WIDTH, load_records, summarize, wilson

PAPER_COLUMNS = ["table", "caption_short", "row", "column", "value", "unit", "tex_line", "bold"]

# A method's name in tables and its position come from its selector class (`MethodInfo`).
display = methods.display
MISSING = "–"


method_order = methods.order_key


# ------------------------------------------------------------------------------------------------
# The paper's values: one row per cell, read from the paper's LaTeX source.


@dataclass(frozen=True)
class TexTableSpec:
    """How to name the cells of one paper table (the parser does the rest)."""

    keys: int = 1  # leading cells that name the row (an empty one repeats the row above)
    unit: str = "percent"
    units: dict[str, str] = field(default_factory=dict)  # column substring -> unit
    split: tuple[str, ...] = ()  # suffixes of the parts of an "a / b" cell
    metric_rows: tuple[str, ...] = ()  # (plain rows' metric, italic rows' metric, ...)
    rename_rows: dict[str, str] = field(default_factory=dict)
    caption_values: tuple[tuple[str, str, str], ...] = ()  # (row, column, number as printed)


TEX_SPECS: dict[str, TexTableSpec] = {
    "tab:ruler_budget": TexTableSpec(
        split=("density", "accuracy"),
        caption_values=(("Dense", "Dense:accuracy", "89.69"), ("Dense", "Dense:density", "100")),
    ),
    "tab:longbench_dual": TexTableSpec(units={"Accuracy": "score0-1"}),
    "tab:ruler": TexTableSpec(metric_rows=("accuracy", "density")),
    "tab:InfiniteBench": TexTableSpec(unit="score0-1"),
    "tab:videomme": TexTableSpec(),
    "tab:selector_ablation": TexTableSpec(),
    "tab:strict_density": TexTableSpec(split=("density", "accuracy")),
    "tab:selector_breakdown": TexTableSpec(),
    "tab:a100_sweep": TexTableSpec(keys=2, split=("sys", "acc")),
    "tab:a100_throughput": TexTableSpec(
        keys=2,
        units={"wall time (ms)": "ms", "prompt tokens": "tokens", "tokens/s": "tokens/s"},
    ),
    "tab:block_sensitivity": TexTableSpec(keys=2, units={"Calibration parameter": "knob"}),
    "tab:threshold_sensitivity": TexTableSpec(
        keys=2,
        units={"alpha_": "threshold"},
        # "Qwen3-30B-A3B FP8" is one model name wrapped over two lines of the first column.
        rename_rows={
            "Qwen3-30B-A3B:Conservative": "Qwen3-30B-A3B FP8:Conservative",
            "FP8:Default": "Qwen3-30B-A3B FP8:Default",
            "FP8:Aggressive": "Qwen3-30B-A3B FP8:Aggressive",
        },
    ),
    "tab:calibration": TexTableSpec(
        units={
            "Configurations": "count",
            "Wall hours": "hours",
            "GPU-hours": "GPU-hours",
            "error (pp)": "pp",
        }
    ),
    "tab:dynamic_cost": TexTableSpec(unit="ms"),
    "tab:metadata": TexTableSpec(unit="MiB"),
    "tab:peak_memory": TexTableSpec(unit="GiB", split=("allocated", "reserved")),
}

# Numbers that figures carry only in their captions or in the text that reports them:
# (label, row, column, number as printed, unit, a string that occurs once, on that line).
FIGURE_VALUES = [
    (
        "fig:observations_b",
        "Q5",
        "RBS vs mean-only underestimation",
        "25",
        "pp",
        "25-percentage-point difference in Q5.",
    ),
    ("fig:observations_c", "Q5", "share of top-5% blocks", "39.5", "percent", "39.5\\% fall"),
    ("fig:observations_c", "uniform", "share of top-5% blocks", "20", "percent", "reference of 20"),
]
_SPEED = [
    ("standalone:128K", "RBS-Attention", "20.65"),
    ("standalone:128K", "FlashPrefill", "11.98"),
    ("standalone:128K", "FlexPrefill", "4.78"),
    ("standalone:128K", "MInference", "2.25"),
    ("standalone:128K", "XAttn", "2.97"),
    ("vllm_attention:128K", "RBS-Attention", "11.92"),
    ("vllm_ttft:128K", "RBS-Attention", "5.97"),
]
FIGURE_VALUES += [
    ("fig:speed_3panel", row, col, v, "x", "fig:speed_3panel} reports the H100")
    for row, col, v in _SPEED
]

_NUM = re.compile(r"^-?\d{1,3}(,\d{3})*(\.\d+)?$|^-?\d+(\.\d+)?$")


def _brace_arg(text: str, start: int) -> tuple[str, int]:
    """The balanced {...} argument starting at text[start] == '{', and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    raise ValueError(f"unbalanced braces at {text[start : start + 40]!r}")


def _clean(s: str) -> str:
    """LaTeX cell or caption text as plain text."""
    s = re.sub(r"\\(?:textbf|textit|emph|text)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\$\\alpha_\{\\rm (\w+)\}\$", r"alpha_\1", s)
    s = (
        s.replace("$\\times$", "x")
        .replace("$\\beta$", "beta")
        .replace("\\method{}", "RBS-Attention")
    )
    s = re.sub(r"\\ref\{([^{}]*)\}", r"\1", s).replace("~", " ").replace("\\%", "%")
    s = re.sub(r"\$([^$]*)\$", r"\1", s)
    return s.strip()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)&", line.strip().removesuffix("\\\\"))]


def _multicolumn(cell: str) -> tuple[int, str] | None:
    m = re.match(r"\\multicolumn\{(\d+)\}\{[^{}]*\}", cell)
    if not m:
        return None
    return int(m.group(1)), _brace_arg(cell, m.end())[0]


def _values(raw: str, spec: TexTableSpec, where: str) -> list[tuple[str, str, bool]]:
    """(column suffix, number without thousands separators, bold) for each number in a cell."""
    raw = raw.replace("\\%", "").replace("$\\times$", "").strip()
    ci = re.fullmatch(r"\[([\d.,]+), ([\d.,]+)\]", raw)
    if ci:
        parts = [(":low", ci.group(1)), (":high", ci.group(2))]
    elif " / " in raw:
        pieces = raw.split(" / ")
        if len(pieces) != len(spec.split):
            raise ValueError(f"{where}: {raw!r} has {len(pieces)} parts, spec names {spec.split}")
        parts = [(f":{s}", p) for s, p in zip(spec.split, pieces)]
    elif "/" in raw:
        parts = [(f":{i + 1}", p) for i, p in enumerate(raw.split("/"))]
    else:
        parts = [("", raw)]
    out = []
    for suffix, p in parts:
        bold = p.startswith("\\textbf{")
        text = _clean(p)
        if _NUM.match(text):
            out.append((suffix, text.replace(",", ""), bold))
        elif len(parts) > 1 and text not in ("---", ""):
            raise ValueError(f"{where}: part {text!r} of {raw!r} is not a number")
    return out


def _short(caption: str) -> str:
    text = _clean(caption)
    m = re.search(r"\.(\s|$)", text)
    return text[: m.start()] if m else text


def _unit(spec: TexTableSpec, column: str, raw: str) -> str:
    if "$\\times$" in raw:
        return "x"
    for key, unit in spec.units.items():
        if key in column:
            return unit
    return spec.unit


def _parse_table(label: str, lines: list[tuple[int, str]], spec: TexTableSpec) -> list[dict]:
    caption = ""
    for n, text in lines:
        if "\\caption{" in text:
            caption, cap_line = _brace_arg(text, text.index("\\caption{") + 8)[0], n
    short = _short(caption)
    rows = []
    for row, column, literal in spec.caption_values:
        if literal not in caption:
            raise ValueError(f"{label}: {literal} is not in the caption")
        unit = _unit(spec, column, "")
        rows.append(dict(row=row, column=column, value=literal, unit=unit, bold=False))
        rows[-1]["tex_line"] = cap_line
    in_tabular = False
    for n, text in lines:
        s = text.strip()
        if s.startswith("\\begin{tabular}"):  # a table may hold several (panels)
            in_tabular, body, header_rows, keys, panel, prev = True, False, [], [], "", ""
            continue
        if not in_tabular or s.startswith(("\\toprule", "\\cmidrule", "\\bottomrule")):
            continue
        if s.startswith("\\end{tabular}"):
            in_tabular = False
            continue
        if s.startswith("\\midrule"):
            body = True
            continue
        if not s.endswith("\\\\"):
            continue
        cells = _cells(s)
        if not body:
            expanded = []
            for c in cells:
                mc = _multicolumn(c)
                expanded += [_clean(mc[1])] * mc[0] if mc else [_clean(c)]
            header_rows.append(expanded)
            header = [":".join(h for h in col if h) for col in zip(*header_rows)]
            continue
        mc = _multicolumn(cells[0])
        if len(cells) == 1 and mc:
            panel, keys = _clean(mc[1]), []
            continue
        key_cells = [_clean(c) for c in cells[: spec.keys]]
        metric = spec.metric_rows[0] if spec.metric_rows else ""
        if spec.metric_rows and cells[0].startswith("\\textit{"):
            metric, name = key_cells[0], prev
        else:
            keys = [k or (keys[i] if i < len(keys) else "") for i, k in enumerate(key_cells)]
            name = ":".join(([panel] if panel else []) + keys)
            name = spec.rename_rows.get(name, name)
            prev = name
        for j in range(spec.keys, len(cells)):
            column = header[j] + (f":{metric}" if metric else "")
            for suffix, value, bold in _values(cells[j], spec, f"{label} line {n}"):
                unit = _unit(spec, column, cells[j])
                rows.append(dict(row=name, column=column + suffix, value=value, unit=unit))
                rows[-1].update(tex_line=n, bold=bold)
    return [dict(table=label, caption_short=short, **r) for r in rows]


def paper_values_from_tex(path: Path) -> list[dict]:
    """Every number of every table of the paper (and the figures' FIGURE_VALUES), one row per
    cell, in PAPER_COLUMNS; an "a / b" cell gives one row per part (column suffix ":<part>")."""
    lines = Path(path).read_text().splitlines()
    out, block = [], None
    for n, text in enumerate(lines, start=1):
        if text.strip().startswith("\\begin{table}"):
            block = []
        if block is not None:
            block.append((n, text))
        if text.strip().startswith("\\end{table}") and block is not None:
            label = next(m.group(1) for _, t in block if (m := re.search(r"\\label\{(.*?)\}", t)))
            if label not in TEX_SPECS:
                raise ValueError(f"{path}: no TEX_SPECS entry for table {label}")
            out += _parse_table(label, block, TEX_SPECS[label])
            block = None
    captions = {}
    for n, text in enumerate(lines, start=1):
        m = re.search(r"\\label\{(fig:[^}]*)\}", text)
        if m:  # a figure's caption is the \caption just above its \label
            cap = next(t for t in reversed(lines[: n - 1]) if "\\caption{" in t)
            captions[m.group(1)] = _short(_brace_arg(cap, cap.index("\\caption{") + 8)[0])
    for label, row, column, literal, unit, anchor in FIGURE_VALUES:
        hits = [n for n, t in enumerate(lines, start=1) if anchor in t]
        if len(hits) != 1 or literal not in lines[hits[0] - 1]:
            raise ValueError(f"{path}: {label} {literal!r} not found once near {anchor!r}")
        out.append(
            dict(table=label, caption_short=captions[label], row=row, column=column)
            | dict(value=literal, unit=unit, tex_line=hits[0], bold=False)
        )
    return [{k: r[k] for k in PAPER_COLUMNS} for r in out]


def paper_values_csv(rows: Iterable[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=PAPER_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r | {"bold": int(bool(r["bold"]))})
    return buf.getvalue()


@dataclass
class PaperValues:
    """The paper's numbers as printed, by (table, row, column)."""

    path: Path
    cells: dict[tuple[str, str, str], dict]

    @classmethod
    def load(cls, path: Path) -> PaperValues:
        path = Path(path)
        if not path.exists():
            raise UserError(f"{path} is missing; pass --paper-values with the paper's values file")
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        return cls(path, {(r["table"], r["row"], r["column"]): r for r in rows})

    def get(self, table: str, row: str, column: str) -> str | None:
        r = self.cells.get((table, row, column))
        return None if r is None else r["value"]

    def lines(self, table: str) -> tuple[int, int]:
        ns = [int(r["tex_line"]) for k, r in self.cells.items() if k[0] == table]
        return min(ns), max(ns)

    def parts(self, table: str, row: str, column: str) -> str | None:
        """The value of a cell, or its numbered parts ("2/5/10" from column:1, :2, :3)."""
        whole = self.get(table, row, column)
        if whole is not None:
            return whole
        got, i = [], 1
        while (v := self.get(table, row, f"{column}:{i}")) is not None:
            got.append(v)
            i += 1
        return "/".join(got) if got else None


# ------------------------------------------------------------------------------------------------
# Tables and their Markdown / LaTeX.


@dataclass
class Cell:
    ours: tuple[str, ...]  # formatted numbers (MISSING where we have none), or a label
    bold: tuple[bool, ...] = ()
    paper: tuple[str, ...] | None = None  # the paper's numbers as printed
    template: str | None = None  # how the parts read, e.g. "[{}, {}]"; default "a / b"
    interval: str | None = None  # the accuracy's 95% interval, e.g. "[30.0, 90.3]"
    interval_at: int = -1  # the part it follows (-1: the last)

    def _join(self, parts: Iterable[str]) -> str:
        parts = list(parts)
        if self.template and all(p != MISSING for p in parts):
            return self.template.format(*parts)
        return " / ".join(parts)

    def render(self, bold: Callable[[str], str], esc: Callable[[str], str]) -> str:
        b = self.bold or (False,) * len(self.ours)
        parts = [bold(esc(v)) if f else esc(v) for v, f in zip(self.ours, b)]
        if self.interval and parts:
            at = self.interval_at if 0 <= self.interval_at < len(parts) else len(parts) - 1
            parts[at] += f" {esc(self.interval)}"
        text = self._join(parts)
        return text + (f" ({self._join(esc(p) for p in self.paper)})" if self.paper else "")


@dataclass
class Table:
    title: str
    label: str  # LaTeX label
    header: list[str]
    rows: list[list[Cell]]
    lead: list[str] = field(default_factory=list)  # lines shown before the table (reference)
    notes: list[str] = field(default_factory=list)
    sources: list[tuple[str, int]] = field(default_factory=list)  # (records file, records used)
    keys: int = 1  # leading columns that name the row (left-aligned)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    bold = lambda s: f"**{s}**"
    out = [f"## {t.title}", ""]
    out += [line + "\n" for line in t.lead]
    out.append("| " + " | ".join(_md(h) for h in t.header) + " |")
    keys = max(1, getattr(t, "keys", 1))
    out.append("|" + "|".join(["---"] * keys + ["---:"] * (len(t.header) - keys)) + "|")
    for row in t.rows:
        out.append("| " + " | ".join(c.render(bold, _md) for c in row) + " |")
    out.append("")
    out += [n + "\n" for n in t.notes]
    out.append("Run records:\n")
    out += [f"- `{s}` ({n} records)" for s, n in t.sources]
    return "\n".join(out) + "\n"


_TEX_ESC = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#"}
_TEX_ESC |= {"$": r"\$", "{": r"\{", "}": r"\}", "–": "--", "~": r"\textasciitilde{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX_ESC.get(c, c) for c in s)


def to_latex(t: Table) -> str:
    bold = lambda s: f"\\textbf{{{s}}}"
    caption = " ".join([t.title + "."] + t.lead + t.notes)
    sources = "; ".join(f"\\texttt{{{tex_escape(s)}}} ({n})" for s, n in t.sources)
    keys = max(1, getattr(t, "keys", 1))
    out = [
        "\\begin{table}[htbp]",
        "\\centering",
        f"\\caption{{{tex_escape(caption)}}}",
        f"\\label{{{t.label}}}",
        "\\small",
        "\\setlength{\\tabcolsep}{4pt}",
        f"\\begin{{tabular}}{{@{{}}{'l' * keys}{'c' * (len(t.header) - keys)}@{{}}}}",
        "\\toprule",
        " & ".join(tex_escape(h) for h in t.header) + " \\\\",
        "\\midrule",
    ]
    out += [" & ".join(c.render(bold, tex_escape) for c in row) + " \\\\" for row in t.rows]
    out += ["\\bottomrule", "\\end{tabular}", "\\par\\smallskip"]
    out += [f"{{\\footnotesize Run records (records used): {sources}.\\par}}", "\\end{table}"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# Table specs: how an experiment's records become the paper's layout.


def cell_means(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Score and density per `keys`, averaged as report.summarize does: first per task x context
    length group, then over the groups (for keys == CELL this is summarize's overall table)."""
    groups = keys + [k for k in ("task", "context_length") if k not in keys]
    recall = {"recall": ("recall", "mean")} if "recall" in df else {}  # runs with recall=true
    by_group = (
        df.groupby(groups, sort=False)
        .agg(n=("score", "size"), score=("score", "mean"), density=("density", "mean"), **recall)
        .reset_index()
    )
    return (
        by_group.groupby(keys, sort=False)
        .agg(n=("n", "sum"), score=("score", "mean"), density=("density", "mean"), **recall)
        .reset_index()
    )


def has_recall(df: pd.DataFrame) -> bool:
    """Whether any record holds an attention recall (runs with recall=true)."""
    return "recall" in df and bool(df["recall"].notna().any())


def score_mean(df: pd.DataFrame) -> float:
    """A cell's score: the mean over its task x context-length groups of their mean scores."""
    if df.empty:
        return math.nan
    return float(df.groupby(["task", "context_length"], sort=False)["score"].mean().mean())


def bootstrap_ci(
    df: pd.DataFrame, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of `score_mean` over `n_boot` sample-bootstrap resamples.

    Samples are drawn with replacement within each task x context-length group (as many as the
    group has), so each resample keeps the cell's composition and its mean is `score_mean`'s rule.
    """
    import numpy as np

    if df.empty:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    groups = [g["score"].to_numpy(float) for _, g in df.groupby(["task", "context_length"])]
    means = np.zeros(n_boot)
    for scores in groups:
        idx = rng.integers(0, len(scores), size=(n_boot, len(scores)))
        means += scores[idx].mean(1)
    means /= len(groups)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def _sources(df: pd.DataFrame) -> list[tuple[str, int]]:
    return sorted(df.groupby("source").size().items())


def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", "_".join(str(p) for p in parts)).strip("_")


def _matches(series: pd.Series, want) -> bool:
    if isinstance(want, (tuple, list, set, frozenset)):
        return bool(series.isin(list(want)).all())
    return bool((series == want).all())


def _paper_applies(df: pd.DataFrame, setting: dict) -> bool:
    return all(k in df and _matches(df[k], v) for k, v in setting.items())


def _other_setting_note(df: pd.DataFrame, table: str, setting: dict) -> str:
    show = lambda v: "/".join(map(str, v)) if isinstance(v, (tuple, list, set)) else str(v)
    want = ", ".join(f"{k} {show(v)}" for k, v in setting.items())
    have = ", ".join(
        f"{k} {'/'.join(str(x) for x in sorted(df[k].unique()))}" for k in setting if k in df
    )
    return (
        f"The paper's cells ({table}) are for another setting ({want}); "
        f"this table is {have}, so only ours are shown."
    )


def _paper_note(pv: PaperValues, table: str) -> str:
    lo, hi = pv.lines(table)
    return (
        "Each cell: ours (the paper's value in parentheses where it reports the same "
        f"cell; {pv.path}, table {table}, rbs_attention.tex lines {lo}-{hi})."
    )


@dataclass(frozen=True)
class Metric:
    name: str  # the paper's column suffix, e.g. "accuracy"
    column: str  # record column after cell_means: "score" or "density"
    scale: float = 1.0
    fmt: str = ".2f"
    interval: bool = False  # a score: the cell also shows its 95% Wilson interval

    def format(self, value: float) -> str:
        return MISSING if pd.isna(value) else format(self.scale * value, self.fmt)


def interval_text(score: float, n) -> tuple[str | None, float]:
    """("[lo, hi]", half-width) of a score's 95% Wilson interval (report.wilson); (None, 0)
    where there is no score."""
    if pd.isna(score) or not n:
        return None, 0.0
    lo, hi = wilson(float(score), int(n))
    return f"[{lo:.1f}, {hi:.1f}]", (hi - lo) / 2


def noise_footnote(widest: float, ns: Iterable[int]) -> list[str]:
    """The table's note when an accuracy interval is wider than +-NOISE_HALF_WIDTH points."""
    if widest <= NOISE_HALF_WIDTH:
        return []
    n_text = ", ".join(str(n) for n in sorted(set(ns)))
    return [
        f"Accuracy in brackets: its 95% Wilson interval (report.wilson). Within noise: at "
        f"n={n_text} samples the intervals reach +-{widest:.0f} points (more than "
        f"{NOISE_HALF_WIDTH:.0f}), so accuracy differences between cells whose intervals overlap "
        "are not evidence of a difference."
    ]


RECALL = Metric("recall", "recall", 100.0)
RECALL_NOTE = (
    "Recall: the share of the dense causal attention mass on the kept (query, key) pairs, mean "
    "over layers, heads and samples (– where a run did not record it)."
)


@dataclass(frozen=True)
class Axis:
    field: str  # record column the axis groups on (after the spec's derive)
    title: str = ""
    label: Callable[[object], str] = str
    order: Callable[[object], object] = lambda v: v


@dataclass(frozen=True)
class PaperLink:
    """Where the paper reports the same cells, and the setting it reports them for.

    A setting value that is a tuple means any of its values (e.g. either model of a table)."""

    table: str  # its label in paper_values.csv
    setting: dict  # record field -> value, e.g. {"model": ..., "context_length": 131072}
    row: Callable[[str], str] = str  # our row label -> the paper's row name
    column: Callable[[object, str], str] = lambda col, metric: f"{col}:{metric}"
    reference: Callable[[str], tuple[str, str]] | None = None  # metric -> (row, column)


@dataclass(frozen=True)
class GridSpec:
    """Rows x columns of "metric / metric" cells, one table per value of the `split` fields.

    A reference method (dense) is left out of the grid and shown as one line; bold marks the best
    `bold` metric in each row (`bold_by="row"`) or column (`"column"`) among the grid's cells,
    skipping the row/column keys in `bold_skip`. `metric_rows` puts each metric on a row of its
    own under the row's label; `total_col` / `total_row` add the mean over the columns / rows."""

    title: str
    rows: Axis
    cols: Axis
    metrics: tuple[Metric, ...]
    split: tuple[str, ...] = ()
    reference: str | None = methods.DENSE
    bold: str | None = None
    bold_by: str = "row"
    bold_skip: tuple = ()
    metric_rows: bool = False
    total_col: str | None = None
    total_row: str | None = None
    paper: PaperLink | None = None
    derive: Callable[[pd.DataFrame], pd.DataFrame] = lambda df: df
    notes: tuple[str, ...] = ()
    recall: bool = False  # add the recall metric when the records hold one

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        df = self.derive(df.assign(model=df["model"] if "model" in df else model))
        spec = self
        if self.recall and has_recall(df):
            spec = dataclasses.replace(
                self,
                title=self.title.replace("density / accuracy", "density / accuracy / recall"),
                metrics=(*self.metrics, RECALL),
                notes=(*self.notes, RECALL_NOTE),
            )
        if not spec.split:
            return [spec._table(df, experiment, model, {}, pv)]
        tables = []
        for values, sub in df.groupby(list(spec.split), sort=True):
            where = dict(zip(spec.split, values))
            tables.append(spec._table(sub, experiment, model, where, pv))
        return tables

    def _paper_applies(self, df: pd.DataFrame) -> bool:
        return self.paper is not None and _paper_applies(df, self.paper.setting)

    def _values(self, grid: pd.DataFrame) -> tuple[list, list, dict]:
        """Row keys, column keys (totals included) and {(row, col): {metric column: value}}."""
        means = cell_means(grid, [self.rows.field, self.cols.field])
        row_keys = sorted(means[self.rows.field].unique(), key=self.rows.order)
        col_keys = sorted(means[self.cols.field].unique(), key=self.cols.order)
        cols = {mt.column for mt in self.metrics} | {"n"}
        at = {
            (r[self.rows.field], r[self.cols.field]): {c: r[c] for c in cols}
            for _, r in means.iterrows()
        }
        mean_of = lambda cells: {
            c: (
                pd.Series([x[c] for x in cells], dtype=float).sum()
                if c == "n"
                else pd.Series([x[c] for x in cells], dtype=float).mean()
            )
            for c in cols
        }
        if self.total_col:
            for rk in row_keys:
                have = [at[rk, ck] for ck in col_keys if (rk, ck) in at]
                if have:
                    at[rk, self.total_col] = mean_of(have)
        if self.total_row:
            for ck in col_keys:
                have = [at[rk, ck] for rk in row_keys if (rk, ck) in at]
                if have:
                    at[self.total_row, ck] = mean_of(have)
        col_keys = col_keys + ([self.total_col] if self.total_col else [])
        row_keys = row_keys + ([self.total_row] if self.total_row else [])
        return row_keys, col_keys, at

    def _label(self, axis: Axis, key) -> str:
        return key if key in (self.total_col, self.total_row) else axis.label(key)

    def _table(self, df, experiment, model, where, pv) -> Table:
        ref = df[df["method"] == self.reference] if self.reference else df.iloc[:0]
        grid = df[df["method"] != self.reference] if self.reference else df
        row_keys, col_keys, at = self._values(grid)
        paper = self.paper if self._paper_applies(df) else None
        rows = []
        widest, ns = 0.0, []  # the widest accuracy interval, and the n of those cells
        for rk in row_keys:
            label = self._label(self.rows, rk)
            groups = [self.metrics] if not self.metric_rows else [(mt,) for mt in self.metrics]
            for g, metrics in enumerate(groups):
                cells = [Cell((label if g == 0 else metrics[0].name,))]
                for ck in col_keys:
                    m = at.get((rk, ck))
                    ours = (MISSING,)  # a cell we have not run
                    interval, after = None, -1
                    if m is not None:
                        ours = tuple(mt.format(m[mt.column]) for mt in metrics)
                        for j, mt in enumerate(metrics):
                            if mt.interval:
                                after = j
                                interval, half = interval_text(m[mt.column], m["n"])
                                if half > NOISE_HALF_WIDTH:
                                    widest, ns = max(widest, half), ns + [int(m["n"])]
                    theirs = None
                    if paper is not None:
                        names = [(paper.row(label), paper.column(ck, mt.name)) for mt in metrics]
                        got = [pv.get(paper.table, r, c) for r, c in names]
                        theirs = tuple(v or MISSING for v in got) if any(got) else None
                    cells.append(Cell(ours, paper=theirs, interval=interval, interval_at=after))
                rows.append((rk, col_keys, metrics, cells))
        if self.bold:
            self._mark_best(rows)
        setting = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in where.items())
        t = Table(
            title=f"{self.title}: {model}" + (f", {setting}" if setting else ""),
            label="tab:ours_" + _slug(experiment, model, *where.values()),
            header=[self.rows.title] + [self._label(self.cols, c) for c in col_keys],
            rows=[cells for *_, cells in rows],
            sources=_sources(df),
        )
        t.lead = self._reference_lines(ref, paper, pv)
        t.notes = list(self.notes) + self._setting_notes(df, grid, paper, pv)
        t.notes += noise_footnote(widest, ns)
        return t

    def _mark_best(self, rows: list[tuple]) -> None:
        """Bold the best `bold` metric per row or per column (ties: all), skipping totals."""
        entries = []  # (row key, col key, cell, index of the metric in the cell)
        for rk, col_keys, metrics, cells in rows:
            names = [mt.name for mt in metrics]
            skip = rk in (self.total_row,) or rk in self.bold_skip or _reference_method(rk)
            if self.bold not in names or skip:
                continue
            i = names.index(self.bold)
            for ck, c in zip(col_keys, cells[1:]):
                has = len(c.ours) > i and c.ours[i] != MISSING
                if has and ck != self.total_col and ck not in self.bold_skip:
                    if _reference_method(ck):
                        continue
                    entries.append((rk, ck, c, i))
        by = 0 if self.bold_by == "row" else 1
        for key in {e[by] for e in entries}:
            group = [e for e in entries if e[by] == key]
            best = max(float(c.ours[i]) for *_, c, i in group)
            for *_, c, i in group:
                c.bold = tuple(j == i and float(c.ours[i]) == best for j in range(len(c.ours)))

    def _reference_lines(self, ref: pd.DataFrame, paper, pv: PaperValues) -> list[str]:
        lines = []
        for budget, sub in ref.groupby("budget", sort=True):
            m = cell_means(sub, ["method"]).iloc[0]
            cell = Cell(tuple(mt.format(m[mt.column]) for mt in self.metrics))
            score = [j for j, mt in enumerate(self.metrics) if mt.interval]
            if score:
                cell.interval_at = score[0]
                cell.interval = interval_text(m[self.metrics[score[0]].column], m["n"])[0]
            if paper is not None and paper.reference is not None:
                got = [pv.get(paper.table, *paper.reference(mt.name)) for mt in self.metrics]
                cell.paper = tuple(v or MISSING for v in got) if any(got) else None
            names = " / ".join(mt.name for mt in self.metrics)
            who = display(self.reference)
            lines.append(
                f"{who} (budget {budget}, n={int(m['n'])}): {names} = {cell.render(str, str)}."
            )
        return lines

    def _setting_notes(self, df, grid, paper, pv) -> list[str]:
        notes = []
        ns = cell_means(grid, [self.rows.field, self.cols.field])["n"] if len(grid) else []
        tasks = sorted(df["task"].unique())
        if len(ns):
            n_text = f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
            notes.append(f"Ours: {n_text} samples per cell; tasks: {', '.join(tasks)}.")
        if self.paper is None:
            return notes
        if paper is not None:
            notes.append(_paper_note(pv, self.paper.table))
        else:
            notes.append(_other_setting_note(df, self.paper.table, self.paper.setting))
        return notes


@dataclass(frozen=True)
class Column:
    """One column of a RowSpec table: a value computed from a row's records."""

    title: str
    value: Callable[[pd.DataFrame], object]  # a number, a tuple of numbers, a string or None
    fmt: str = ".2f"
    paper: tuple[str, ...] = ()  # the paper's column name of each part (none: ours only)
    template: str | None = None  # how a tuple's parts read, e.g. "[{}, {}]"
    best: bool = False  # bold the highest value among the rows that are not the reference

    def _format(self, x) -> str:
        if isinstance(x, str):
            return x
        return MISSING if x is None or pd.isna(x) else format(x, self.fmt)

    def cell(self, df: pd.DataFrame) -> Cell:
        v = self.value(df)
        parts = v if isinstance(v, tuple) else (v,)
        return Cell(tuple(self._format(x) for x in parts), template=self.template)


@dataclass(frozen=True)
class RowSpec:
    """One row per value of the `keys` fields, with computed columns, one table per `split`."""

    title: str
    keys: tuple[str, ...]  # record fields naming a row (after derive)
    key_titles: tuple[str, ...]
    columns: tuple[Column, ...]
    label: Callable[[tuple], tuple[str, ...]] = lambda key: tuple(map(str, key))
    order: Callable[[tuple], object] = lambda key: key
    paper: PaperLink | None = None
    paper_row: Callable[[tuple, str], str] | None = None  # (row key, model) -> the paper's row
    derive: Callable[[pd.DataFrame], pd.DataFrame] = lambda df: df
    reference: str | None = methods.DENSE  # method never bolded
    split: tuple[str, ...] = ("context_length",)
    notes: tuple[str, ...] = ()
    sample_note: bool = True

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        df = self.derive(df.assign(model=df["model"] if "model" in df else model))
        split = [k for k in self.split if k in df]
        parts = df.groupby(split, sort=True) if split else [((), df)]
        tables = []
        for values, sub in parts:
            values = values if isinstance(values, tuple) else (values,)
            tables.append(self._table(sub, experiment, model, dict(zip(split, values)), pv))
        return tables

    def _table(self, df, experiment, model, where, pv) -> Table:
        paper = self.paper if self.paper and _paper_applies(df, self.paper.setting) else None
        rows = []
        keys = sorted(
            {tuple(k) for k in df[list(self.keys)].itertuples(index=False)}, key=self.order
        )
        for key in keys:
            sub = df[(df[list(self.keys)] == pd.Series(key, index=list(self.keys))).all(axis=1)]
            cells = [Cell((text,)) for text in self.label(key)]
            for col in self.columns:
                c = col.cell(sub)
                if paper is not None and col.paper and self.paper_row is not None:
                    row = self.paper_row(key, model)
                    got = [pv.parts(paper.table, row, name) for name in col.paper]
                    c.paper = tuple(v or MISSING for v in got) if any(got) else None
                cells.append(c)
            rows.append((key, sub, cells))
        self._mark_best(rows)
        setting = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in where.items())
        notes = list(self.notes)
        if self.sample_note and "task" in df:
            ns = [len(sub) for _, sub, _ in rows]
            n_text = f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
            tasks = ", ".join(sorted(df["task"].unique()))
            notes.append(f"Ours: {n_text} samples per row; tasks: {tasks}.")
        if self.paper is not None:
            notes.append(
                _paper_note(pv, self.paper.table)
                if paper is not None
                else _other_setting_note(df, self.paper.table, self.paper.setting)
            )
        return Table(
            title=f"{self.title}: {model}" + (f", {setting}" if setting else ""),
            label="tab:ours_" + _slug(experiment, model, *where.values()),
            header=list(self.key_titles) + [c.title for c in self.columns],
            rows=[cells for *_, cells in rows],
            notes=notes,
            sources=_sources(df),
            keys=len(self.key_titles),
        )

    def _mark_best(self, rows) -> None:
        nkeys = len(self.key_titles)
        for j, col in enumerate(self.columns):
            if not col.best:
                continue
            cand = [
                cells[nkeys + j]
                for key, sub, cells in rows
                if not ("method" in sub and (sub["method"] == self.reference).all())
                and not ("method" in sub and sub["method"].map(_reference_method).all())
                and cells[nkeys + j].ours[0] != MISSING
            ]
            if not cand:
                continue
            best = max(float(c.ours[0]) for c in cand)
            for c in cand:
                c.bold = (float(c.ours[0]) == best,) + (False,) * (len(c.ours) - 1)


@dataclass(frozen=True)
class SummarySpec:
    """Any experiment without a spec: report.summarize's per method/budget table."""

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        _, overall = summarize(df)
        fmt = {"n": "d", "density": ".2f", "score": ".2f", "ttft_s": ".3f"}
        rows = []
        widest, ns = 0.0, []
        for _, r in overall.iterrows():
            vals = {c: r[c] * (100 if c == "density" else 1) for c in fmt}
            cells = {
                c: Cell((format(vals[c], f) if not pd.isna(vals[c]) else MISSING,))
                for c, f in fmt.items()
            }
            cells["score"].interval, half = interval_text(r["score"], r["n"])
            if half > NOISE_HALF_WIDTH:
                widest, ns = max(widest, half), ns + [int(r["n"])]
            rows.append([Cell((str(r[c]),)) for c in CELL] + list(cells.values()))
        return [
            Table(
                title=f"{experiment}: {model}",
                label="tab:ours_" + _slug(experiment, model),
                header=["Method", "Budget", "n", "Density (%)", "Score", "TTFT (s)"],
                rows=rows,
                notes=[
                    "Score: benchmark metric (0-100), mean over task x context-length groups. "
                    "Density: kept causal block pairs / all causal block pairs (percent), mean "
                    "over layers, heads and samples. No paper layout is defined for this "
                    "experiment (rbs_bench.tables.SPECS)."
                ]
                + noise_footnote(widest, ns),
                sources=_sources(df),
            )
        ]


# ------------------------------------------------------------------------------------------------
# The experiments' specs.


def _pct(t: float) -> str:
    return f"{round(100 * t, 6):g}%"


def _with_target(df: pd.DataFrame) -> pd.DataFrame:
    """Adds `target`: the budget's target density as the paper writes it ("5%"), or "default";
    a target shared by several budget names gets the name too."""
    tgt = df["budget_target"] if "budget_target" in df else pd.Series(None, index=df.index)
    by_name = {b: t for b, t in zip(df["budget"], tgt)}
    text = {b: (_pct(t) if t is not None and not pd.isna(t) else b) for b, t in by_name.items()}
    shared = {v for v in text.values() if list(text.values()).count(v) > 1}
    text = {b: f"{v} ({b})" if v in shared else v for b, v in text.items()}
    return df.assign(target=df["budget"].map(text))


def _target_order(label: str) -> tuple:
    m = re.match(r"([\d.]+)%", label)
    return (float(m.group(1)) if m else math.inf, label)


def context_label(n) -> str:
    """4096 -> "4K", 131072 -> "128K" (the paper's column names); other values as they are."""
    if isinstance(n, str):
        return n
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _field(name: str) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """derive: a method field of the records (method_fields[name]) as a column."""

    def derive(df: pd.DataFrame) -> pd.DataFrame:
        fields = df["method_fields"] if "method_fields" in df else pd.Series([{}] * len(df))
        get = lambda f: f.get(name) if isinstance(f, dict) else None
        return df.assign(**{name: fields.map(get).values})

    return derive


def _meta(key: str, df: pd.DataFrame) -> pd.Series:
    if key in df:
        return df[key]
    meta = df["meta"] if "meta" in df else pd.Series([{}] * len(df), index=df.index)
    return meta.map(lambda m: m.get(key) if isinstance(m, dict) else None)


def _category_score(key: str, value: str, scale: float = 1.0):
    def score(df: pd.DataFrame) -> float:
        sub = df[_meta(key, df) == value]
        return scale * sub["score"].mean() if len(sub) else math.nan

    return score


def _density(stat: str) -> Callable[[pd.DataFrame], float]:
    """Per-sample measured density (percent): mean, p50 or p90 over the row's samples."""
    how = {
        "mean": lambda s: s.mean(),
        "p50": lambda s: s.median(),
        "p90": lambda s: s.quantile(0.9),
    }
    return lambda df: 100 * how[stat](df["density"]) if len(df) else math.nan


def _tasks_score(prefix: str) -> Callable[[pd.DataFrame], float]:
    return lambda df: score_mean(df[df["task"].str.startswith(prefix)])


def _reference_method(key) -> bool:
    """A key naming a method that is a reference, not a contender (the oracle): never bold."""
    return isinstance(key, str) and methods.info(key).reference


def _method_label(table: str | None = None) -> Callable[[tuple], tuple[str, ...]]:
    """A row's label: the method's name in the paper table `table` (its display name by default),
    then the other keys."""
    return lambda key: (_row_name(key[0], table), *map(str, key[1:]))


def _row_name(method: str, table: str | None) -> str:
    info = methods.info(method)
    return info.paper_row(table) if table else info.display


def _method_key_order(key: tuple) -> tuple:
    return (method_order(key[0]), *key[1:])


DENSITY_NOTE = (
    "Density: kept causal block pairs / all causal block pairs (B=128 unless a block size is "
    "given), mean over layers and heads per sample; MInference's token-level pattern counts the "
    "block pairs it touches."
)
RULER_SETTING = {"model": "qwen3_30b_a3b_fp8", "context_length": 131072}

# Paper Table 2 (tab:ruler_budget): rows = target budget, columns = methods, density / accuracy.
RULER_BUDGET = GridSpec(
    title="RULER budget sweep (measured density / accuracy, %)",
    rows=Axis("target", title="Target", order=_target_order),
    cols=Axis("method", label=display, order=method_order),
    metrics=(Metric("density", "density", 100.0), Metric("accuracy", "score", interval=True)),
    split=("context_length",),
    bold="accuracy",
    paper=PaperLink(
        table="tab:ruler_budget",
        setting=RULER_SETTING,
        column=lambda m, metric: f"{display(m)}:{metric}",
        reference=lambda metric: ("Dense", f"Dense:{metric}"),
    ),
    derive=_with_target,
    notes=(
        "Density: kept causal block pairs / all causal block pairs (B=128), mean over layers, "
        "heads and samples; accuracy: mean over tasks. Bold: highest sparse accuracy in the row "
        "(ours). MInference's token-level pattern counts the block pairs it touches.",
    ),
    recall=True,
)

# Paper Table 8 (tab:strict_density): rows = methods, columns = density anchors.
STRICT_DENSITY = GridSpec(
    title="Strict density matching on RULER (measured density / accuracy, %)",
    rows=Axis("method", title="Method", label=display, order=method_order),
    cols=Axis("target", label=lambda t: f"{t} anchor", order=_target_order),
    metrics=(
        Metric("density", "density", 100.0, ".3f"),
        Metric("accuracy", "score", interval=True),
    ),
    split=("context_length",),
    reference=None,
    bold="accuracy",
    bold_by="column",
    paper=PaperLink(
        table="tab:strict_density",
        setting=RULER_SETTING,
        row=str,
        column=lambda t, metric: f"{t} anchor:{metric}",
    ),
    derive=_with_target,
    notes=(
        "Each anchor is a budget target every method is calibrated to (the paper's anchors are "
        "RBS's measured densities of the budget sweep). Bold: highest accuracy at each anchor. "
        + DENSITY_NOTE,
    ),
    recall=True,
)

# Paper Table 4 (tab:ruler): accuracy row and density row per method, columns = context lengths.
RULER_MAIN = GridSpec(
    title="RULER by context length at the default operating points (%)",
    rows=Axis("method", title="Method", label=display, order=method_order),
    cols=Axis("context_length", label=context_label, order=int),
    metrics=(
        Metric("accuracy", "score", interval=True),
        Metric("density", "density", 100.0, ".3f"),
    ),
    split=("budget",),
    reference=None,
    bold="accuracy",
    bold_by="column",
    bold_skip=(methods.DENSE,),
    metric_rows=True,
    total_col="Overall",
    paper=PaperLink(
        table="tab:ruler",
        setting={"model": "qwen3_32b", "budget": "default"},
        column=lambda n, metric: f"{context_label(n)}:{metric}",
    ),
    notes=(
        "Accuracy: mean over the tasks at each length; Overall: mean over the lengths. The "
        "density row under each method is its measured density (%). Bold: highest sparse "
        "accuracy per column. " + DENSITY_NOTE,
    ),
    recall=True,
)


def _infinitebench_names() -> dict[str, str]:
    from rbs_bench.benchmarks import infinitebench

    return {t: s.paper_name for t, s in infinitebench.TASKS.items()}


def _infinitebench_order(task: str) -> tuple:
    names = list(_infinitebench_names())
    return (names.index(task) if task in names else len(names), task)


# Paper Table 5 (tab:InfiniteBench): rows = tasks + macro average, columns = methods (unit scale).
INFINITEBENCH = GridSpec(
    title="InfiniteBench at the default operating points (scores on the unit interval)",
    rows=Axis(
        "task",
        title="Task",
        label=lambda t: _infinitebench_names().get(t, t),
        order=_infinitebench_order,
    ),
    cols=Axis("method", label=display, order=method_order),
    metrics=(Metric("score", "score", 0.01, ".3f"),),
    split=("context_length",),
    reference=None,
    bold="score",
    bold_by="row",
    bold_skip=(methods.DENSE,),
    total_row="Macro average",
    paper=PaperLink(
        table="tab:InfiniteBench",
        setting={"model": "qwen3_32b", "context_length": 131072},
        column=lambda m, metric: display(m),
    ),
    notes=(
        "Scores: each task's official metric on the unit interval; the last row is the macro "
        "average over the tasks. Bold: best sparse score per task.",
    ),
)

LONGBENCH_PANELS = {
    "qwen3_32b": "Qwen3-32B",
    "qwen3_30b_a3b_fp8": "Qwen3-30B-A3B-Instruct-2507-FP8",
}
_LB_CLASSES = ("short", "medium", "long")

# Paper Table 3 (tab:longbench_dual): accuracy by length class and total; density mean/p50/p90.
LONGBENCH_V2 = RowSpec(
    title="LongBench-v2 at the default operating points (accuracy on the unit interval)",
    keys=("method",),
    key_titles=("Method",),
    columns=tuple(
        Column(
            c.capitalize(),
            _category_score("length", c, 0.01),
            ".3f",
            (f"Accuracy:{c.capitalize()}",),
            best=True,
        )
        for c in _LB_CLASSES
    )
    + (
        Column(
            "Total", lambda df: 0.01 * df["score"].mean(), ".3f", ("Accuracy:Total",), best=True
        ),
        Column("Density mean (%)", _density("mean"), ".3f", ("Estimated density (%):Mean",)),
        Column("p50", _density("p50"), ".3f", ("Estimated density (%):p50",)),
        Column("p90", _density("p90"), ".3f", ("Estimated density (%):p90",)),
    ),
    label=_method_label(),
    order=_method_key_order,
    paper=PaperLink(
        "tab:longbench_dual", {"model": tuple(LONGBENCH_PANELS), "context_length": 131072}
    ),
    paper_row=lambda key, model: f"{LONGBENCH_PANELS.get(model, model)}:{display(key[0])}",
    notes=(
        "Accuracy by the question's length class and over all questions. Density: mean, p50 and "
        "p90 over the samples of the run itself (the paper estimates them on a separate "
        "selector-only sample of 20 questions per length class). Bold: best sparse accuracy per "
        "column. " + DENSITY_NOTE,
    ),
)

# Paper Table 6 (tab:videomme): accuracy by video duration and total (percent).
VIDEOMME = RowSpec(
    title="Video-MME at the default operating points (accuracy, %)",
    keys=("method",),
    key_titles=("Method",),
    columns=tuple(
        Column(c.capitalize(), _category_score("duration", c), ".1f", (c.capitalize(),), best=True)
        for c in _LB_CLASSES
    )
    + (
        Column("Total", lambda df: df["score"].mean(), ".2f", ("Total",), best=True),
        Column("Density (%)", _density("mean"), ".3f"),
    ),
    label=_method_label(),
    order=_method_key_order,
    paper=PaperLink("tab:videomme", {"model": "qwen3_vl_30b_a3b_thinking_fp8"}),
    paper_row=lambda key, model: display(key[0]),
    notes=(
        "Accuracy over all questions of each duration (an answer that cannot be extracted counts "
        "as wrong). Density (ours only): over text and video tokens. Bold: best sparse accuracy "
        "per column. " + DENSITY_NOTE,
    ),
)

ABLATION_TABLE = "tab:selector_ablation"


def _ablation_order(key: tuple) -> tuple:
    """The selectors the paper compares (a row name of their own there) first, then the rest;
    each group by method name."""
    return (ABLATION_TABLE not in methods.info(key[0]).paper_rows, key[0])


# Paper Table 7 (tab:selector_ablation): density, accuracy and its bootstrap CI per selector.
SELECTOR_ABLATION = RowSpec(
    title="Selector comparison at matched density (%)",
    keys=("method",),
    key_titles=("Selector",),
    columns=(
        Column("Actual density", _density("mean"), ".3f", ("Actual density",)),
        Column("Accuracy", score_mean, ".2f", ("Accuracy",), best=True),
        Column("95% CI", bootstrap_ci, ".2f", ("95% CI:low", "95% CI:high"), "[{}, {}]"),
    ),
    label=_method_label(ABLATION_TABLE),
    order=_ablation_order,
    paper=PaperLink(ABLATION_TABLE, RULER_SETTING),
    paper_row=lambda key, model: _row_name(key[0], ABLATION_TABLE),
    derive=_with_target,
    split=("context_length", "target"),
    notes=(
        "All selectors share the backend and block size and are calibrated to the same target. "
        "95% CI: sample bootstrap of the accuracy (2,000 resamples within each task, seed 0, "
        "percentile interval), not of differences between selectors. " + DENSITY_NOTE,
    ),
)

# Paper Table 12 (tab:selector_breakdown): accuracy on the retrieval and multi-key task groups.
SELECTOR_BREAKDOWN = RowSpec(
    title="Selector comparison by task group (accuracy, %)",
    keys=("method",),
    key_titles=("Selector",),
    columns=(
        Column(
            "Retrieval accuracy", _tasks_score("niah_"), ".2f", ("Retrieval accuracy",), best=True
        ),
        Column(
            "Multi-key accuracy",
            _tasks_score("niah_multikey"),
            ".2f",
            ("Multi-key accuracy",),
            best=True,
        ),
    ),
    label=_method_label("tab:selector_breakdown"),
    order=_ablation_order,
    paper=PaperLink("tab:selector_breakdown", RULER_SETTING),
    paper_row=lambda key, model: _row_name(key[0], "tab:selector_breakdown"),
    derive=_with_target,
    split=("context_length", "target"),
    notes=(
        "Retrieval: the niah_* tasks; multi-key: the niah_multikey_* tasks (– where the run has "
        "none). Accuracy: mean over the group's tasks.",
    ),
)

BLOCK_TABLE = "tab:block_sensitivity"


def _threshold(df: pd.DataFrame) -> float | None:
    """The calibrated threshold of the rows' method (its `info.threshold_field`, else its knob)."""
    name = df["method"].iloc[0]
    f = methods.info(name).threshold_field or methods.method_class(name).knob
    vals = df["method_fields"].map(lambda d: d.get(f) if isinstance(d, dict) else None)
    vals = vals.dropna().unique()
    return float(vals[0]) if len(vals) == 1 else None


# Paper Table 9 (tab:block_sensitivity): centroid and RBS per block size at one anchor.
BLOCK_SIZE = RowSpec(
    title="Block-size sensitivity on RULER at matched density",
    keys=("method", "block_size"),
    key_titles=("Selector", "Block size"),
    columns=(
        Column("Calibration parameter", _threshold, ".3f", ("Calibration parameter",)),
        Column("Actual density (%)", _density("mean"), ".3f", ("Actual density",)),
        Column("Accuracy (%)", score_mean, ".2f", ("Accuracy",)),
    ),
    label=_method_label(BLOCK_TABLE),
    order=_method_key_order,
    paper=PaperLink(BLOCK_TABLE, RULER_SETTING),
    paper_row=lambda key, model: f"{_row_name(key[0], BLOCK_TABLE)}:{key[1]}",
    derive=lambda df: _with_target(_field("block_size")(df)),
    split=("context_length", "target"),
    notes=(
        "Each block size is calibrated to the same target. Calibration parameter: the calibrated "
        "threshold (centroid: alpha; RBS: alpha_base = 0.22 s, alpha_rescue = 0.18 s). "
        + DENSITY_NOTE,
    ),
)

THRESHOLD_PANELS = {"qwen3_30b_a3b_fp8": "Qwen3-30B-A3B FP8", "qwen3_32b": "Qwen3-32B"}
THRESHOLD_ORDER = ("conservative", "default", "aggressive")

# Paper Table 10 (tab:threshold_sensitivity): three fixed threshold pairs per model.
THRESHOLDS = RowSpec(
    title="RBS threshold sensitivity on RULER (fixed thresholds)",
    keys=("budget",),
    key_titles=("Setting",),
    columns=(
        Column("alpha_base", lambda df: _one(df, "alpha_base"), ".2f", ("alpha_base",)),
        Column("alpha_rescue", lambda df: _one(df, "alpha_rescue"), ".2f", ("alpha_rescue",)),
        Column("Mean density (%)", _density("mean"), ".3f", ("Mean density",)),
        Column("p90 density (%)", _density("p90"), ".3f", ("p90 density",)),
        Column("Accuracy (%)", score_mean, ".2f", ("Accuracy",)),
    ),
    label=lambda key: (key[0].capitalize(),),
    order=lambda key: (
        THRESHOLD_ORDER.index(key[0]) if key[0] in THRESHOLD_ORDER else len(THRESHOLD_ORDER),
        key[0],
    ),
    paper=PaperLink(
        "tab:threshold_sensitivity",
        {"model": tuple(THRESHOLD_PANELS), "context_length": 131072},
    ),
    paper_row=lambda key, model: f"{THRESHOLD_PANELS.get(model, model)}:{key[0].capitalize()}",
    notes=(
        "The same threshold pairs on every model; no calibration. p90: over the samples. "
        + DENSITY_NOTE,
    ),
)


def _one(df: pd.DataFrame, name: str) -> float | None:
    vals = _field(name)(df)[name].dropna().unique()
    return float(vals[0]) if len(vals) == 1 else None


def load_calibrations(exp_dir: Path) -> pd.DataFrame:
    """One row per stored calibration entry of <exp_dir>/<method>.yaml (rbs_bench.calibrate)."""
    import yaml

    rows = []
    for path in sorted(Path(exp_dir).glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        for e in data.get("entries", []):
            rows.append({"method": data.get("method", path.stem), "source": str(path)} | e)
    return pd.DataFrame(rows)


def _targets(df: pd.DataFrame) -> str:
    return "/".join(f"{100 * t:g}" for t in sorted(df["target"].unique()))


def _gpu_hours(df: pd.DataFrame) -> float | None:
    gpus = df["gpus"] if "gpus" in df else pd.Series(0, index=df.index)
    if not (gpus > 0).any():
        return None  # a CPU calibration: no GPU time
    return float((df["seconds"] * gpus).sum() / 3600)


# Paper Table 11 (tab:calibration): the cost and accuracy of calibration per method.
CALIBRATION_COST = RowSpec(
    title="Offline calibration cost",
    keys=("method",),
    key_titles=("Method",),
    columns=(
        Column("Configurations", lambda df: float(len(df)), ".0f", ("Configurations",)),
        Column("Wall hours", lambda df: df["seconds"].sum() / 3600, ".3f", ("Wall hours",)),
        Column("GPU-hours", _gpu_hours, ".3f", ("GPU-hours",)),
        Column("Target density (%)", _targets, "", ("Target density",)),
        Column(
            "Max. error (pp)", lambda df: 100 * df["abs_error"].max(), ".4f", ("Max. error (pp)",)
        ),
        Column("Prompts", lambda df: float(df["prompts"].max()), ".0f"),
        Column("Forwards", lambda df: float(df["forwards"].sum()), ".0f"),
    ),
    label=_method_label(),
    order=_method_key_order,
    paper=PaperLink(
        "tab:calibration",
        {"model": "qwen3_30b_a3b_fp8", "context_length": 131072, "prompts": 50},
    ),
    paper_row=lambda key, model: display(key[0]),
    reference=None,
    sample_note=False,
    notes=(
        "Configurations: targets calibrated; wall and GPU time: the search itself (model "
        "forwards with the method running, scoring every layer once per forward), summed over "
        "the targets; GPU-hours: wall time x GPUs used (– on a CPU); Max. error: the largest "
        "|measured - target| over the targets, in percentage points; Prompts: calibration prompts "
        "per target; Forwards: model forwards in all. Calibration records: "
        "results/runs/calibration_cost/<model>/<method>.yaml.",
    ),
)


@dataclass(frozen=True)
class Tables:
    """Several specs whose tables share one file (e.g. a comparison and its breakdown)."""

    specs: tuple

    def build(self, df, experiment, model, pv) -> list[Table]:
        return [t for spec in self.specs for t in spec.build(df, experiment, model, pv)]


SPECS: dict = {
    "ruler_budget": RULER_BUDGET,
    "strict_density": STRICT_DENSITY,
    "ruler_main": RULER_MAIN,
    "longbench_v2": LONGBENCH_V2,
    "infinitebench": INFINITEBENCH,
    "videomme": VIDEOMME,
    "selector_ablation": Tables((SELECTOR_ABLATION, SELECTOR_BREAKDOWN)),
    "block_size": BLOCK_SIZE,
    "thresholds": THRESHOLDS,
}
# Experiments whose records are not per-sample run records: their own loader.
LOADERS: dict[str, tuple[Callable[[Path], pd.DataFrame], object]] = {
    "calibration_cost": (load_calibrations, CALIBRATION_COST),
}
SUMMARY = SummarySpec()


NEEDED = {"method", "budget", "task", "context_length", "score", "density", "ttft_s", "source"}


def _write(out: Path, experiment: str, model: str, tables: list[Table]) -> list[Path]:
    head = "Generated by `python -m rbs_bench.tables` from run records; do not edit."
    md = f"# {experiment} on {model}\n\n{head}\n\n" + "\n".join(map(to_markdown, tables))
    tex = f"% {head}\n\n" + "\n".join(map(to_latex, tables))
    base = Path(out) / f"{experiment}_{model}"
    write_atomic(base.with_suffix(".md"), md)
    write_atomic(base.with_suffix(".tex"), tex)
    return [base.with_suffix(".md"), base.with_suffix(".tex")]


def build_tables(results: Path, out: Path, paper_values: Path) -> list[Path]:
    """Write <out>/<experiment>_<model>.md and .tex for every results/runs/<experiment>/<model>."""
    pv = PaperValues.load(paper_values)
    written = []
    for exp_dir in sorted(p for p in (Path(results) / "runs").glob("*/*") if p.is_dir()):
        experiment, model = exp_dir.parent.name, exp_dir.name
        if experiment in LOADERS:
            load, spec = LOADERS[experiment]
            df = load(exp_dir)
            if df.empty:
                print(f"{exp_dir}: no table (no calibration records)", file=sys.stderr)
                continue
            written += _write(out, experiment, model, spec.build(df, experiment, model, pv))
            continue
        df = load_records(exp_dir)
        missing = sorted(NEEDED - set(df.columns))
        if missing:  # e.g. observations: its records sit beside, not under, <method>/<budget>
            what = f"lack {', '.join(missing)}" if len(df) else "none at <method>/<budget>/"
            print(f"{exp_dir}: no table (run records {what})", file=sys.stderr)
            continue
        tables = SPECS.get(experiment, SUMMARY).build(df, experiment, model, pv)
        written += _write(out, experiment, model, tables)
    return written


def build_timing_tables(results: Path, out: Path) -> list[Path]:
    """The timing experiments' tables and speed figure (rbs_bench.bench.timing_tables), where
    that module is installed; [] otherwise."""
    try:
        from rbs_bench.bench import timing_tables
    except ModuleNotFoundError as e:
        if e.name != "rbs_bench.bench.timing_tables":
            raise
        return []
    if not any((Path(results) / "speed").glob("ttft_*.csv")):
        return []
    if not (Path(results) / "paper" / "paper_values.csv").exists():
        print(
            f"no timing tables: they read {Path(results) / 'paper' / 'paper_values.csv'}, "
            "which is missing",
            file=sys.stderr,
        )
        return []
    return timing_tables.build(Path(results), Path(out))


def check_paper_values(tex: Path, csv_path: Path) -> list[str]:
    """Differences between the values file and a fresh parse of the paper's source ([] if none)."""
    with open(csv_path, newline="") as f:
        have = list(csv.DictReader(f))
    want = list(csv.DictReader(io.StringIO(paper_values_csv(paper_values_from_tex(tex)))))
    key = lambda r: (r["table"], r["row"], r["column"])
    h, w = {key(r): r for r in have}, {key(r): r for r in want}
    diffs = [f"only in {csv_path}: {k}" for k in h.keys() - w.keys()]
    diffs += [f"missing from {csv_path}: {k} = {w[k]['value']}" for k in w.keys() - h.keys()]
    diffs += [f"{k}: file {h[k]} != tex {w[k]}" for k in h.keys() & w.keys() if h[k] != w[k]]
    if len(have) != len(h):
        diffs.append(f"{csv_path} has duplicate (table, row, column) keys")
    return sorted(diffs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--out", type=Path, default=None, help="default: <results>/tables")
    ap.add_argument(
        "--paper-values", type=Path, default=None, help="default: <results>/paper/paper_values.csv"
    )
    ap.add_argument("--paper-tex", type=Path, help="check the values file against this source")
    ap.add_argument("--write-paper-values", action="store_true", help="with --paper-tex")
    args = ap.parse_args(argv)
    values = args.paper_values or args.results / "paper" / "paper_values.csv"
    try:
        if args.paper_tex:
            if args.write_paper_values:
                write_atomic(values, paper_values_csv(paper_values_from_tex(args.paper_tex)))
                print(f"wrote {values}")
                return 0
            diffs = check_paper_values(args.paper_tex, values)
            print("\n".join(diffs) or f"{values} agrees with {args.paper_tex}")
            return 1 if diffs else 0
        out = args.out or args.results / "tables"
        written = build_tables(args.results, out, values)
        written += build_timing_tables(args.results, out)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"no run records under {args.results / 'runs'}", file=sys.stderr)
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
