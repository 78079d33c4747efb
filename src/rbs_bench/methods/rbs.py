"""RBS-Attention and its two single-branch variants (docs/design.md §4).

    rbs       base branch (q . c_b) and rescue branch (q . c_b + ||q|| r_b beta_b), thresholds
              alpha_base / alpha_rescue, union with the forced blocks
    centroid  base branch only, threshold alpha
    full_l2   rescue branch with beta = 1 (the full L2 upper bound), threshold alpha

Scores are query-block log-sum-exps of the scaled token logits; a branch keeps candidate b < i
when L[i, b] >= log(alpha) + max_b' L[i, b']. Every variant shares this file's code path.

Knobs and their ranges. A relative threshold is a fraction of the row's top score: at alpha = 1 a
branch keeps only its top block, and past 1 the rule keeps nothing at all, a regime the paper never
uses. Calibration therefore searches alpha in (0, 1] for centroid and full_l2, and rbs's scale s
maps to (min(0.22 s, 1), min(0.18 s, 1)): each branch stops at its top block instead of dropping
it. Without that clamp, at s = 1/0.22 every row's top base block would leave at once, and the
density would jump across every target inside that step. An alpha above 1 set directly is still
taken literally (that branch keeps nothing).

Field `impl` picks the code: "torch" the PyTorch reference path; "triton" the fused kernels
(`block_stats`, `rescue_beta`, `rbs_select`) on CUDA, or on CPU under TRITON_INTERPRET=1; "auto"
(the default) means "triton" on CUDA when Triton is installed, else "torch". Both give the same
selection up to blocks whose score sits within rounding error of a threshold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rbs_bench.kernels.block_scores import block_scores_ref
from rbs_bench.kernels.block_stats import block_stats, block_stats_ref, rescue_beta, rescue_beta_ref
from rbs_bench.kernels.rbs_select import rbs_select
from rbs_bench.kernels.triton_util import triton_available
from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import (
    BlockSelection,
    BlockSelector,
    candidate_mask,
    causal_block_mask,
    check_impl,
    forced_mask,
    num_blocks,
    relative_threshold,
    use_triton,
)

ALPHA_BASE = 0.22
ALPHA_RESCUE = 0.18
# The paper's selector tables (comparison, task-group breakdown) and block-size table.
SELECTOR_TABLES = ("tab:selector_ablation", "tab:selector_breakdown")
BLOCK_TABLE = "tab:block_sensitivity"


def _check_alpha(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class _Family(BlockSelector):
    """The key-block statistics the three variants read (the centroid and `rescue_parts` more),
    and their exact density curve."""

    # density_curve is exact at every knob value: the knob search reads it on a fine grid
    # (rbs_bench.budget.FINE_GRID) instead of selecting once per value of a short one
    exact_curve = True

    def density_curve(self, q: Tensor, k: Tensor, scale, values) -> np.ndarray:
        """Density [V] at each knob value in `values`, exact, from one scoring (what `select` at
        that value measures, up to rounding at a threshold).

        q [B, Hq, N, D], k [B, Hkv, N, D]. A candidate pair (i, b) is kept at threshold alpha iff
        log(alpha) <= L[i, b] - max_b' L[i, b']; for rbs at scale s iff log(s) is at most the
        larger of the two branches' gaps less log(0.22) and log(0.18). A branch's top block (gap
        0) and the forced pairs are kept at every knob value of the range. Each variant names
        its branches in `_curve_branches(radius)`: per branch, the score's uplift (None: the
        centroid alone) and the log of its threshold at knob value 1.
        """
        bs, n, dev = self.block_size, q.shape[2], q.device
        centroid, radius = block_stats_ref(k, bs)
        uplifts, offsets = self._curve_branches(radius)
        scores = block_scores_ref(q, centroid, uplifts, bs, scale)  # each fp32 [B, Hq, M, M]
        m = num_blocks(n, bs)
        cand = candidate_mask(m, dev)
        causal = causal_block_mask(n, bs, bs, dev)
        forced = forced_mask(m, self.sink_blocks, self.window_blocks, self.last_q_blocks, dev)
        forced = forced & causal
        free = cand & ~forced
        crit = None
        for s, offset in zip(scores, offsets):
            masked = s.masked_fill(~cand, -math.inf)
            gap = masked - masked.amax(-1, keepdim=True)
            # a branch's top block is kept over the whole knob range (alpha is at most 1)
            gap = torch.where(gap == 0, math.inf, gap - offset)
            crit = gap if crit is None else torch.maximum(crit, gap)
        heads = q.shape[0] * q.shape[1]
        critical = crit[..., free].reshape(-1).sort().values  # [heads * free pairs]
        log_v = torch.log(torch.as_tensor(values, dtype=torch.float64, device=dev))
        kept = critical.numel() - torch.searchsorted(critical, log_v.to(critical.dtype))
        total = heads * int(causal.sum())
        return ((heads * int(forced.sum()) + kept).double() / total).cpu().numpy()

    def block_statistics(self, k: Tensor) -> list[tuple[str, Tensor]]:
        """The per-key-block summaries this rule reads from keys k [B, Hkv, N, D], built as
        `select` builds them on k's device: the centroid, and for the rescue rules the radius
        (and rbs's beta)."""
        fast = k.is_cuda and triton_available() and self.impl != "torch"
        centroid, radius = (block_stats if fast else block_stats_ref)(k, self.block_size)
        parts = [("centroid", centroid)]
        if self.rescue_parts:
            parts.append(("radius", radius))
        if self.rescue_parts > 1:
            parts.append(("beta", (rescue_beta if fast else rescue_beta_ref)(radius)))
        return parts


def _select_triton(sel: _Family, q, k, scale, alphas, branches: str, beta: bool):
    """The fused path: key-block stats, then scoring, thresholds, forced blocks and compaction.

    The rescue uplift is r * beta (rbs) or r (full_l2, beta = 1); the base branch needs none.
    """
    centroid, radius = block_stats(k, sel.block_size)
    uplift = radius * rescue_beta(radius) if beta else radius
    count, indices = rbs_select(
        q,
        centroid,
        uplift,
        sel.block_size,
        *alphas,
        sel.sink_blocks,
        sel.window_blocks,
        sel.last_q_blocks,
        scale,
        branches,
    )
    return BlockSelection(count, indices, sel.block_size, sel.block_size, q.shape[2])


@dataclass(frozen=True)
class RBS(_Family):
    """Dual-branch radius-bounded selection. Knob: one scale s on the pair (0.22 s, 0.18 s)."""

    alpha_base: float = ALPHA_BASE
    alpha_rescue: float = ALPHA_RESCUE
    impl: str = "auto"

    name = "rbs"
    knob = "alpha_scale"
    knob_direction = -1  # a larger scale raises both thresholds: fewer blocks
    knob_range = (1e-4, 1.0 / ALPHA_RESCUE)  # from there on both branches keep their top block
    rescue_parts = 2  # block_statistics: radius and beta
    info = MethodInfo(
        display="RBS-Attention",
        order=8,
        paper_rows={
            **dict.fromkeys(SELECTOR_TABLES, "RBS adaptive union"),
            BLOCK_TABLE: "RBS union",
        },
        threshold_field="alpha_base",  # the calibrated scale shown as the base threshold
        sweep=("log", 1e-7 / ALPHA_RESCUE, 1.0 / ALPHA_RESCUE),  # s: the pair's alphas x s
        style=("#d62728", "o"),
        headline=True,
        throughput=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_alpha("alpha_base", self.alpha_base)
        _check_alpha("alpha_rescue", self.alpha_rescue)
        check_impl(self.impl)

    def with_knob(self, value: float) -> RBS:
        _check_alpha(self.knob, value)
        return dataclasses.replace(
            self,
            alpha_base=min(ALPHA_BASE * value, 1.0),
            alpha_rescue=min(ALPHA_RESCUE * value, 1.0),
        )

    def _curve_branches(self, radius: Tensor) -> tuple[list, list[float]]:
        uplifts = [None, radius * rescue_beta_ref(radius)]
        return uplifts, [math.log(ALPHA_BASE), math.log(ALPHA_RESCUE)]

    @property
    def alpha_scale(self) -> float:
        """The scale s this pair is at (the larger of the two ratios; both for the default pair)."""
        return max(self.alpha_base / ALPHA_BASE, self.alpha_rescue / ALPHA_RESCUE)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        self._check(q, k)
        if use_triton(self.impl, q.device):
            alphas = (self.alpha_base, self.alpha_rescue)
            return _select_triton(self, q, k, scale, alphas, "both", beta=True)
        centroid, radius = block_stats_ref(k, self.block_size)
        uplift = radius * rescue_beta_ref(radius)
        base, rescue = block_scores_ref(q, centroid, [None, uplift], self.block_size, scale)
        cand = candidate_mask(num_blocks(q.shape[2], self.block_size), q.device)
        keep = relative_threshold(base, cand, self.alpha_base)
        keep |= relative_threshold(rescue, cand, self.alpha_rescue)
        return self._finish(keep, q.shape[2])


@dataclass(frozen=True)
class _SingleBranch(_Family):
    alpha: float = ALPHA_BASE
    impl: str = "auto"

    knob = "alpha"
    knob_direction = -1  # a larger alpha keeps fewer blocks
    knob_range = (1e-4, 1.0)  # at 1 the branch keeps only its top block

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_alpha("alpha", self.alpha)
        check_impl(self.impl)

    full_bound = False  # score with the full radius (beta = 1) instead of the centroid alone

    @property
    def rescue_parts(self) -> int:
        return int(self.full_bound)

    def _curve_branches(self, radius: Tensor) -> tuple[list, list[float]]:
        return [radius if self.full_bound else None], [0.0]

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        self._check(q, k)
        if use_triton(self.impl, q.device):
            branch = "rescue" if self.full_bound else "base"
            alphas = (self.alpha, self.alpha)  # rbs_select reads the one of the branch it runs
            return _select_triton(self, q, k, scale, alphas, branch, beta=False)
        centroid, radius = block_stats_ref(k, self.block_size)
        uplift = radius if self.full_bound else None
        (scores,) = block_scores_ref(q, centroid, [uplift], self.block_size, scale)
        cand = candidate_mask(num_blocks(q.shape[2], self.block_size), q.device)
        return self._finish(relative_threshold(scores, cand, self.alpha), q.shape[2])


@dataclass(frozen=True)
class Centroid(_SingleBranch):
    """Base branch only: mean-key (centroid) scoring, as FlashPrefill scores blocks."""

    alpha: float = ALPHA_BASE
    name = "centroid"
    info = MethodInfo(
        display="Centroid-only",
        order=6,
        paper_rows=dict.fromkeys((*SELECTOR_TABLES, BLOCK_TABLE), "Centroid-only"),
        sweep=("log", 1e-7, 1.0),
        style=("#1f77b4", "s"),
    )


@dataclass(frozen=True)
class FullL2(_SingleBranch):
    """Rescue branch with beta = 1: the full L2 bound q . c_b + ||q|| r_b as the only score."""

    alpha: float = ALPHA_RESCUE
    name = "full_l2"
    full_bound = True
    info = MethodInfo(
        display="Full-L2",
        order=7,
        paper_rows=dict.fromkeys(SELECTOR_TABLES, "Full-L2 bound"),
        sweep=("log", 1e-7, 1.0),
        style=("#9467bd", "D"),
    )


def main() -> None:
    """Print the selection of each variant on a structured random prompt."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 2048, 64), torch.randn(1, 2, 2048, 64)
    k[:, :, 640:768] *= 4.0  # one dispersed key block
    for sel in (RBS(), Centroid(), FullL2()):
        s = sel.select(q, k)
        print(
            f"{sel.name:9s} density {s.density():.4f}  kept per query block (head 0):",
            s.kv_count[0, 0].tolist(),
        )


if __name__ == "__main__":
    main()
