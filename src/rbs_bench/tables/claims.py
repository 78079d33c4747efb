"""The paper's testable claims, decided by the run records: `claims_<model>.md` and `.tex`.

Each row is one claim of the paper, with
- the paper's evidence: its values as printed (results/paper/paper_values.csv), and its sample
  count or interval where its table gives them;
- this model's evidence: the paired difference on the same samples (the claim's method minus the
  one it is compared with; accuracy in points, density and recall in percentage points) with its
  95% interval (a bootstrap over the samples, 2,000 resamples, seed 0), n, and p: the exact
  two-sided sign test of the per-sample differences (tables.paired), Holm-corrected over the
  table's tested claims;
- a verdict computed from them: "supported" where the corrected p is below 0.05 and the
  difference has the claim's sign, "contradicted" where it is below 0.05 with the other sign, and
  "not resolved at this n" otherwise.

Each accuracy claim reads the long setting of its experiment (`ruler_budget_16k`, ...) where the
model has one, else the experiment itself. The mean-dilution claims read the observations' counts
(results/runs/observations/<model>/rank_underestimation.csv): shares of different blocks, not
paired, so their interval and p are the two-proportion normal approximation, and the blocks of a
prompt are not independent (the note says so). The speed claims compare the committed timing
CSVs (results/speed/) with the paper's figures, naming the GPU; one timing per row, so their
verdict is whether the measured speedup reaches the paper's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from rbs_bench import methods, paths
from rbs_bench.methods.scorers import SCORERS
from rbs_bench.records import write_atomic
from rbs_bench.report import load_records
from rbs_bench.tables import paired
from rbs_bench.tables.paper import PaperValues
from rbs_bench.tables.render import Cell, Table, display, to_latex, to_markdown
from rbs_bench.tables.specs import THRESHOLD_ORDER, THRESHOLD_PANELS

SUPPORTED, CONTRADICTED, UNRESOLVED = "supported", "contradicted", "not resolved at this n"
LONG = "_16k"  # the long setting of an experiment, preferred where a model has it
BOOTSTRAP, SEED = 2000, 0
BEST_BLOCK = 128  # the block size the paper reports best (tab:block_sensitivity)
SPEED_CONTEXT = 131072
SPEED_TARGET = 0.05  # the paper's headline operating point
# the paper's speed model (Qwen3-30B-A3B-Instruct-2507-FP8) as the timing CSVs name it, from its
# checkpoint and as the bf16 stand-in of the same shape
SPEED_MODELS = ("qwen3_30b_a3b_fp8", "qwen3_30b_a3b")


@dataclass
class Evidence:
    """One comparison of this model's records."""

    n: int  # paired samples (or blocks, for the observations)
    diff: float  # the claim's side minus the other, in points
    lo: float
    hi: float
    p: float
    detail: str  # the two sides' values, e.g. "58.00 vs 57.50"
    setting: str  # which records: experiment, tasks and length


@dataclass
class Claim:
    text: str
    source: str  # the paper's table or figure and cell
    paper: str  # the paper's evidence as printed
    evidence: Evidence | None = None
    speed: tuple[float, float, str] | None = None  # (ours, the paper's, where) for speed rows
    p_holm: float | None = None
    verdict: str = ""


# ------------------------------------------------------------------------------------------------
# Statistics


def _bootstrap(d: np.ndarray) -> tuple[float, float]:
    rng = np.random.default_rng(SEED)
    means = d[rng.integers(0, len(d), size=(BOOTSTRAP, len(d)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def paired_evidence(a: pd.DataFrame, b: pd.DataFrame, column: str, scale: float, setting: str):
    """Evidence that cell `a`'s `column` (per sample, times `scale`) exceeds cell `b`'s on the
    samples both ran; None where they share none."""
    sa = pd.Series(a[column].to_numpy(float), index=paired._key(a)).groupby(level=0).mean()
    sb = pd.Series(b[column].to_numpy(float), index=paired._key(b)).groupby(level=0).mean()
    both = sa.index.intersection(sb.index)
    if not len(both):
        return None
    d = scale * (sa[both] - sb[both]).to_numpy()
    lo, hi = _bootstrap(d)
    p = paired.sign_test(int((d > 0).sum()), int((d < 0).sum()))
    detail = f"{scale * sa[both].mean():.2f} vs {scale * sb[both].mean():.2f}"
    return Evidence(len(both), float(d.mean()), lo, hi, p, detail, setting)


def proportion_evidence(a: pd.Series, b: pd.Series, setting: str) -> Evidence | None:
    """Evidence that the share `underestimated / top_blocks` of row `a` (a scorer's quintile of
    the observations) exceeds row `b`'s: two independent proportions, normal approximation, in
    percentage points; None where a side has no blocks."""
    k1, n1, k2, n2 = (int(r[c]) for r in (a, b) for c in ("underestimated", "top_blocks"))
    if not (n1 and n2):
        return None
    p1, p2 = k1 / n1, k2 / n2
    se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    pool = (k1 + k2) / (n1 + n2)
    se0 = math.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
    p = math.erfc(abs(p1 - p2) / se0 / math.sqrt(2)) if se0 > 0 else 1.0
    d = 100 * (p1 - p2)
    detail = f"{100 * p1:.1f}% of {n1} vs {100 * p2:.1f}% of {n2}"
    return Evidence(n1 + n2, d, d - 196 * se, d + 196 * se, p, detail, setting)


def decide(claims: list[Claim]) -> None:
    """Holm-correct the tested claims' p-values together and set every verdict."""
    tested = [c for c in claims if c.evidence is not None]
    for c, p in zip(tested, paired.holm([c.evidence.p for c in tested])):
        c.p_holm = p
        if p >= paired.ALPHA or c.evidence.diff == 0:
            c.verdict = UNRESOLVED
        else:
            c.verdict = SUPPORTED if c.evidence.diff > 0 else CONTRADICTED
    for c in claims:
        if c.speed is not None:
            ours, theirs, _ = c.speed
            c.verdict = SUPPORTED if ours >= theirs else CONTRADICTED
        elif c.evidence is None:
            c.verdict = "no records"


# ------------------------------------------------------------------------------------------------
# Records


class Runs:
    """The run records of one model, loaded once per experiment (`loaded`: the frames the
    tables already read, by (experiment, model))."""

    def __init__(self, results: Path, model: str, loaded: dict | None = None):
        self.results, self.model, self.loaded = Path(results), model, loaded or {}
        self.used: dict[str, int] = {}  # records file -> records read, of the picked experiments

    def records(self, experiment: str) -> pd.DataFrame:
        key = (experiment, self.model)
        if key not in self.loaded:
            d = paths.runs_dir(self.results) / experiment / self.model
            self.loaded[key] = load_records(d) if d.is_dir() else pd.DataFrame()
        return self.loaded[key]

    def pick(self, experiment: str) -> tuple[str, pd.DataFrame]:
        """(name, records) of the experiment's long setting where it has records, else its own."""
        for name in (experiment + LONG, experiment):
            df = self.records(name)
            if len(df) and "score" in df:
                self.used |= df.groupby("source").size().to_dict()
                return name, df
        return experiment, pd.DataFrame()


def _setting(name: str, df: pd.DataFrame) -> str:
    lengths = "/".join(f"{n // 1024}K" for n in sorted(df["context_length"].unique()))
    return f"{name}: {', '.join(sorted(df['task'].unique()))} at {lengths}"


def _cells(df: pd.DataFrame) -> Iterator[tuple[object, pd.DataFrame]]:
    """(target, records) of each budget target of the sparse cells, in ascending order."""
    sparse = df[df["method"] != methods.DENSE]
    for target in sorted(sparse["budget_target"].dropna().unique()):
        yield target, sparse[sparse["budget_target"] == target]


def _contenders(df: pd.DataFrame) -> list[str]:
    """The methods a claim compares the headline method with: every other sparse method of the
    records that is not a reference (the oracle)."""
    names = set(df["method"]) - {methods.DENSE, methods.headline()}
    return [m for m in methods.in_order(names) if not methods.info(m).reference]


def _pct(t: float) -> str:
    return f"{round(100 * t, 6):g}%"


def _caption_n(pv: PaperValues, table: str) -> str:
    """The sample count a table's caption gives ("130 ... examples"), as " (n=130)"."""
    caption = next((r["caption_short"] for k, r in pv.cells.items() if k[0] == table), "")
    m = re.search(r"\b(\d+) [\w-]+ examples", caption)
    return f" (n={m.group(1)})" if m else ""


# ------------------------------------------------------------------------------------------------
# The claims


def budget_claims(runs: Runs, pv: PaperValues) -> list[Claim]:
    """Tables 2 and 8: RBS at least as accurate as each baseline at matched density."""
    head, out = methods.headline(), []
    for experiment, table, row_col in (
        ("ruler_budget", "tab:ruler_budget", lambda t, m: (_pct(t), f"{display(m)}:accuracy")),
        (
            "strict_density",
            "tab:strict_density",
            lambda t, m: (display(m), f"{100 * t:.2f}% anchor:accuracy"),
        ),
    ):
        name, df = runs.pick(experiment)
        if df.empty:
            continue
        for target, cell in _cells(df):
            mine = cell[cell["method"] == head]
            for other in _contenders(cell):
                a, b = (pv.get(table, *row_col(target, m)) for m in (head, other))
                theirs = cell[cell["method"] == other]
                out.append(
                    Claim(
                        f"{display(head)} at least as accurate as {display(other)} at "
                        f"{_pct(target)} density",
                        f"{table}, {_pct(target)}",
                        f"{a} vs {b}" if a and b else "–",
                        paired_evidence(mine, theirs, "score", 1.0, _setting(name, cell)),
                    )
                )
    return out


def selector_claims(runs: Runs, pv: PaperValues) -> list[Claim]:
    """Table 7: RBS above every other selector at matched density, in accuracy and in attention
    recall (the share of the dense attention mass on the kept pairs)."""
    table, head = "tab:selector_ablation", methods.headline()
    name, df = runs.pick("selector_ablation")
    if df.empty:
        return []
    out = []
    row = lambda m: methods.info(m).paper_row(table)

    def interval(m: str) -> str:
        lo, hi = (pv.get(table, row(m), f"95% CI:{s}") for s in ("low", "high"))
        return f"{pv.get(table, row(m), 'Accuracy')} [{lo}, {hi}]" if lo else "–"

    for target, cell in _cells(df):
        mine = cell[cell["method"] == head]
        where = _setting(name, cell)
        for other in _contenders(cell):
            theirs = cell[cell["method"] == other]
            out.append(
                Claim(
                    f"{display(head)} more accurate than {row(other)} at {_pct(target)} density",
                    f"{table}, Accuracy",
                    f"{interval(head)} vs {interval(other)}{_caption_n(pv, table)}",
                    paired_evidence(mine, theirs, "score", 1.0, where),
                )
            )
            if "recall" in cell and mine["recall"].notna().all() and theirs["recall"].notna().all():
                out.append(
                    Claim(
                        f"{display(head)} keeps more attention mass than {row(other)} at "
                        f"{_pct(target)} density",
                        "§2.3 (mean dilution)",
                        "no value given",
                        paired_evidence(mine, theirs, "recall", 100.0, where),
                    )
                )
    return out


def threshold_claims(runs: Runs, pv: PaperValues) -> list[Claim]:
    """Table 10: the conservative pair keeps more than the default, the default more than the
    aggressive; and (the paper's Qwen3-32B panel) accuracy falls in the same order."""
    table, head = "tab:threshold_sensitivity", methods.headline()
    name, df = runs.pick("thresholds")
    if df.empty:
        return []
    df = df[df["method"] == head]
    panels = " / ".join(THRESHOLD_PANELS.values())
    out = []
    for more, less in zip(THRESHOLD_ORDER, THRESHOLD_ORDER[1:]):
        a, b = df[df["budget"] == more], df[df["budget"] == less]
        if a.empty or b.empty:
            continue
        for column, what, scale in (("Mean density", "density", 100.0), ("Accuracy", "score", 1.0)):
            paper = "; ".join(
                f"{pv.get(table, f'{p}:{more.capitalize()}', column)} vs "
                f"{pv.get(table, f'{p}:{less.capitalize()}', column)}"
                for p in THRESHOLD_PANELS.values()
            )
            noun = "denser" if what == "density" else "more accurate"
            out.append(
                Claim(
                    f"the {more} threshold pair {noun} than the {less} pair",
                    f"{table}, {column} ({panels})",
                    paper,
                    paired_evidence(a, b, what, scale, _setting(name, df)),
                )
            )
    return out


def block_claims(runs: Runs, pv: PaperValues) -> list[Claim]:
    """Table 9: RBS most accurate at B=128 among the block sizes run."""
    table, head = "tab:block_sensitivity", methods.headline()
    name, df = runs.pick("block_size")
    if df.empty:
        return []
    df = df[df["method"] == head]
    size = df["method_fields"].map(lambda f: f.get("block_size") if isinstance(f, dict) else None)
    best = df[size == BEST_BLOCK]
    paper_row = lambda b: f"{methods.info(head).paper_row(table)}:{b}"
    out = []
    for b in sorted(set(size.dropna()) - {BEST_BLOCK}):
        other = df[size == b]
        target = _pct(float(other["budget_target"].iloc[0]))
        out.append(
            Claim(
                f"{display(head)} more accurate at B={BEST_BLOCK} than at B={int(b)} "
                f"({target} density)",
                f"{table}, Accuracy",
                f"{pv.get(table, paper_row(BEST_BLOCK), 'Accuracy')} vs "
                f"{pv.get(table, paper_row(int(b)), 'Accuracy')}",
                paired_evidence(best, other, "score", 1.0, _setting(name, df)),
            )
        )
    return out


def dilution_claims(results: Path, model: str, pv: PaperValues) -> list[Claim]:
    """Figure 1(b): the centroid's rank underestimation grows with block radius (Q5 above Q1),
    and the RBS rescue score underestimates the most dispersed blocks (Q5) less."""
    path = paths.runs_dir(results) / "observations" / model / "rank_underestimation.csv"
    if not path.exists():
        return []
    u = pd.read_csv(path)
    u = u[u["layer"].astype(str) == "all"].set_index(["scorer", "quintile"])
    mean_only, head = SCORERS[0], methods.headline()  # the centroid score; RBS's rescue score
    q1, q5 = u.loc[(mean_only, "Q1")], u.loc[(mean_only, "Q5")]
    rbs5 = u.loc[(head, "Q5")]
    where = f"observations: {path.parent.name}, top blocks pooled over prompts, layers and heads"
    paper = pv.get("fig:observations_b", "Q5", "RBS vs mean-only underestimation")
    return [
        Claim(
            "the centroid's rank underestimation grows with block radius (Q5 above Q1)",
            "fig:observations_b",
            "grows with radius (no values given)",
            proportion_evidence(q5, q1, where),
        ),
        Claim(
            f"{display(head)}'s rescue score underestimates Q5 blocks less than the centroid",
            "fig:observations_b, Q5",
            f"{paper} pp less" if paper else "–",
            proportion_evidence(q5, rbs5, where),
        ),
    ]


def _gpu_csvs(results: Path, prefix: str, columns: set) -> Iterator[tuple[Path, pd.DataFrame]]:
    """(path, rows) of each GPU timing CSV `<prefix>_<gpu>.csv` that holds `columns` (the other
    CSVs of that prefix, a profile or a variant sweep, are another table)."""
    for path in sorted(paths.speed_dir(results).glob(f"{prefix}_*.csv")):
        if "cpu" in path.name:
            continue
        try:
            t = pd.read_csv(path)
        except (pd.errors.ParserError, UnicodeDecodeError):
            continue
        if columns <= set(t.columns):
            yield path, t


def speed_claims(results: Path, pv: PaperValues) -> list[Claim]:
    """The paper's headline speedups at 128K, against every committed GPU timing."""
    fig, head = "fig:speed_3panel", methods.headline()
    out = []
    paper = pv.get(fig, "standalone:128K", display(head))
    need = {"gpu", "inputs", "n", "method", "target", "density", "total_ms"}
    for path, t in _gpu_csvs(results, "attention", need):
        hit = t[(t["n"] == SPEED_CONTEXT) & (t["method"] == head) & (t["target"] == SPEED_TARGET)]
        hit = hit[hit["executor"] == "triton"] if "executor" in hit else hit
        if hit.empty or paper is None:
            continue
        r = hit.iloc[-1]
        same = (t["n"] == SPEED_CONTEXT) & (t["inputs"] == r["inputs"]) & (t["density"] == 1.0)
        dense = t.loc[same, "total_ms"].min()
        ours = float(dense / r["total_ms"])
        where = f"{r['gpu']}, {r['inputs']} inputs, fastest dense kernel ({path.name})"
        out.append(_speed_claim("standalone prefill-attention", fig, paper, ours, where))
    paper = pv.get(fig, "vllm_ttft:128K", display(head))
    need = {"model", "dtype", "device", "layers", "batch", "n", "method", "target", "run"}
    for path, t in _gpu_csvs(results, "ttft", need | {"ttft_speedup"}):
        t = t[(t["n"] == SPEED_CONTEXT) & (t["batch"] == 1) & (t["target"] == SPEED_TARGET)]
        t = t[(t["method"] == head) & t["model"].isin(SPEED_MODELS)]
        if t.empty or paper is None:
            continue
        whole = t["layers"] == t.groupby("model")["layers"].transform("max")  # the whole model
        for _, r in t[whole].sort_values("run").groupby("model").tail(1).iterrows():
            where = f"{r['device']}, {r['model']} {r['dtype']}, {r['layers']} layers ({path.name})"
            out.append(_speed_claim("TTFT", fig, paper, float(r["ttft_speedup"]), where))
    return out


def _speed_claim(what: str, fig: str, paper: str, ours: float, where: str) -> Claim:
    return Claim(
        f"{display(methods.headline())}'s {what} speedup over dense at 128K reaches {paper}x",
        fig,
        f"{paper}x",
        speed=(ours, float(paper), where),
    )


# ------------------------------------------------------------------------------------------------
# The table


def claims_of(
    results: Path, model: str, pv: PaperValues, loaded: dict | None = None
) -> tuple[list[Claim], list]:
    """The claims with evidence on `model`, decided, and the (records file, count) they read;
    ([], []) where no claim has records of this model."""
    runs = Runs(results, model, loaded)
    builders: list[Callable[[], list[Claim]]] = [
        lambda: budget_claims(runs, pv),
        lambda: selector_claims(runs, pv),
        lambda: threshold_claims(runs, pv),
        lambda: block_claims(runs, pv),
        lambda: dilution_claims(results, model, pv),
    ]
    accuracy = [c for build in builders for c in build()]
    if not accuracy:
        return [], []
    claims = accuracy + speed_claims(results, pv)
    decide(claims)
    return claims, sorted(runs.used.items())


def _ours(c: Claim) -> tuple[str, str, str]:
    if c.speed is not None:
        ours, _, where = c.speed
        return f"{ours:.2f}x", where, "–"
    e = c.evidence
    if e is None:
        return "–", "–", "–"
    return (
        f"{e.diff:+.1f} [{e.lo:+.1f}, {e.hi:+.1f}] ({e.detail}), n={e.n}",
        e.setting,
        f"{c.p_holm:.3g}",
    )


def table(claims: list[Claim], model: str, sources: list) -> Table:
    rows = []
    for c in claims:
        ours, where, p = _ours(c)
        rows.append([Cell((t,)) for t in (c.text, c.source, c.paper, ours, where, p, c.verdict)])
    counts = {v: sum(c.verdict == v for c in claims) for v in (SUPPORTED, CONTRADICTED, UNRESOLVED)}
    tally = ", ".join(f"{n} {v}" for v, n in counts.items())
    return Table(
        title=f"The paper's claims on {model}",
        label=f"tab:claims_{re.sub(r'[^A-Za-z0-9]+', '_', model)}",
        header=[
            "Claim",
            "Paper",
            "Paper's evidence",
            "Ours: difference [95% CI]",
            "Ours: records",
            "p (Holm)",
            "Verdict",
        ],  # fmt: skip
        rows=rows,
        keys=3,
        sources=sources,
        notes=[
            f"{tally}. Difference: the claim's side minus the other on the same samples "
            "(accuracy in points; density and recall in percentage points), with its 95% "
            f"bootstrap interval ({BOOTSTRAP:,} resamples of the samples, seed {SEED}). p: the "
            "exact two-sided sign test of the per-sample differences, Holm-corrected over the "
            "table's tested claims; supported / contradicted: corrected p < 0.05 with the "
            "claim's sign / the other sign; otherwise not resolved at this n "
            "(rbs_bench.tables.claims).",
            "Mean-dilution rows compare shares of top blocks (two-proportion normal "
            "approximation); blocks of one prompt are not independent, so their intervals are "
            "too narrow. Speed rows: one timing run each, against the paper's figure; the "
            "dense baseline of the standalone rows is the fastest dense kernel of the run.",
            f"Scope: {model}'s records are evidence about the selection rules on this model and "
            "length, not about the paper's models at 128K. The paper's evidence comes from "
            "results/paper/paper_values.csv.",
        ],
    )


def build(results: Path, out: Path, pv: PaperValues, loaded: dict | None = None) -> list[Path]:
    """claims_<model>.md and .tex for every model with records of a claim's experiment
    (`loaded`: the record frames already read, by (experiment, model), so none is read twice)."""
    models = sorted({d.name for d in paths.experiment_dirs(results)})
    loaded = {} if loaded is None else loaded
    written = []
    for model in models:
        claims, sources = claims_of(Path(results), model, pv, loaded)
        if not claims:
            continue
        t = table(claims, model, sources)
        head = "Generated by `python -m rbs_bench.tables` from run records; do not edit."
        base = Path(out) / f"claims_{model}"
        write_atomic(base.with_suffix(".md"), f"# Claims on {model}\n\n{head}\n\n{to_markdown(t)}")
        write_atomic(base.with_suffix(".tex"), f"% {head}\n\n{to_latex(t)}")
        written += [base.with_suffix(".md"), base.with_suffix(".tex")]
    return written
