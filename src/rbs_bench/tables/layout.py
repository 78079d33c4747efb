"""How an experiment's records become a table: per-cell means, intervals and notes, and the
generic layouts (`GridSpec`: rows x columns of metric cells; `RowSpec`: one row per key with
columns; `SummarySpec`: any experiment without a spec of its own). The experiments' own specs are
in specs.py."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd

from rbs_bench import methods
from rbs_bench.report import NOISE_HALF_WIDTH, summarize, wilson
from rbs_bench.tables import paired
from rbs_bench.tables.paper import PaperValues
from rbs_bench.tables.render import MISSING, Cell, Table, display

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


DISCRIMINATES = 10.0  # points below dense at the lowest target that let a table rank methods


def _lowest_setting(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The records of the table's sparsest setting and its name: the lowest budget target, or,
    where the budgets set no target (fixed thresholds), the budget of the lowest mean density."""
    targets = df["budget_target"].dropna() if "budget_target" in df else pd.Series(dtype=float)
    if len(targets):
        low = float(targets.min())
        return df[df["budget_target"] == low], f"the lowest target, {100 * low:g}%"
    budget = df.groupby("budget")["density"].mean().idxmin()
    return df[df["budget"] == budget], f"the sparsest setting, {budget}"


def discrimination_note(
    df: pd.DataFrame, score: Callable[[pd.DataFrame], float], experiment: str = ""
) -> list[str]:
    """Whether the table can rank its methods: dense's accuracy, and the largest drop of any
    method below it at the table's sparsest setting (none without a dense cell); where it cannot,
    the experiment's config says what else was tried."""
    if "method" not in df:
        return []
    is_dense = df["method"] == methods.DENSE
    dense, rest = df[is_dense], df[~is_dense]
    if dense.empty or rest.empty:
        return []
    ref = score(dense)
    low, where = _lowest_setting(rest)
    cells = [(score(sub), key) for key, sub in low.groupby(["method", "budget"], sort=True)]
    worst, (method, _) = min(cells)
    drop = ref - worst
    tried = f" (conf/experiment/{experiment}.yaml says what was tried)" if experiment else ""
    verdict = (
        "so the table can rank methods"
        if drop >= DISCRIMINATES
        else f"less than {DISCRIMINATES:g}: no method falls clearly below dense here, so the "
        f"table cannot rank the methods at this setting{tried}"
    )
    tasks = sorted(dense["task"].unique()) if "task" in dense else []
    per_task = "".join(
        f"; {t} {score(dense[dense['task'] == t]):.2f}%" for t in (tasks if len(tasks) > 1 else [])
    )
    return [
        f"Discrimination: dense scores {ref:.2f}% (n={len(dense)}{per_task}); at {where}, the "
        f"largest drop below it is {display(method)}'s, {drop:.1f} points ({worst:.2f}%), "
        f"{verdict}."
    ]


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
    # a cell's and a total's score from the records behind it (the benchmark's own aggregate);
    # None: cell_means' score, and the totals' mean of the cells' scores
    score: Callable[[pd.DataFrame], float] | None = None
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
                title=(
                    self.title.replace("density / accuracy", "density / accuracy / recall")
                    if "density / accuracy" in self.title or self.metric_rows
                    else f"{self.title}, each cell's attention recall (%) after the slash"
                ),
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
        if self.score is not None:
            for (rk, ck), cell in at.items():
                here = (grid[self.rows.field] == rk) & (grid[self.cols.field] == ck)
                cell["score"] = self.score(grid[here])
        mean_of = lambda cells: {
            c: (
                pd.Series([x[c] for x in cells], dtype=float).sum()
                if c == "n"
                else pd.Series([x[c] for x in cells], dtype=float).mean()
            )
            for c in cols
        }

        def total(cells: list[dict], records: pd.DataFrame) -> dict:
            out = mean_of(cells)
            if self.score is not None:
                out["score"] = self.score(records)
            return out

        if self.total_col:
            for rk in row_keys:
                have = [at[rk, ck] for ck in col_keys if (rk, ck) in at]
                if have:
                    records = grid[grid[self.rows.field] == rk]
                    at[rk, self.total_col] = total(have, records)
        if self.total_row:
            for ck in col_keys:
                have = [at[rk, ck] for rk in row_keys if (rk, ck) in at]
                if have:
                    records = grid[grid[self.cols.field] == ck]
                    at[self.total_row, ck] = total(have, records)
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
        t.notes += noise_footnote(widest, ns) + self._paired(grid, rows)
        t.notes += discrimination_note(df, self.score or score_mean, experiment)
        return t

    def _paired(self, grid: pd.DataFrame, rows: list[tuple]) -> list[str]:
        """Dagger each accuracy cell whose paired difference from the headline method's cell
        of the same row or column is resolved (tables.paired); the note that says so."""
        if "method" not in (self.rows.field, self.cols.field):
            return []
        head = methods.headline()
        by_method = self.cols.field == "method"
        totals = (self.total_col, self.total_row)
        pairs, n_pairs = [], []
        for rk, col_keys, metrics, cells in rows:
            if not any(mt.interval for mt in metrics) or rk in totals:
                continue
            for ck, cell in zip(col_keys, cells[1:]):
                method = ck if by_method else rk
                if ck in totals or method == head:
                    continue
                at = lambda r, c: grid[(grid[self.rows.field] == r) & (grid[self.cols.field] == c)]
                mine, theirs = at(rk, ck), at(*((rk, head) if by_method else (head, ck)))
                if len(mine) and len(theirs):
                    result = paired.paired(mine, theirs)
                    if result.n:
                        pairs.append((cell, result))
                        n_pairs.append(result.n)
        if not pairs:
            return []
        resolved = paired.mark_resolved(pairs)
        return [paired.note(display(head), resolved, len(pairs), n_pairs)]

    def _mark_best(self, rows: list[tuple]) -> None:
        """Bold the best `bold` metric per row or per column (ties: all), skipping totals."""
        entries = []  # (row key, col key, cell, index of the metric in the cell)
        for rk, col_keys, metrics, cells in rows:
            names = [mt.name for mt in metrics]
            skip = rk in (self.total_row,) or rk in self.bold_skip or reference_method(rk)
            if self.bold not in names or skip:
                continue
            i = names.index(self.bold)
            for ck, c in zip(col_keys, cells[1:]):
                has = len(c.ours) > i and c.ours[i] != MISSING
                if has and ck != self.total_col and ck not in self.bold_skip:
                    if reference_method(ck):
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
            if self.score is not None:
                m["score"] = self.score(sub)
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
    paired: bool = False  # the accuracy over all the row's samples: daggered when resolved

    def _format(self, x) -> str:
        if isinstance(x, str):
            return x
        return MISSING if x is None or pd.isna(x) else format(x, self.fmt)

    def cell(self, df: pd.DataFrame) -> Cell:
        v = self.value(df)
        parts = v if isinstance(v, tuple) else (v,)
        return Cell(tuple(self._format(x) for x in parts), template=self.template)


def _mean_recall(df: pd.DataFrame) -> float:
    """Attention recall (percent) of a row: the mean over its samples (– where none recorded)."""
    have = df["recall"].dropna() if "recall" in df else df.iloc[:0]
    return 100 * float(have.mean()) if len(have) else math.nan


def _rows_with(df: pd.DataFrame, fields: tuple[str, ...], key: tuple) -> pd.Series:
    """The rows whose `fields` equal `key`, an empty value matching an empty one."""
    hit = pd.Series(True, index=df.index)
    for f, v in zip(fields, key):
        hit &= df[f].isna() if pd.isna(v) else df[f] == v
    return hit


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
    recall: bool = False  # add a recall column when the records hold one
    # the row a row's `paired` column is compared with (tables.paired); None: with keys that name
    # a method, the headline method's row of the same other keys; and the name it reads as
    versus: Callable[[tuple], tuple | None] | None = None
    versus_label: str | None = None

    def build(self, df: pd.DataFrame, experiment: str, model: str, pv: PaperValues) -> list[Table]:
        df = self.derive(df.assign(model=df["model"] if "model" in df else model))
        spec = self
        if self.recall and has_recall(df):
            column = Column("Recall (%)", _mean_recall, ".1f")
            spec = dataclasses.replace(
                self, columns=(*self.columns, column), notes=(*self.notes, RECALL_NOTE)
            )
        split = [k for k in spec.split if k in df]
        ref, rest = spec._reference(df)
        parts = rest.groupby(split, sort=True) if split else [((), rest)]
        tables = []
        for values, sub in parts:
            values = values if isinstance(values, tuple) else (values,)
            where = dict(zip(split, values))
            # the reference (dense) ran once, under no target: it joins every table of its length
            same = [k for k in where if k in ("context_length", "model")]
            mine = ref[(ref[same] == pd.Series(where)[same]).all(axis=1)] if same else ref
            tables.append(spec._table(pd.concat([sub, mine]), experiment, model, where, pv))
        return tables

    def _reference(self, df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(the reference method's records, the rest); none apart where the records hold only
        the reference, or where the reference does not stand apart by the split."""
        if self.reference is None or "method" not in df:
            return df.iloc[:0], df
        is_ref = df["method"] == self.reference
        if not is_ref.any() or is_ref.all():
            return df.iloc[:0], df
        return df[is_ref], df[~is_ref]

    def _table(self, df, experiment, model, where, pv) -> Table:
        paper = self.paper if self.paper and _paper_applies(df, self.paper.setting) else None
        rows = []
        # rows keyed by method show the reference as a row; others (threshold pairs) as a line
        ref, body = self._reference(df) if "method" not in self.keys else (df.iloc[:0], df)
        keys = sorted(
            {tuple(k) for k in body[list(self.keys)].itertuples(index=False)}, key=self.order
        )
        for key in keys:
            sub = body[_rows_with(body, self.keys, key)]
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
        notes = list(self.notes) + self._paired(rows)
        notes += discrimination_note(df, score_mean, experiment)
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
            lead=self._reference_line(ref),
        )

    def _reference_line(self, ref: pd.DataFrame) -> list[str]:
        """The reference method's accuracy with its interval, for tables whose rows are not
        methods (its records are not a row of theirs)."""
        if ref.empty:
            return []
        score = score_mean(ref)
        interval = interval_text(score, len(ref))[0]
        density = 100 * ref["density"].mean()
        return [
            f"{display(self.reference)} (n={len(ref)}): density {density:.2f}%, accuracy "
            f"{score:.2f}{' ' + interval if interval else ''}."
        ]

    def _versus(self, key: tuple) -> tuple | None:
        if self.versus is not None:
            return self.versus(key)
        if "method" not in self.keys:
            return None
        i = self.keys.index("method")
        head = methods.headline()
        return None if key[i] == head else key[:i] + (head,) + key[i + 1 :]

    def _paired(self, rows) -> list[str]:
        """Dagger the `paired` column of each row whose per-sample difference from its `versus`
        row is resolved (tables.paired); the note that says so."""
        cols = [j for j, col in enumerate(self.columns) if col.paired]
        if not cols:
            return []
        subs = {key: sub for key, sub, _ in rows}
        pairs, n_pairs = [], []
        for key, sub, cells in rows:
            other = self._versus(key)
            if other is None or other not in subs or "score" not in sub:
                continue
            result = paired.paired(sub, subs[other])
            if result.n:
                pairs.append((cells[len(self.key_titles) + cols[0]], result))
                n_pairs.append(result.n)
        if not pairs:
            return []
        against = self.versus_label or display(methods.headline())
        return [paired.note(against, paired.mark_resolved(pairs), len(pairs), n_pairs)]

    def _mark_best(self, rows) -> None:
        nkeys = len(self.key_titles)
        for j, col in enumerate(self.columns):
            if not col.best:
                continue
            cand = [
                cells[nkeys + j]
                for key, sub, cells in rows
                if not ("method" in sub and (sub["method"] == self.reference).all())
                and not ("method" in sub and sub["method"].map(reference_method).all())
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
            rows.append([Cell((display(r["method"]),)), Cell((str(r["budget"]),))])
            rows[-1] += list(cells.values())
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
                    "experiment (rbs_bench.tables.specs.SPECS)."
                ]
                + noise_footnote(widest, ns),
                sources=_sources(df),
            )
        ]


@dataclass(frozen=True)
class Tables:
    """Several specs whose tables share one file (e.g. a comparison and its breakdown)."""

    specs: tuple

    def build(self, df, experiment, model, pv) -> list[Table]:
        return [t for spec in self.specs for t in spec.build(df, experiment, model, pv)]


def reference_method(key) -> bool:
    """A key naming a method that is a reference, not a contender (the oracle): never bold."""
    return isinstance(key, str) and methods.info(key).reference
