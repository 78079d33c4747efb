"""The table spec of each experiment with a paper table (`SPECS`), the calibration-cost table
read from calibration records (`LOADERS`), and the summary table of every other experiment."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from rbs_bench import benchmarks, methods, paths
from rbs_bench.errors import UserError
from rbs_bench.tables.layout import (
    Axis,
    Column,
    GridSpec,
    Metric,
    PaperLink,
    RowSpec,
    SummarySpec,
    Tables,
    bootstrap_ci,
)
from rbs_bench.tables.render import context_label, display, method_order

# ------------------------------------------------------------------------------------------------
# The experiments' specs.


def _pct(t: float) -> str:
    return f"{round(100 * t, 6):g}%"


def _with_target(df: pd.DataFrame, distinct: bool = True) -> pd.DataFrame:
    """Adds `target`: the budget's target density as the paper writes it ("5%"), or "default";
    a target shared by several budget names gets the name too (unless not `distinct`: where
    another key, the block size, tells those budgets apart)."""
    tgt = df["budget_target"] if "budget_target" in df else pd.Series(None, index=df.index)
    by_name = {b: t for b, t in zip(df["budget"], tgt)}
    text = {b: (_pct(t) if t is not None and not pd.isna(t) else b) for b, t in by_name.items()}
    values = list(text.values())
    shared = {v for v in values if values.count(v) > 1} if distinct else set()
    text = {b: f"{v} ({b})" if v in shared else v for b, v in text.items()}
    return df.assign(target=df["budget"].map(text))


def _target_order(label: str) -> tuple:
    m = re.match(r"([\d.]+)%", label)
    return (float(m.group(1)) if m else math.inf, label)


def _field(name: str) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """derive: a method field of the records (method_fields[name]) as a column."""

    def derive(df: pd.DataFrame) -> pd.DataFrame:
        fields = df["method_fields"] if "method_fields" in df else pd.Series([{}] * len(df))
        get = lambda f: f.get(name) if isinstance(f, dict) else None
        return df.assign(**{name: fields.map(get).values})

    return derive


POOLED = ("method", "budget", "context_length")  # one table row pools these of its records


def _aggregate(benchmark: str, column: str, scale: float = 1.0) -> Callable[[pd.DataFrame], float]:
    """A row's value from the benchmark's own `aggregate` (its scorer's grouping and averages)
    over the row's records, pooled into one cell. Records that the benchmark keeps apart even so
    (LongBench-v2's 0-shot and chain-of-thought tasks) are refused, not averaged."""

    def value(df: pd.DataFrame) -> float:
        if df.empty:
            return math.nan
        out = benchmarks.get(benchmark).aggregate(df.drop(columns=[c for c in POOLED if c in df]))
        if len(out) > 1:
            tasks = ", ".join(sorted(map(str, df["task"].unique())))
            raise UserError(
                f"one row of the {benchmark} table holds records that its aggregate keeps apart "
                f"(tasks {tasks}); run each task into its own results_dir"
            )
        return scale * float(out[column].iloc[0])

    return value


def _density(stat: str) -> Callable[[pd.DataFrame], float]:
    """Per-sample measured density (percent): mean, p50 or p90 over the row's samples."""
    how = {
        "mean": lambda s: s.mean(),
        "p50": lambda s: s.median(),
        "p90": lambda s: s.quantile(0.9),
    }
    return lambda df: 100 * how[stat](df["density"]) if len(df) else math.nan


def ruler_score(df: pd.DataFrame) -> float:
    """RULER's overall score of some records (benchmarks.ruler.aggregate: the mean over the
    tasks at each context length, then over the lengths)."""
    if df.empty:
        return math.nan
    return float(benchmarks.get("ruler").aggregate(df).loc["avg", "avg"])


def _tasks_score(prefix: str) -> Callable[[pd.DataFrame], float]:
    return lambda df: ruler_score(df[df["task"].str.startswith(prefix)])


def _method_label(table: str | None = None) -> Callable[[tuple], tuple[str, ...]]:
    """A row's label: the method's name in the paper table `table` (its display name by default),
    then the other keys."""
    return lambda key: (_row_name(key[0], table), *map(_key_text, key[1:]))


def _key_text(value) -> str:
    """A row key as text; "–" where the row has none (the reference's block size)."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


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
    score=ruler_score,
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
    score=ruler_score,
    metrics=(
        Metric("density", "density", 100.0, ".3f"),
        Metric("accuracy", "score", interval=True),
    ),
    split=("context_length",),
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
    score=ruler_score,
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
    score=_aggregate("infinitebench", "average"),
    paper=PaperLink(
        table="tab:InfiniteBench",
        setting={"model": "qwen3_32b", "context_length": 131072},
        column=lambda m, metric: display(m),
    ),
    notes=(
        "Scores: each task's official metric on the unit interval; the last row is the macro "
        "average over the tasks. Bold: best sparse score per task.",
    ),
    recall=True,
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
            _aggregate("longbench_v2", c, 0.01),
            ".3f",
            (f"Accuracy:{c.capitalize()}",),
            best=True,
        )
        for c in _LB_CLASSES
    )
    + (
        Column(
            "Total",
            _aggregate("longbench_v2", "overall", 0.01),
            ".3f",
            ("Accuracy:Total",),
            best=True,
            paired=True,
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
    recall=True,
)

# Paper Table 6 (tab:videomme): accuracy by video duration and total (percent).
VIDEOMME = RowSpec(
    title="Video-MME at the default operating points (accuracy, %)",
    keys=("method",),
    key_titles=("Method",),
    columns=tuple(
        Column(c.capitalize(), _aggregate("videomme", c), ".1f", (c.capitalize(),), best=True)
        for c in _LB_CLASSES
    )
    + (
        Column(
            "Total", _aggregate("videomme", "overall"), ".2f", ("Total",), best=True, paired=True
        ),
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
    recall=True,
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
        Column("Accuracy", ruler_score, ".2f", ("Accuracy",), best=True, paired=True),
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
    recall=True,
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
        Column("Accuracy (%)", ruler_score, ".2f", ("Accuracy",), paired=True),
    ),
    label=_method_label(BLOCK_TABLE),
    order=_method_key_order,
    paper=PaperLink(BLOCK_TABLE, RULER_SETTING),
    paper_row=lambda key, model: f"{_row_name(key[0], BLOCK_TABLE)}:{key[1]}",
    derive=lambda df: _with_target(_reference_blank("block_size", _field("block_size")(df)), False),
    split=("context_length", "target"),
    notes=(
        "Each block size is calibrated to the same target. Calibration parameter: the calibrated "
        "threshold (centroid: alpha; RBS: alpha_base = 0.22 s, alpha_rescue = 0.18 s). "
        + DENSITY_NOTE,
    ),
)


def _reference_blank(column: str, df: pd.DataFrame) -> pd.DataFrame:
    """`column` emptied on the reference (dense) rows: a key of the sparse rows only."""
    return df.assign(
        **{column: df[column].astype(object).where(df["method"] != methods.DENSE, None)}
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
        Column("Accuracy (%)", ruler_score, ".2f", ("Accuracy",), paired=True),
    ),
    label=lambda key: (key[0].capitalize(),),
    versus=lambda key: None if key[0] == "default" else ("default",),
    versus_label="the default pair",
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
        data = yaml.safe_load(paths.read_text(path)) or {}  # a regular file, never a FIFO
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


def spec_for(experiment: str):
    """The table spec of an experiment: its own, else that of the experiment it is a setting of
    (`ruler_budget_16k` is ruler_budget at 16K: the longest spec name followed by `_`), else the
    summary table."""
    if experiment in SPECS:
        return SPECS[experiment]
    bases = [name for name in SPECS if experiment.startswith(f"{name}_")]
    return SPECS[max(bases, key=len)] if bases else SUMMARY
