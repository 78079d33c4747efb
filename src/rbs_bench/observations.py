"""The mean-dilution observations (paper §2.3, Figure 1) on any model the harness loads.

    python -m rbs_bench +experiment=observations                          # tiny model, CPU, minutes
    python -m rbs_bench +experiment=observations observations.synthetic=true   # planted needles
    python -m rbs_bench.observations [results/runs/observations/<model> ...]   # redraw from CSVs

Capture. During each prefill, a probe selector sees the post-RoPE Q/K of the chosen layers and
query heads (the layer itself runs dense) and computes, without keeping N x N attention:
- the true block mass: for query block i and key block j, the sum over the real queries t of block
  i of the causal softmax probability of the keys s <= t in block j (`kernels/block_mass.py`,
  Triton on CUDA, a chunked torch reduction on the CPU); row i sums to the tokens of block i;
- each key block's radius r_b = max ||k - c_b|| and rescue coefficient beta_b (docs/design.md §4);
- four block scores: centroid (the base-branch LSE of q . c_b), RBS rescue (the rescue-branch LSE
  of q . c_b + ||q|| r_b beta_b), full L2 (rescue with beta = 1) and the Quest box bound (max over
  the query block of q+ . kmax + q- . kmin);
- every method's selection at each value of a sweep of its knob.
Key-block statistics are per KV head; a query head uses its KV head's. Blocks have one size
(`observations.block_size`, given to every method; MInference's token pattern is counted on it).

Definitions (per prompt, layer and query head, "unit"; M key blocks, candidates C_i = {j < i}):
- Coverage of a selection = mean over the N query rows of the share of the row's dense softmax
  mass that lies in kept (query block, key block) pairs = sum of the kept block mass / N
  (MInference: the mass on its exact token pattern). Selected-block ratio = kept causal block
  pairs / causal block pairs (the runs' density, forced blocks included). Panel (a) averages both
  over units and prompts, one point per knob value. Oracle ceiling: block pairs kept in
  descending order of true mass, pooled over all units (the most mean coverage any selection of
  that mean ratio can reach), evaluated per prompt on a density grid and pooled over prompts by
  merging the per-prompt curves' segments in slope order.
- True top blocks of query block i: the k_i = max(1, ceil(f |C_i|)) candidates with the largest
  true mass (f = `top_fraction`, 0.05; ties to the lower block id); rows with no candidate have
  none.
- Radius quintile of key block j: its rank by radius among the M key blocks of its layer and KV
  head (ascending, ties to the lower id), quintile = floor(5 rank / M): Q1 compact ... Q5 dispersed.
- Rank underestimation of a scorer in quintile Q (panel b) = among the true top blocks (pooled over
  units, query blocks and prompts) whose key block is in Q, the share that the scorer ranks outside
  its own top k_i of the same candidates, i.e. with at least k_i candidates scoring strictly higher
  (ties count in the block's favour).
- Top share of quintile Q (panel c) = the share of all true top blocks whose key block is in Q; a
  radius that says nothing about attention gives 20% each (the candidate share per quintile is in
  the CSV too: earlier blocks are candidates of more query blocks).

Outputs under `<results_dir>/runs/<experiment>/<model or synthetic>/`: records.jsonl (one line per
prompt: a rerun resumes), coverage.csv, rank_underestimation.csv, top_share.csv,
observations.png and observations.md (caption and settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from rbs_bench import methods, paths
from rbs_bench.errors import UserError, deferred
from rbs_bench.kernels.quest_select import top_fraction
from rbs_bench.methods.mass import true_block_mass
from rbs_bench.methods.oracle import Oracle
from rbs_bench.methods.scorers import (
    LABELLED,
    SCORER_COLOURS,
    SCORER_LABELS,
    SCORERS,
    scorer_scores,
)
from rbs_bench.methods.selection import BlockSelection, candidate_mask
from rbs_bench.records import RecordStore, check_fingerprint, write_atomic
from rbs_bench.report import markdown_table
from rbs_bench.session import Session, input_ids, resolve_device

QUINTILES = 5
CEILING = Oracle.name  # the coverage curve of keeping block pairs in descending true mass
ORACLE_GRID = np.unique(
    np.concatenate([[0.0], np.geomspace(1e-4, 1.0, 161), np.linspace(0, 1, 201)])
)


# ------------------------------------------------------------------------------ definitions


def radius_quintiles(radius: Tensor) -> Tensor:
    """int64 [..., M]: quintile 0 (compact) .. 4 (dispersed) of each block by radius rank."""
    m = radius.shape[-1]
    order = radius.argsort(dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(m, device=radius.device).expand_as(order).clone()
    )
    return rank * QUINTILES // m


def top_counts(m: int, fraction: float) -> Tensor:
    """int64 [M]: k_i = max(1, ceil(fraction |C_i|)) for |C_i| = i candidates (0 when i = 0)."""
    i = torch.arange(m, dtype=torch.float64)
    return torch.minimum(torch.ceil(fraction * i - 1e-9).clamp_min(1), i).long()


def true_top(mass: Tensor, fraction: float) -> Tensor:
    """bool [..., M, M]: the k_i candidates j < i of largest true mass (ties to the lower id)."""
    m = mass.shape[-1]
    return top_fraction(mass, candidate_mask(m, mass.device), fraction)


def ranked_outside(scores: Tensor, fraction: float) -> Tensor:
    """bool [..., M, M]: candidate j < i with at least k_i candidates scoring strictly higher."""
    m = scores.shape[-1]
    cand = candidate_mask(m, scores.device)
    s = scores.float().masked_fill(~cand, -math.inf).contiguous()
    ascending = s.sort(-1).values
    higher = m - torch.searchsorted(ascending, s, right=True)  # [..., M, M]
    k = top_counts(m, fraction).to(scores.device)[:, None]
    return (higher >= k) & cand


def quintile_counts(flags: Tensor, quintile: Tensor) -> np.ndarray:
    """int [5]: how many set (…, i, j) pairs of flags [..., M, M] have key block j in each
    quintile; quintile [..., M] (the key block's, broadcast over i)."""
    q = quintile[..., None, :].expand_as(flags)
    return torch.bincount(q[flags].flatten(), minlength=QUINTILES).cpu().numpy()


def oracle_curve(masses: list[Tensor], rows: list[int], grid: np.ndarray) -> np.ndarray:
    """Mean coverage at each mean selected-block ratio of `grid` when block pairs are kept in
    descending order of true mass, pooled over units (mass [M, M] of a unit with `rows` tokens).

    Unit u's pair adds mass / (rows_u U) to the mean coverage and 1 / (P_u U) to the mean ratio
    (P_u = M (M + 1) / 2 causal pairs), so keeping pairs by mass P_u / rows_u first is optimal.
    """
    gain, cost = [], []
    for mass, n in zip(masses, rows):
        m = mass.shape[-1]
        causal = torch.ones(m, m, dtype=torch.bool, device=mass.device).tril()
        v = mass[causal].double().cpu().numpy()
        gain.append(v / n)
        cost.append(np.full(v.shape, 1.0 / v.size))
    gain, cost = np.concatenate(gain) / len(masses), np.concatenate(cost) / len(masses)
    order = np.argsort(-gain / cost, kind="stable")
    x = np.concatenate([[0.0], np.cumsum(cost[order])])
    y = np.concatenate([[0.0], np.cumsum(gain[order])])
    return np.interp(grid, x, y)


def pool_curves(curves: list[np.ndarray], grid: np.ndarray) -> np.ndarray:
    """The mean of concave curves y_p(x) on `grid`, pooled as one budget: max (1/P) sum y_p(x_p)
    subject to (1/P) sum x_p = x, by merging their segments in descending slope order."""
    dx = np.concatenate([np.diff(grid)] * len(curves)) / len(curves)
    dy = np.concatenate([np.diff(c) for c in curves]) / len(curves)
    order = np.argsort(-dy / np.maximum(dx, 1e-300), kind="stable")
    x = np.concatenate([[0.0], np.cumsum(dx[order])])
    y = np.concatenate([[np.mean([c[0] for c in curves])], np.cumsum(dy[order])])
    return np.interp(grid, x, y)


def knob_values(selector, points: int) -> list[float]:
    """The knob values a method's curve is traced at: its `info.sweep` (docs of
    rbs_bench.methods.info.MethodInfo), else geometric over its knob_range."""
    spacing, lo, hi = methods.info(selector.name).sweep or (
        "log",
        *selector.knob_range,
    )
    if spacing == "lin":
        return np.linspace(lo, hi, points).tolist()
    if spacing == "tail":
        return (1.0 - np.geomspace(1.0 - lo, 1.0 - hi, points)).tolist()
    return np.geomspace(lo, hi, points).tolist()


# ------------------------------------------------------------------------------------ capture


@dataclass
class Analysis:
    """What one unit set (a layer's chosen heads) contributes to a prompt's record."""

    coverage: dict  # method -> [knob values, density [V], coverage [V]] (means over heads)
    masses: list  # per head: mass [M, M] (for the oracle)
    rows: int
    top: np.ndarray  # [5]
    candidates: np.ndarray  # [5]
    under: dict  # scorer -> [5]
    radius_sum: np.ndarray  # [5]
    beta_sum: np.ndarray  # [5]
    blocks: np.ndarray  # [5]


def analyse(q: Tensor, k: Tensor, scale: float | None, settings: Settings) -> Analysis:
    """All quantities of one layer: q [1, H, N, D], k [1, H, N, D] (one KV head per query head)."""
    bs, frac = settings.block_size, settings.top_fraction
    n = q.shape[2]
    mass = true_block_mass(q, k, bs, scale)[0]  # [H, M, M]
    scores, radius, beta = scorer_scores(q, k, bs, scale)
    quint = radius_quintiles(radius[0])  # [H, M]
    top = true_top(mass, frac)
    m = mass.shape[-1]
    cand = candidate_mask(m, q.device).expand_as(top)
    under = {s: quintile_counts(top & ranked_outside(scores[s][0], frac), quint) for s in SCORERS}
    sums = lambda x: torch.zeros(QUINTILES, dtype=torch.float64).index_add_(  # noqa: E731
        0, quint.flatten().cpu(), x.flatten().double().cpu()
    )
    coverage = {}
    for name in settings.methods:
        base = settings.selectors[name]
        values = settings.knobs[name]
        sels = [base if v is None else base.with_knob(v) for v in values]
        picks = [s.select(q, k, scale=scale) for s in sels]
        dens, cov = [], []
        if picks and not isinstance(picks[0], BlockSelection):  # e.g. a token-level pattern
            pats = [dataclasses.replace(p, block_size=bs) for p in picks]
            kept = type(pats[0]).kept_masses(q, k, scale, pats)
            for p, km in zip(pats, kept):
                dens.append(float(p.head_density().mean()))
                cov.append(float(km.mean()) / n)
        else:
            for p in picks:
                keep = p.mask()[0]  # [H, M, M]
                dens.append(float(p.head_density().mean()))
                cov.append(float((mass * keep).sum((-1, -2)).mean()) / n)
        coverage[name] = [values, dens, cov]
    return Analysis(
        coverage=coverage,
        masses=[mass[h].cpu() for h in range(mass.shape[0])],
        rows=n,
        top=quintile_counts(top, quint),
        candidates=quintile_counts(cand, quint),
        under=under,
        radius_sum=sums(radius[0]).numpy(),
        beta_sum=sums(beta[0]).numpy(),
        blocks=sums(torch.ones_like(radius[0])).numpy(),
    )


@dataclass
class Settings:
    """The analysis settings (the `observations` config node, resolved)."""

    block_size: int
    top_fraction: float
    methods: list[str]
    selectors: dict
    knobs: dict  # method -> knob values ([None]: the method has no knob)
    heads: list[int] | None
    layers: list[int] | None


def settings_from(ocfg) -> Settings:
    bs = int(ocfg.block_size)
    if bs < 16:
        raise UserError(f"observations.block_size must be >= 16, got {bs}")
    if not 0 < ocfg.top_fraction <= 1:
        raise UserError(f"observations.top_fraction must be in (0, 1], got {ocfg.top_fraction}")
    selectors, knobs = {}, {}
    for name in ocfg.methods:
        if name == CEILING:
            raise UserError(
                f"observations.methods: {name!r} is drawn anyway (the pooled ceiling curve); "
                "leave it out"
            )
        try:
            cls = methods.method_class(name)
            fields = {"block_size": bs} if "block_size" in methods.field_names(name) else {}
            sel = methods.build(name, **fields)
        except ValueError as e:
            raise UserError(f"observations.methods: {e}") from None
        stride = getattr(sel, "stride", None)  # an antidiagonal estimate's stride
        if stride and bs % stride:
            raise UserError(f"observations.block_size {bs} must be a multiple of {name}'s stride")
        selectors[name] = sel
        knobs[name] = [None] if cls.knob is None else knob_values(sel, int(ocfg.knob_points))
    heads = None if ocfg.heads is None else [int(h) for h in ocfg.heads]
    layers = None if ocfg.layers is None else [int(x) for x in ocfg.layers]
    return Settings(
        bs, float(ocfg.top_fraction), list(ocfg.methods), selectors, knobs, heads, layers
    )


def head_view(q: Tensor, k: Tensor, heads: list[int] | None) -> tuple[Tensor, Tensor]:
    """The chosen query heads, each with its own copy of its KV head: [1, H', N, D] twice.

    Every statistic and selection is per query head from its KV head's keys, so this is exact.
    """
    group = q.shape[1] // k.shape[1]
    heads = list(range(q.shape[1])) if heads is None else heads
    bad = [h for h in heads if not 0 <= h < q.shape[1]]
    if bad:
        raise UserError(f"observations.heads {bad} out of range: the model has {q.shape[1]}")
    kv = torch.tensor([h // group for h in heads], device=k.device)
    return q[:1, heads], k[:1].index_select(1, kv)


@dataclass
class ObservationProbe:
    """A selector that analyses the chosen layers and keeps every block (the layer runs dense).

    The n-th prefill call of a forward is attention layer `layer_ids[n]` (layers run in order).
    """

    settings: Settings
    layer_ids: list[int]
    results: dict = field(default_factory=dict)  # layer -> Analysis
    _calls: int = 0

    is_dense = False
    name = "observation_probe"

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    def begin_prompt(self) -> None:
        self.results, self._calls = {}, 0

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        layer = self.layer_ids[self._calls % len(self.layer_ids)]
        self._calls += 1
        wanted = self.settings.layers
        if wanted is None or layer in wanted:
            self.results[layer] = analyse(
                *head_view(q, k, self.settings.heads), scale, self.settings
            )
        b, h, n, _ = q.shape
        return BlockSelection.full(b, h, n, self.block_size, q.device)


def prompt_record(results: dict, key: dict, seconds: float) -> dict:
    """One JSON line per prompt: per-layer counts, method curves and the oracle on ORACLE_GRID."""
    layers = sorted(results)
    units = [results[x] for x in layers]
    curves = {}
    for name in units[0].coverage:
        values = units[0].coverage[name][0]
        dens = np.mean([u.coverage[name][1] for u in units], 0)
        cov = np.mean([u.coverage[name][2] for u in units], 0)
        curves[name] = {"knob": values, "density": dens.tolist(), "coverage": cov.tolist()}
    masses = [m for u in units for m in u.masses]
    rows = [u.rows for u in units for _ in u.masses]
    oracle = oracle_curve(masses, rows, ORACLE_GRID)
    ints = lambda a: [int(x) for x in a]  # noqa: E731
    return {
        **key,
        "layers": layers,
        "heads": len(units[0].masses),
        "curves": curves,
        CEILING: oracle.tolist(),
        "top": [ints(u.top) for u in units],
        "candidates": [ints(u.candidates) for u in units],
        "under": {s: [ints(u.under[s]) for u in units] for s in SCORERS},
        "radius_sum": [u.radius_sum.tolist() for u in units],
        "beta_sum": [u.beta_sum.tolist() for u in units],
        "blocks": [ints(u.blocks) for u in units],
        "seconds": round(seconds, 3),
    }


# ---------------------------------------------------------------------------------- aggregate


def aggregate(records: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(coverage, rank_underestimation, top_share) tables of panels (a), (b), (c)."""
    rows = []
    for name in records[0]["curves"]:
        cs = [r["curves"][name] for r in records]
        for v, knob in enumerate(cs[0]["knob"]):
            rows.append(
                {
                    "method": name,
                    "knob": knob,
                    "density": float(np.mean([c["density"][v] for c in cs])),
                    "coverage": float(np.mean([c["coverage"][v] for c in cs])),
                }
            )
    oracle = pool_curves([np.asarray(r[CEILING]) for r in records], ORACLE_GRID)
    rows += [
        {"method": CEILING, "knob": None, "density": x, "coverage": y}
        for x, y in zip(ORACLE_GRID, oracle)
    ]
    coverage = pd.DataFrame(rows)

    layer_ids = sorted({x for r in records for x in r["layers"]})

    def total(key, layer=None, scorer=None):
        out = np.zeros(QUINTILES)
        for r in records:
            vals = r[key] if scorer is None else r[key][scorer]
            for x, v in zip(r["layers"], vals):
                if layer is None or x == layer:
                    out += np.asarray(v, dtype=float)
        return out

    under_rows, share_rows = [], []
    for layer in [None, *layer_ids] if len(layer_ids) > 1 else [None]:
        tag = "all" if layer is None else str(layer)
        top, cand = total("top", layer), total("candidates", layer)
        blocks = total("blocks", layer)
        rad, beta = total("radius_sum", layer), total("beta_sum", layer)
        for q in range(QUINTILES):
            share_rows.append(
                {
                    "layer": tag,
                    "quintile": f"Q{q + 1}",
                    "top_blocks": int(top[q]),
                    "share": top[q] / max(top.sum(), 1),
                    "candidate_share": cand[q] / max(cand.sum(), 1),
                    "radius_mean": rad[q] / max(blocks[q], 1),
                    "beta_mean": beta[q] / max(blocks[q], 1),
                }
            )
        for s in SCORERS:
            under = total("under", layer, s)
            for q in range(QUINTILES):
                under_rows.append(
                    {
                        "layer": tag,
                        "scorer": s,
                        "quintile": f"Q{q + 1}",
                        "top_blocks": int(top[q]),
                        "underestimated": int(under[q]),
                        "share": under[q] / top[q] if top[q] else float("nan"),
                    }
                )
    return coverage, pd.DataFrame(under_rows), pd.DataFrame(share_rows)


# ------------------------------------------------------------------------------------- figure


def caption(top_fraction: float = 0.05) -> str:
    pct = f"{100 * top_fraction:g}%"
    return " ".join(
        [
            "Empirical observations behind RBS. (a) Attention-mass coverage (mean over query",
            "rows of the share of the row's dense softmax mass inside kept block pairs)",
            "against the selected-block ratio (kept / causal block pairs, forced blocks",
            "included), one point per knob value of each method (MInference: the mass on its",
            "token pattern, against the block pairs the pattern touches); dashed green: the",
            "oracle ceiling, keeping block pairs in descending order of true mass. (b) Rank",
            "underestimation by radius quintile of the key block (within its layer and KV",
            f"head; Q1 compact ... Q5 dispersed): among each query block's true top-{pct}",
            "candidate blocks (j < i; at least one), the share that a scorer ranks outside",
            f"its own top-{pct} of the same candidates. Scorers: centroid = LSE of q.c_b",
            "(mean-only); RBS rescue = LSE of q.c_b + ||q|| r_b beta_b; full L2 = the same",
            "with beta = 1; Quest = max over the query block of the box bound. (c) Share of",
            f"the true top-{pct} blocks in each radius quintile; dashed: the 20% of a radius",
            "that carries no information; ticks: the share of candidate pairs.",
        ]
    )


def plot(coverage: pd.DataFrame, under: pd.DataFrame, share: pd.DataFrame, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), dpi=130)
    ax = axes[0]
    oracle = coverage[coverage["method"] == CEILING]
    for name, grp in coverage[coverage["method"] != CEILING].groupby("method", sort=False):
        grp = grp.sort_values("density")
        ax.plot(100 * grp["density"], 100 * grp["coverage"], **methods.line_style(name))
    ax.plot(
        100 * oracle["density"],
        100 * oracle["coverage"],
        "--",
        color="#2ca02c",
        lw=1.8,
        label=CEILING,
    )
    ax.set_xlabel("selected-block ratio (%)")
    ax.set_ylabel("attention-mass coverage (%)")
    ax.set_title("(a) Block selection quality under varying budgets", fontsize=10)
    ax.set_xlim(0, 100)
    ax.set_ylim(max(0, 100 * coverage["coverage"].min() - 5), 101)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, ncol=2, loc="lower right")

    ax = axes[1]
    u = under[under["layer"] == "all"]
    width = 0.8 / len(SCORERS)
    x = np.arange(QUINTILES)
    counts = u[u["scorer"] == SCORERS[0]]["top_blocks"].to_numpy()
    for n, s in enumerate(SCORERS):
        vals = 100 * u[u["scorer"] == s]["share"].to_numpy(dtype=float)
        pos = x + (n - (len(SCORERS) - 1) / 2) * width
        bars = ax.bar(
            pos, np.nan_to_num(vals), width, color=SCORER_COLOURS[s], label=SCORER_LABELS[s]
        )
        if s in LABELLED:
            labels = ["" if c == 0 else f"{v:.0f}" for v, c in zip(vals, counts)]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
    top = max(10.0, 100 * np.nanmax(np.append(u["share"].to_numpy(dtype=float), 0)))
    for q in np.flatnonzero(counts == 0):
        ax.text(q, 0.03 * top, "no top\nblocks", ha="center", va="bottom", fontsize=7, color="0.4")
    ax.set_xticks(x, [f"Q{q + 1}\nn={c}" for q, c in enumerate(counts)])
    ax.set_xlabel("radius quintile (Q1 compact → Q5 dispersed); n: true top blocks")
    ax.set_ylabel("true top blocks ranked outside the scorer's top (%)")
    ax.set_title("(b) Mean-only scoring underestimates dispersed blocks", fontsize=10)
    ax.set_ylim(0, 1.45 * top)  # headroom for the legend above the bars
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= min(100, 1.05 * top)])
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", ncol=2)

    ax = axes[2]
    sh = share[share["layer"] == "all"]
    vals = 100 * sh["share"].to_numpy()
    bars = ax.bar(x, vals, 0.6, color=["#c6dbef", "#9ecae1", "#6baed6", "#3182bd", "#08519c"])
    ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=1)
    ax.axhline(20, ls="--", color="k", lw=1.2, label="uniform (20%)")
    ax.scatter(
        x,
        100 * sh["candidate_share"],
        marker="_",
        s=400,
        color="#555555",
        zorder=3,
        label="share of candidate pairs",
    )
    ax.set_xticks(x, [f"Q{q + 1}" for q in range(QUINTILES)])
    ax.set_xlabel("radius quintile (Q1 compact → Q5 dispersed)")
    ax.set_ylabel("share of true top blocks (%)")
    q5 = vals[-1]
    ax.set_title(f"(c) Q5 holds {q5:.1f}% of top blocks", fontsize=10)
    ax.set_ylim(0, max(vals.max(), 25) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.make_dirs(path.parent)
    paths.check_inside(path)  # no write through a link out of the results folder
    tmp = paths.check_inside(path.with_name(f".{path.name}.tmp.png"))
    with deferred():  # a stop waits for the figure's replacement
        fig.savefig(tmp)
        plt.close(fig)
        tmp.replace(path)


def write_outputs(out_dir: Path, records: list[dict], meta: dict) -> dict[str, pd.DataFrame]:
    """Write the three panel CSVs, the figure and its caption from the prompt records."""
    coverage, under, share = aggregate(records)
    write_atomic(out_dir / "coverage.csv", coverage.to_csv(index=False))
    write_atomic(out_dir / "rank_underestimation.csv", under.to_csv(index=False))
    write_atomic(out_dir / "top_share.csv", share.to_csv(index=False))
    meta = {**meta, "prompts": len(records)}
    write_atomic(out_dir / "observations.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    redraw(out_dir)
    return {"coverage": coverage, "rank_underestimation": under, "top_share": share}


def redraw(out_dir: Path) -> Path:
    """Rebuild observations.png and observations.md from the CSVs of a run directory."""
    out_dir = Path(out_dir)
    read = lambda name: paths.read_text(out_dir / name)  # regular files, never a FIFO
    meta = json.load(read("observations.json"))
    coverage = pd.read_csv(read("coverage.csv"))
    under = pd.read_csv(read("rank_underestimation.csv"), dtype={"layer": str})
    share = pd.read_csv(read("top_share.csv"), dtype={"layer": str})
    title = (
        f"{meta['source']}: {meta['prompts']} prompt(s) x {meta['context_length']} tokens, "
        f"layers {meta['layers']}, {meta['heads']} head(s) each, block {meta['block_size']}"
    )
    plot(coverage, under, share, out_dir / "observations.png", title)
    u = under[under["layer"] == "all"].pivot(index="scorer", columns="quintile", values="share")
    u = (100 * u.loc[list(SCORERS)]).round(1).reset_index()
    s = share[share["layer"] == "all"].set_index("quintile")[["share", "candidate_share"]]
    s = (100 * s).round(1).T.rename_axis("").reset_index()
    md = (
        f"# Observations: {meta['source']}\n\n![observations](observations.png)\n\n"
        f"**Figure.** {caption(meta['top_fraction'])}\n\n{title}.\n\n"
        f"## Panel (b): rank underestimation (%)\n\n{markdown_table(u, {})}\n"
        f"## Panel (c): share of true top blocks (%)\n\n{markdown_table(s, {})}\n"
        f"Settings: `{json.dumps(meta, sort_keys=True)}`\n\nBuilt from `records.jsonl`.\n"
    )
    write_atomic(out_dir / "observations.md", md)
    return out_dir / "observations.png"


# ------------------------------------------------------------------------------------- runner


def _synthetic_inputs(ocfg, index: int, device):
    from rbs_bench import synthetic

    args = dict(ocfg.generator or {})
    try:
        structure = synthetic.Structure(**dict(ocfg.structure or {}))
        return synthetic.generate(
            1,
            seq_len=int(ocfg.context_length),
            structure=structure,
            seed=int(ocfg.seed) + index,
            device=device,
            **args,
        )
    except TypeError as e:
        raise UserError(f"observations.structure / observations.generator: {e}") from None


def run(cfg, experiment: str) -> Path:
    """Capture every pending prompt, then write the panels; returns the run directory."""
    from omegaconf import OmegaConf

    ocfg = cfg.observations
    settings = settings_from(ocfg)
    source = "synthetic" if ocfg.synthetic else cfg.model.name
    out_dir = paths.experiment_dir(cfg.results_dir, experiment, source)
    fingerprint = {"observations": OmegaConf.to_container(ocfg, resolve=True)}
    fingerprint["observations"].pop("prompts")  # more prompts may be added to a run
    if not ocfg.synthetic:
        from rbs_bench.models import identity

        try:
            fingerprint["model"] = identity(cfg.model)
        except ValueError as e:  # a local model's damaged files (models.weights_digest)
            raise UserError(str(e)) from None
        fingerprint["benchmark"] = {"name": cfg.benchmark.name, "task": cfg.benchmark.tasks[0]}
    fingerprint = json.loads(json.dumps(fingerprint, default=str))
    if (out_dir / paths.CELL_FILE).exists():  # refuse to mix settings before any work is done
        check_fingerprint(out_dir / paths.CELL_FILE, fingerprint)
    store = RecordStore(out_dir / paths.RECORDS)

    added = []

    def append(rec: dict) -> None:  # the fingerprint is written with the first record
        check_fingerprint(out_dir / paths.CELL_FILE, fingerprint)
        store.append(rec)
        added.append(rec)

    length = int(ocfg.context_length)
    t_start = time.perf_counter()
    if ocfg.synthetic:
        device = resolve_device(cfg.device)
        task = "synthetic"
        for index in range(int(ocfg.prompts)):
            key = {"task": task, "context_length": length, "index": index}
            if store.done((task, length, index)):
                continue
            t0 = time.perf_counter()
            data = _synthetic_inputs(ocfg, index, device)
            probe_layers = {0: analyse(*head_view(data.q, data.k, settings.heads), None, settings)}
            append(prompt_record(probe_layers, key, time.perf_counter() - t0))
            print(f"observations/synthetic: prompt {index} in {time.perf_counter() - t0:.1f} s")
        keys = [(task, length, i) for i in range(int(ocfg.prompts))]
    else:
        if length > cfg.model.max_context:
            raise UserError(
                f"observations.context_length {length} exceeds model.max_context="
                f"{cfg.model.max_context} of {cfg.model.name}"
            )
        from rbs_bench.models.hf_attention import attention_modules, install, uninstall

        cell = cfg.copy()
        OmegaConf.update(cell, "benchmark.num_samples", int(ocfg.prompts), force_add=True)
        session = Session()
        loaded = session.load(cell)
        task = cell.benchmark.tasks[0]
        samples = session.samples(cell, loaded, task, length)[: int(ocfg.prompts)]
        layer_ids = [m.layer_idx for m in attention_modules(loaded.model)]
        missing = sorted(set(settings.layers or []) - set(layer_ids))
        if missing:
            raise UserError(f"observations.layers {missing} not in the model (layers {layer_ids})")
        probe = ObservationProbe(settings, layer_ids)
        install(loaded.model, probe, "reference" if loaded.device.type != "cuda" else "auto")
        try:
            for s in samples:
                if store.done((task, length, s.index)):
                    continue
                t0 = time.perf_counter()
                probe.begin_prompt()
                with torch.inference_mode():
                    ids = input_ids(loaded, s).to(loaded.device)
                    loaded.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                key = {"task": task, "context_length": length, "index": s.index}
                rec = prompt_record(probe.results, key, time.perf_counter() - t0)
                rec["input_tokens"] = int(ids.shape[1])
                append(rec)
                print(f"observations/{source}: prompt {s.index} in {rec['seconds']:.1f} s")
        finally:
            uninstall(loaded.model)
        keys = [(task, length, s.index) for s in samples]
    records = [store.done(k) for k in keys]
    if not records:
        raise UserError("observations: no prompts to analyse; raise observations.prompts")
    first = records[0]
    meta = {
        "source": source,
        "experiment": experiment,
        "context_length": length,
        "layers": first["layers"],
        "heads": first["heads"],
        "block_size": settings.block_size,
        "top_fraction": settings.top_fraction,
        "methods": settings.methods,
        "knob_points": int(ocfg.knob_points),
        "capture_seconds": round(sum(r["seconds"] for r in records), 2),
    }
    done = out_dir / "observations.json"
    if added or not done.exists() or json.loads(done.read_text()).get("prompts") != len(records):
        write_outputs(out_dir, records, meta)
    else:
        print("observations: every prompt already recorded; outputs are current")
    print(f"observations: {out_dir / 'observations.png'} ({time.perf_counter() - t_start:.1f} s)")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """Redraw the figure of each observations run directory from its CSVs (`make figures`)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument(
        "run_dirs",
        nargs="*",
        type=Path,
        help="results/runs/observations/<model> (default: every one under results/runs)",
    )
    args = ap.parse_args(argv)
    dirs = args.run_dirs or [
        d for d in paths.experiment_dirs("results") if (d / "observations.json").exists()
    ]
    if not dirs:
        print("no observations runs under results/runs", file=sys.stderr)
        return 1
    for d in dirs:
        print(redraw(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
