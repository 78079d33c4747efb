"""Figures redrawn from run records (never by rerunning a model).

    python -m rbs_bench.figures [--results results] [--out results/figures]

Every method is drawn with its `MethodInfo` (display name, colour and marker; the headline method
thicker and on top: rbs_bench.methods.line_style). Writes, for every
results/runs/<experiment>/<model> that has the records:
  <out>/ruler_budget_<model>.png  accuracy against measured density per method, one point per
                                  target (the budget sweep of Table 2 as curves; dense dashed)
  <out>/ruler_main_<model>.png    accuracy and measured density against context length per method
                                  (Table 4 as curves)
and redraws Figure 1 of every observations run (results/runs/observations/<model>/
observations.png) from its CSVs. The speed figure (Figure 3) comes with the timing tables
(python -m rbs_bench.tables).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from rbs_bench import methods, paths
from rbs_bench.errors import deferred, one_line, stop_on_signals
from rbs_bench.methods import DENSE
from rbs_bench.report import load_records
from rbs_bench.tables.layout import cell_means
from rbs_bench.tables.render import context_label, method_order


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    paths.make_dirs(path.parent)
    paths.check_inside(path)
    tmp = paths.check_inside(path.with_name(f".{path.name}.tmp.png"))
    with deferred():  # a stop waits for the figure's replacement
        fig.savefig(tmp)
        _plt().close(fig)
        tmp.replace(path)
    return path


def _sources_note(df: pd.DataFrame) -> str:
    return f"{df['source'].nunique()} records files, {len(df)} samples"


def budget_figure(df: pd.DataFrame, title: str, path: Path) -> Path:
    """Accuracy vs measured density, one line per method over its budgets, per context length."""
    plt = _plt()
    lengths = sorted(df["context_length"].unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), dpi=120)
    axes = [axes] if len(lengths) == 1 else list(axes)
    for ax, n in zip(axes, lengths):
        sub = df[df["context_length"] == n]
        means = cell_means(sub, ["method", "budget"])
        for method in sorted(means["method"].unique(), key=method_order):
            m = means[means["method"] == method].sort_values("density")
            style = methods.line_style(method)  # display name, colour, marker, emphasis
            if method == DENSE:
                score = m["score"].mean()
                ax.axhline(score, ls="--", color=style["color"], lw=1, label=style["label"])
                continue
            ax.plot(100 * m["density"], m["score"], **style)
        ax.set_xlabel("measured density (% of causal block pairs)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{title}, {context_label(n)} ({_sources_note(sub)})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def length_figure(df: pd.DataFrame, title: str, path: Path) -> Path:
    """Accuracy and measured density vs context length, one line per method."""
    plt = _plt()
    means = cell_means(df, ["method", "context_length"])
    fig, (acc, dens) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for method in sorted(means["method"].unique(), key=method_order):
        m = means[means["method"] == method].sort_values("context_length")
        kw = methods.line_style(method)
        acc.plot(m["context_length"], m["score"], **kw)
        dens.plot(m["context_length"], 100 * m["density"], **kw)
    lengths = sorted(means["context_length"].unique())
    for ax, ylabel in ((acc, "accuracy (%)"), (dens, "measured density (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [context_label(n) for n in lengths])
        ax.set_xlabel("context length")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    acc.legend(fontsize=7)
    fig.suptitle(f"{title} ({_sources_note(df)})", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


FIGURES = {"ruler_budget": budget_figure, "ruler_main": length_figure}


def build_figures(results: Path, out: Path) -> list[Path]:
    """Every figure of FIGURES and every observations figure under <results>/runs."""
    from rbs_bench import observations

    written = []
    for exp_dir in paths.experiment_dirs(results):
        experiment, model = exp_dir.parent.name, exp_dir.name
        if experiment in FIGURES:
            df = load_records(exp_dir)
            if df.empty:
                print(f"{exp_dir}: no figure (no run records)", file=sys.stderr)
                continue
            path = Path(out) / f"{experiment}_{model}.png"
            written.append(FIGURES[experiment](df, f"{experiment} / {model}", path))
        elif (exp_dir / "observations.json").exists():
            written.append(Path(observations.redraw(exp_dir)))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--out", type=Path, default=None, help="default: <results>/figures")
    args = ap.parse_args(argv)
    stop_on_signals()
    return one_line(lambda: _figures(args.results, args.out or paths.figures_dir(args.results)))


def _figures(results: Path, out: Path) -> int:
    paths.results_folder(results)
    paths.confine(out)
    written = build_figures(results, out)
    if not written:
        print(f"no run records for figures under {paths.runs_dir(results)}", file=sys.stderr)
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
