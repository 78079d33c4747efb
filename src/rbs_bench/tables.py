"""The paper's tables rebuilt from run records (Markdown and LaTeX), with the paper's values beside.

    python -m rbs_bench.tables [--results results] [--out results/tables]

For every results/runs/<experiment>/<model> directory it writes <out>/<experiment>_<model>.md and
.tex, built from the records on disk only (never by rerunning a model). An experiment with a table
spec (SPECS) gets the paper's layout; any other gets a summary table (report.summarize). Where the
run's setting is the paper's (model, context length) a cell shows "ours (paper)", with the paper's
numbers read from results/paper/paper_values.csv. Every table lists the records files it used.

The paper values file is built from the paper's LaTeX source by `paper_values_from_tex` and checked
by hand; `--paper-tex PATH` re-parses the source and reports every cell that differs from the file
(`--write-paper-values` rewrites the file instead).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rbs_bench.config import UserError
from rbs_bench.records import write_atomic
from rbs_bench.report import CELL, load_records, summarize

PAPER_COLUMNS = ["table", "caption_short", "row", "column", "value", "unit", "tex_line", "bold"]

# Our method names, in table order, and the paper's names for them.
METHOD_ORDER = [
    "dense",
    "flashprefill",
    "xattn",
    "flexprefill",
    "minference",
    "quest",
    "centroid",
    "full_l2",
    "rbs",
]
DISPLAY = {
    "dense": "Dense",
    "flashprefill": "FlashPrefill",
    "xattn": "XAttn",
    "flexprefill": "FlexPrefill",
    "minference": "MInference",
    "quest": "Quest-style",
    "centroid": "Centroid-only",
    "full_l2": "Full-L2",
    "rbs": "RBS-Attention",
}
MISSING = "–"


def method_order(m: str) -> tuple:
    return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m)


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


# ------------------------------------------------------------------------------------------------
# Tables and their Markdown / LaTeX.


@dataclass
class Cell:
    ours: tuple[str, ...]  # formatted numbers (MISSING where we have none), or a label
    bold: tuple[bool, ...] = ()
    paper: tuple[str, ...] | None = None  # the paper's numbers as printed

    def render(self, bold: Callable[[str], str], esc: Callable[[str], str]) -> str:
        b = self.bold or (False,) * len(self.ours)
        text = " / ".join(bold(esc(v)) if f else esc(v) for v, f in zip(self.ours, b))
        return text + (f" ({' / '.join(self.paper)})" if self.paper else "")


@dataclass
class Table:
    title: str
    label: str  # LaTeX label
    header: list[str]
    rows: list[list[Cell]]
    lead: list[str] = field(default_factory=list)  # lines shown before the table (reference)
    notes: list[str] = field(default_factory=list)
    sources: list[tuple[str, int]] = field(default_factory=list)  # (records file, records used)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    bold = lambda s: f"**{s}**"
    out = [f"## {t.title}", ""]
    out += [line + "\n" for line in t.lead]
    out.append("| " + " | ".join(_md(h) for h in t.header) + " |")
    out.append("|" + "|".join(["---"] + ["---:"] * (len(t.header) - 1)) + "|")
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
    out = [
        "\\begin{table}[htbp]",
        "\\centering",
        f"\\caption{{{tex_escape(caption)}}}",
        f"\\label{{{t.label}}}",
        "\\small",
        "\\setlength{\\tabcolsep}{4pt}",
        f"\\begin{{tabular}}{{@{{}}l{'c' * (len(t.header) - 1)}@{{}}}}",
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
    by_group = (
        df.groupby(groups, sort=False)
        .agg(n=("score", "size"), score=("score", "mean"), density=("density", "mean"))
        .reset_index()
    )
    return (
        by_group.groupby(keys, sort=False)
        .agg(n=("n", "sum"), score=("score", "mean"), density=("density", "mean"))
        .reset_index()
    )


def _sources(df: pd.DataFrame) -> list[tuple[str, int]]:
    return sorted(df.groupby("source").size().items())


def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", "_".join(str(p) for p in parts)).strip("_")


@dataclass(frozen=True)
class Metric:
    name: str  # the paper's column suffix, e.g. "accuracy"
    column: str  # record column after cell_means: "score" or "density"
    scale: float = 1.0
    fmt: str = ".2f"

    def format(self, value: float) -> str:
        return MISSING if pd.isna(value) else format(self.scale * value, self.fmt)


@dataclass(frozen=True)
class Axis:
    field: str  # record column the axis groups on (after the spec's derive)
    title: str = ""
    label: Callable[[object], str] = str
    order: Callable[[object], object] = lambda v: v


@dataclass(frozen=True)
class PaperLink:
    """Where the paper reports the same cells, and the setting it reports them for."""

    table: str  # its label in paper_values.csv
    setting: dict  # record field -> value, e.g. {"model": ..., "context_length": 131072}
    row: Callable[[str], str] = str  # our row label -> the paper's row name
    column: Callable[[object, str], str] = lambda col, metric: f"{col}:{metric}"
    reference: Callable[[str], tuple[str, str]] | None = None  # metric -> (row, column)


@dataclass(frozen=True)
class GridSpec:
    """Rows x columns of "metric / metric" cells, one table per value of the `split` fields.

    A reference method (dense) is left out of the grid and shown as one line; bold marks the best
    `bold` metric in each row among the grid's cells."""

    title: str
    rows: Axis
    cols: Axis
    metrics: tuple[Metric, ...]
    split: tuple[str, ...] = ()
    reference: str | None = "dense"
    bold: str | None = None
    paper: PaperLink | None = None
    derive: Callable[[pd.DataFrame], pd.DataFrame] = lambda df: df
    notes: tuple[str, ...] = ()

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        df = self.derive(df.assign(model=df["model"] if "model" in df else model))
        if not self.split:
            return [self._table(df, experiment, model, {}, pv)]
        tables = []
        for values, sub in df.groupby(list(self.split), sort=True):
            where = dict(zip(self.split, values))
            tables.append(self._table(sub, experiment, model, where, pv))
        return tables

    def _paper_applies(self, df: pd.DataFrame) -> bool:
        if self.paper is None:
            return False
        return all(k in df and (df[k] == v).all() for k, v in self.paper.setting.items())

    def _table(self, df, experiment, model, where, pv) -> Table:
        ref = df[df["method"] == self.reference] if self.reference else df.iloc[:0]
        grid = df[df["method"] != self.reference] if self.reference else df
        means = cell_means(grid, [self.rows.field, self.cols.field])
        row_keys = sorted(means[self.rows.field].unique(), key=self.rows.order)
        col_keys = sorted(means[self.cols.field].unique(), key=self.cols.order)
        at = {(r[self.rows.field], r[self.cols.field]): r for _, r in means.iterrows()}
        paper = self.paper if self._paper_applies(df) else None
        rows = []
        for rk in row_keys:
            label = self.rows.label(rk)
            cells = [Cell((label,))]
            for ck in col_keys:
                m = at.get((rk, ck))
                ours = (MISSING,)  # a cell we have not run
                if m is not None:
                    ours = tuple(mt.format(m[mt.column]) for mt in self.metrics)
                theirs = None
                if paper is not None:
                    names = [(paper.row(label), paper.column(ck, mt.name)) for mt in self.metrics]
                    got = [pv.get(paper.table, r, c) for r, c in names]
                    theirs = tuple(v or MISSING for v in got) if any(got) else None
                cells.append(Cell(ours, paper=theirs))
            rows.append(cells)
        if self.bold:
            self._mark_best(rows)
        setting = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in where.items())
        t = Table(
            title=f"{self.title}: {model}" + (f", {setting}" if setting else ""),
            label="tab:ours_" + _slug(experiment, model, *where.values()),
            header=[self.rows.title] + [self.cols.label(c) for c in col_keys],
            rows=rows,
            sources=_sources(df),
        )
        t.lead = self._reference_lines(ref, paper, pv)
        t.notes = list(self.notes) + self._setting_notes(df, grid, paper, pv)
        return t

    def _mark_best(self, rows: list[list[Cell]]) -> None:
        i = [m.name for m in self.metrics].index(self.bold)
        has = lambda c: len(c.ours) > i and c.ours[i] != MISSING
        for cells in rows:
            best = max((float(c.ours[i]) for c in cells[1:] if has(c)), default=None)
            for c in cells[1:]:
                if has(c):
                    c.bold = tuple(j == i and float(c.ours[i]) == best for j in range(len(c.ours)))

    def _reference_lines(self, ref: pd.DataFrame, paper, pv: PaperValues) -> list[str]:
        lines = []
        for budget, sub in ref.groupby("budget", sort=True):
            m = cell_means(sub, ["method"]).iloc[0]
            cell = Cell(tuple(mt.format(m[mt.column]) for mt in self.metrics))
            if paper is not None and paper.reference is not None:
                got = [pv.get(paper.table, *paper.reference(mt.name)) for mt in self.metrics]
                cell.paper = tuple(v or MISSING for v in got) if any(got) else None
            names = " / ".join(mt.name for mt in self.metrics)
            who = DISPLAY.get(self.reference, self.reference)
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
            lo, hi = pv.lines(self.paper.table)
            notes.append(
                "Each cell: ours (the paper's value in parentheses where it reports the same "
                f"cell; {pv.path}, table {self.paper.table}, rbs_attention.tex lines {lo}-{hi})."
            )
        else:
            want = ", ".join(f"{k} {v}" for k, v in self.paper.setting.items())
            have = ", ".join(
                f"{k} {'/'.join(str(x) for x in sorted(df[k].unique()))}"
                for k in self.paper.setting
                if k in df
            )
            notes.append(
                f"The paper's cells ({self.paper.table}) are for another setting ({want}); "
                f"this table is {have}, so only ours are shown."
            )
        return notes


@dataclass(frozen=True)
class SummarySpec:
    """Any experiment without a spec: report.summarize's per method/budget table."""

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        _, overall = summarize(df)
        fmt = {"n": "d", "density": ".2f", "score": ".2f", "ttft_s": ".3f"}
        rows = []
        for _, r in overall.iterrows():
            vals = {c: r[c] * (100 if c == "density" else 1) for c in fmt}
            rows.append(
                [Cell((str(r[c]),)) for c in CELL]
                + [
                    Cell((format(vals[c], f) if not pd.isna(vals[c]) else MISSING,))
                    for c, f in fmt.items()
                ]
            )
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
                ],
                sources=_sources(df),
            )
        ]


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


# Paper Table 2 (tab:ruler_budget): rows = target budget, columns = methods, density / accuracy.
RULER_BUDGET = GridSpec(
    title="RULER budget sweep (measured density / accuracy, %)",
    rows=Axis("target", title="Target", order=_target_order),
    cols=Axis("method", label=lambda m: DISPLAY.get(m, m), order=method_order),
    metrics=(Metric("density", "density", 100.0), Metric("accuracy", "score")),
    split=("context_length",),
    bold="accuracy",
    paper=PaperLink(
        table="tab:ruler_budget",
        setting={"model": "qwen3_30b_a3b_fp8", "context_length": 131072},
        column=lambda m, metric: f"{DISPLAY.get(m, m)}:{metric}",
        reference=lambda metric: ("Dense", f"Dense:{metric}"),
    ),
    derive=_with_target,
    notes=(
        "Density: kept causal block pairs / all causal block pairs (B=128), mean over layers, "
        "heads and samples; accuracy: mean over tasks. Bold: highest sparse accuracy in the row "
        "(ours). MInference's token-level pattern counts the block pairs it touches.",
    ),
)

SPECS: dict[str, GridSpec | SummarySpec] = {"ruler_budget": RULER_BUDGET}
SUMMARY = SummarySpec()


NEEDED = {"method", "budget", "task", "context_length", "score", "density", "ttft_s", "source"}


def build_tables(results: Path, out: Path, paper_values: Path) -> list[Path]:
    """Write <out>/<experiment>_<model>.md and .tex for every results/runs/<experiment>/<model>."""
    pv = PaperValues.load(paper_values)
    written = []
    for exp_dir in sorted(p for p in (Path(results) / "runs").glob("*/*") if p.is_dir()):
        experiment, model = exp_dir.parent.name, exp_dir.name
        df = load_records(exp_dir)
        missing = sorted(NEEDED - set(df.columns))
        if missing:  # e.g. observations: its records sit beside, not under, <method>/<budget>
            what = f"lack {', '.join(missing)}" if len(df) else "none at <method>/<budget>/"
            print(f"{exp_dir}: no table (run records {what})", file=sys.stderr)
            continue
        tables = SPECS.get(experiment, SUMMARY).build(df, experiment, model, pv)
        head = "Generated by `python -m rbs_bench.tables` from run records; do not edit."
        md = f"# {experiment} on {model}\n\n{head}\n\n" + "\n".join(map(to_markdown, tables))
        tex = f"% {head}\n\n" + "\n".join(map(to_latex, tables))
        base = Path(out) / f"{experiment}_{model}"
        write_atomic(base.with_suffix(".md"), md)
        write_atomic(base.with_suffix(".tex"), tex)
        written += [base.with_suffix(".md"), base.with_suffix(".tex")]
    return written


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
    ap.add_argument("--paper-values", type=Path, default=None, help="<results>/paper/...csv")
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
        written = build_tables(args.results, args.out or args.results / "tables", values)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"no run records under {args.results / 'runs'}", file=sys.stderr)
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
