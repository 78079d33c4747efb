"""Summaries of an experiment's run records: a CSV, a Markdown table and a score-vs-density plot.

Built from the records on disk only (never by rerunning a model), so any process, including one
SLURM array task, can rebuild them:  python -m rbs_bench.report results/runs/<experiment>/<model>
(or every experiment under a results dir: python -m rbs_bench.report --results DIR).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import pandas as pd

from rbs_bench import methods, paths
from rbs_bench.errors import deferred, one_line, stop_on_signals
from rbs_bench.records import read_cell, write_atomic

CELL = ["method", "budget"]
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
NOISE_HALF_WIDTH = 15.0  # points: an interval wider than +-this cannot separate nearby cells


def wilson(score: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The 95% Wilson score interval, in points, of a mean score on 0-100 over n samples.

    The mean is taken as a proportion p = score / 100 of n trials. For 0/100 scores (RULER,
    multiple choice) this is the Wilson interval of the accuracy. For fractional per-sample scores
    (F1, ROUGE) it is conservative: a score in [0, 1] with mean p has variance at most p (1 - p),
    the binomial variance the interval assumes. Unlike the normal interval it stays inside
    [0, 100] and does not collapse to a point at 0 or 100 (n = 6 at 100 gives [61.0, 100.0]).
    """
    if not n or n <= 0 or score is None or math.isnan(score):
        return math.nan, math.nan
    p = min(max(score / 100.0, 0.0), 1.0)
    zz = z * z / n
    centre = (p + zz / 2) / (1 + zz)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    return 100 * max(centre - half, 0.0), 100 * min(centre + half, 1.0)


def with_interval(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with ci95_low / ci95_high: the Wilson interval of its score over its n."""
    bounds = [wilson(s, int(n)) for s, n in zip(table["score"], table["n"])]
    return table.assign(ci95_low=[lo for lo, _ in bounds], ci95_high=[hi for _, hi in bounds])


def noise_note(table: pd.DataFrame) -> str:
    """A footnote when some interval is wider than +-NOISE_HALF_WIDTH points, else ""."""
    half = (table["ci95_high"] - table["ci95_low"]) / 2
    if not (half > NOISE_HALF_WIDTH).any():
        return ""
    ns = sorted(set(int(n) for n in table.loc[half > NOISE_HALF_WIDTH, "n"]))
    return (
        f"Within noise: with n={', '.join(map(str, ns))} samples per cell the 95% intervals are "
        f"up to +-{half.max():.0f} points wide (more than {NOISE_HALF_WIDTH:.0f}), so score "
        "differences between cells whose intervals overlap are not evidence of a difference; "
        "raise benchmark.num_samples to separate them.\n"
    )


def load_records(exp_dir: Path) -> pd.DataFrame:
    """Every record of an experiment folder's cells, with its `source` file: the one read of run
    records for the summaries, tables and figures (records.read_cell: each record checked and
    bound to its cell, a repeated line counted once). A cell whose file holds no record is named
    in one warning line and in `attrs["empty_cells"]` of the frame."""
    rows, empty = [], []
    for path in paths.cell_records(exp_dir):
        recs = read_cell(path)
        if not recs:
            empty.append(str(path))
            print(
                f"rbs-bench: warning: {path} holds no records: an empty cell, left out of the "
                "summaries and tables; rerun its command to fill it, or delete the file",
                file=sys.stderr,
            )
        rows += [dict(rec) | {"source": str(path)} for rec in recs]
    df = pd.DataFrame(rows)
    df.attrs["empty_cells"] = empty
    return df


def summarize(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per method/budget/task/length, per method/budget) tables with score and density."""
    keys = CELL + ["task", "context_length"]
    by_task = (
        df.groupby(keys, sort=False)
        .agg(
            n=("score", "size"),
            score=("score", "mean"),
            density=("density", "mean"),
            density_p50=("density", "median"),
            density_p90=("density", lambda s: s.quantile(0.9)),
            ttft_s=("ttft_s", "mean"),
        )
        .reset_index()
    )
    # A cell's score is the mean over its task x length groups, as RULER averages its tasks.
    overall = (
        by_task.groupby(CELL, sort=False)
        .agg(
            n=("n", "sum"),
            score=("score", "mean"),
            density=("density", "mean"),
            ttft_s=("ttft_s", "mean"),
        )
        .reset_index()
    )
    by_task, overall = in_method_order(by_task), in_method_order(overall)
    return with_interval(by_task), with_interval(overall)


def in_method_order(table: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by each method's `MethodInfo.order` (dense first), then by the other columns'
    first-seen order; a `display` column after `method` holds the methods' display names."""
    rank = {m: i for i, m in enumerate(methods.in_order(table["method"].unique()))}
    table = table.assign(_rank=table["method"].map(rank)).sort_values("_rank", kind="stable")
    table = table.drop(columns="_rank").reset_index(drop=True)
    if "display" not in table:
        table.insert(list(table.columns).index("method") + 1, "display",
                     table["method"].map(methods.display))  # fmt: skip
    return table


def by_category(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Score and density per method/budget for each category key found in the records' meta
    (e.g. LongBench-v2's difficulty and length class); {} when the records carry none."""
    if "meta" not in df or not df["meta"].map(lambda m: isinstance(m, dict) and bool(m)).any():
        return {}
    meta = pd.json_normalize(df["meta"].map(lambda m: m if isinstance(m, dict) else {}).tolist())
    tables = {}
    for key in meta.columns:
        sub = df[CELL + ["score", "density"]].assign(**{key: meta[key].values}).dropna()
        if sub[key].nunique() > 1:
            tables[key] = (
                sub.groupby(CELL + [key], sort=False)
                .agg(n=("score", "size"), score=("score", "mean"), density=("density", "mean"))
                .reset_index()
                .pipe(in_method_order)
                .pipe(with_interval)
            )
    return tables


def markdown_table(df: pd.DataFrame, floats: dict[str, str]) -> str:
    """A Markdown table; ci95_low / ci95_high, when present, read as one "95% CI" column, and a
    `display` column, when present, stands in the `method` column (the display name)."""
    if "display" in df:
        df = df.assign(method=df["display"]).drop(columns="display")
    if "ci95_low" in df:
        ci = [
            f"[{lo:.1f}, {hi:.1f}]" if not math.isnan(lo) else "-"
            for lo, hi in zip(df["ci95_low"], df["ci95_high"])
        ]
        at = list(df.columns).index("score") + 1 if "score" in df else len(df.columns)
        df = df.drop(columns=["ci95_low", "ci95_high"])
        df.insert(min(at, len(df.columns)), "95% CI", ci)
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        cells = [format(row[c], floats[c]) if c in floats else str(row[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_score_vs_density(overall: pd.DataFrame, by_task: pd.DataFrame, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    # each method's MethodInfo: display name, colour, marker; the headline method on top
    for method, grp in by_task.groupby("method", sort=False):
        style = methods.line_style(method)
        ax.scatter(100 * grp["density"], grp["score"], alpha=0.35, s=18, color=style["color"])
        ov = overall[overall["method"] == method]
        ax.plot(100 * ov["density"], ov["score"], **style)
    ax.set_xlabel("measured density (% of causal block pairs)")
    ax.set_ylabel("score")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, 105)
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="method (small dots: task x length)", title_fontsize=7)
    fig.tight_layout()
    # per-writer temp name: array tasks finishing together each rebuild this plot
    paths.check_inside(path)
    tmp = paths.check_inside(
        path.with_name(f".{path.name}.{os.uname().nodename}.{os.getpid()}.tmp.png")
    )
    with deferred():  # a stop waits for the plot's replacement
        fig.savefig(tmp)
        plt.close(fig)
        tmp.replace(path)


def write_summary(exp_dir: Path) -> pd.DataFrame | None:
    """Rebuild summary.csv, summary.md and score_vs_density.png of an experiment/model dir."""
    exp_dir = Path(exp_dir)
    df = load_records(exp_dir)
    if df.empty:
        return None
    empty = "".join(f"- `{s}` (empty: no records yet)\n" for s in df.attrs.get("empty_cells", []))
    by_task, overall = summarize(df)
    write_atomic(exp_dir / "summary.csv", overall.to_csv(index=False))
    write_atomic(exp_dir / "summary_by_task.csv", by_task.to_csv(index=False))
    fmt = {
        "score": ".2f",
        "density": ".4f",
        "density_p50": ".4f",
        "density_p90": ".4f",
        "ttft_s": ".3f",
    }
    sources = "".join(f"- `{s}`\n" for s in sorted(df["source"].unique()))
    categories = ""
    for key, table in by_category(df).items():
        write_atomic(exp_dir / f"summary_by_{key}.csv", table.to_csv(index=False))
        categories += f"\n## By {key}\n\n{markdown_table(table, fmt)}"
    md = (
        f"# {exp_dir.parent.name} on {exp_dir.name}\n\n"
        "Score: benchmark metric (0-100), mean over task x context-length groups. 95% CI: the "
        "Wilson score interval of the score as a proportion of n samples (report.wilson; "
        "conservative for fractional scores). Density: kept causal block pairs / all causal "
        "block pairs, mean over layers, heads and samples.\n\n"
        f"{markdown_table(overall, fmt)}\n{noise_note(overall)}"
        "\n## By task and context length\n\n"
        f"{markdown_table(by_task, fmt)}{categories}\nRun records:\n\n{sources}{empty}"
    )
    write_atomic(exp_dir / paths.SUMMARY, md)
    plot_score_vs_density(
        overall,
        by_task,
        exp_dir / "score_vs_density.png",
        f"{exp_dir.parent.name} / {exp_dir.name}",
    )
    return overall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "exp_dirs",
        nargs="*",
        type=Path,
        help="<results>/runs/<experiment>/<model> (default: every one under --results)",
    )
    ap.add_argument(
        "--results", type=Path, default=Path("results"), help="results dir (default: results)"
    )
    args = ap.parse_args(argv)
    stop_on_signals()
    return one_line(lambda: _summaries(args.exp_dirs, args.results))


def _summaries(given: list[Path], results: Path) -> int:
    if given:
        hint = "give the folder of one experiment on one model, <results>/runs/<experiment>/<model>"
        dirs = [paths.results_folder(d, hint) for d in given]
    else:
        dirs = paths.experiment_dirs(paths.results_folder(results))
    if not dirs:
        print(f"no run records under {paths.runs_dir(results)}", file=sys.stderr)
    for d in dirs:
        overall = write_summary(d)
        if overall is None:
            print(f"{d}: no run records", file=sys.stderr)
            return 1
        print(f"{d}/summary.md\n{markdown_table(overall, {'score': '.2f', 'density': '.4f'})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
