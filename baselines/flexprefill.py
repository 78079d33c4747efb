"""FlexPrefill (Lai et al., ICLR'25), from docs/baselines.md §4.

Rule, per (batch, query head), block size B, M = ceil(N / B) blocks; budgets are given in tokens
and become ceil(budget / B) blocks. Prompts with N <= max(2B, ceil(min_budget / B) * B) run dense.
  1. Estimate from the last B queries (causal softmax, fp32): vertical[t] = mean over the rows of
     column t, slash[o] = mean over the rows of the entries at offset o = query - key. Each sums
     to 1.
  2. Budgets: n = the fewest tokens whose largest values sum to >= gamma; n // B + 1 blocks, for
     vertical and slash separately, clamped to [min_budget, max_budget] blocks.
  3. Pool both into blocks (sums over B tokens; slash offsets o into offset blocks o // B).
  4. Query-aware test: est = softmax over key blocks of mean(last queries) . mean-pooled keys;
     d = sqrt(JSD(est, pooled vertical)) (natural log). d < tau makes the head query-aware: its
     vertical and slash budgets drop to min_budget.
  5. Force vertical block 0 and slash block 0 (the diagonal); keep the top n_v vertical blocks
     (every (i, j) with j a kept block) and top n_s slash blocks (every (i, i - s)).
  6. Query-aware heads add the fewest block pairs (i, j <= i) of P = row-softmax(mean-pooled q .
     mean-pooled k) whose sum reaches gamma * M (one coverage over the whole matrix, whose rows
     each sum to 1).
Returns a `BlockSelection` (B x B blocks, nothing above the diagonal). Knob: gamma (larger keeps
more: direction +1); tau only decides which heads are query-aware.

Where we deliberately differ from the public code (ByteDance-Seed/FlexPrefill,
flex_prefill_attention.py::get_active_blocks):
- Block size is used consistently: the token budget becomes n // B + 1 blocks; upstream divides
  by a hard-coded 128, which mis-scales the budget for other block sizes.
- The query-aware coverage keeps the fewest pairs whose sum reaches gamma * M, the same "fewest
  reaching gamma" rule as the budgets; upstream keeps the pairs whose running sum stays <= gamma
  * M, i.e. one pair fewer. (Its token budgets count the prefix with running sum <= gamma, plus
  one; that equals "fewest reaching" except when a running sum hits gamma exactly.)
- The estimate uses the attention's own scale (`scale`, the model's scaling; default
  1/sqrt(d)); upstream's selection always divides by sqrt(head_dim).
- Defaults follow the paper's experiments (gamma 0.9, tau 0.1, min_budget 1024 tokens) with no
  max budget (upstream API default); upstream's API defaults are tau 0 and min_budget one block.
- The first key block and the diagonal are always kept, also for a zero budget (upstream gets the
  same through the zero padding of its index lists).
- Slash offsets are pooled from offset 0 (offset block s = o // B maps to block pairs (i, i - s));
  upstream pools its diagonal sums aligned at the last key, which differs only when B does not
  divide N.
- Mean-pooled queries and keys average the real tokens of a partial last block (upstream rescales
  the queries' last block the same way).
- The JSD treats 0 * log 0 as 0 (upstream would return NaN for an all-zero pooled block).
- GQA without repeating K/V (query head h reads KV head h // group) and batch > 1 are supported;
  upstream asserts batch 1 and loops over query-aware heads in Python.
- Ties are broken by position (stable sorts), so a larger gamma keeps a superset.

Field `impl` picks the code, as for xattn and the RBS family: "torch" the PyTorch reference
(kernels/flexprefill_select.py, `flexprefill_select_ref`; fp64 coverage sums), "triton" its Triton
path (`flexprefill_select`: the last-queries estimate without a [B, H, B, N] probability tensor, a
radix select for the budgets and the pooled coverage instead of sorts, one kernel composing and
compacting the blocks; upstream runs these steps as PyTorch ops, with a Python loop over the
query-aware heads), on CUDA or under TRITON_INTERPRET=1; "auto" (the default) means "triton" on
CUDA when Triton is installed and block_size <= 128, else "torch". Both give the same selection up
to entries whose running sum sits within rounding of a coverage target, blocks whose pooled masses
tie within rounding, and heads whose distance sits within rounding of tau.
`rbs_bench.bench.fast_paths` checks the two paths against each other and times them
(`info.fast_path`), also at tau = 1, where every head is query-aware.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from rbs_bench.kernels.flexprefill_select import (
    FlexPrefillEstimate,
    block_means,
    block_sums,
    flexprefill_estimate,
    flexprefill_estimate_ref,
    flexprefill_select,
    flexprefill_select_ref,
    sqrt_jsd,
    supported,
)
from rbs_bench.kernels.shapes import check_qk
from rbs_bench.kernels.vertical_slash_attn import coverage_count, top_mask
from torch import Tensor

from rbs_bench.methods.info import FastPath, MethodInfo
from rbs_bench.methods.selection import BlockSelection, check_impl, check_inputs, use_triton

__all__ = [
    "FlexPrefill",
    "FlexPrefillEstimate",
    "block_means",
    "block_sums",
    "coverage_count",
    "sqrt_jsd",
    "top_mask",
]


@dataclass(frozen=True)
class FlexPrefill:
    """Per-head vertical-slash or query-aware blocks covering gamma of the estimated attention."""

    gamma: float = 0.9
    tau: float = 0.1
    min_budget: int = 1024
    max_budget: int | None = None
    block_size: int = 128
    impl: str = "auto"

    name = "flexprefill"
    knob = "gamma"
    knob_direction = 1  # a larger coverage keeps more blocks
    knob_range = (0.0, 1.0)  # a fraction: calibration searches it linearly
    is_dense = False
    info = MethodInfo(
        display="FlexPrefill",
        order=3,
        sweep=("tail", 0.0, 1.0 - 1e-4),
        style=("#e377c2", "X"),
        throughput=True,
        # the Triton path's check also runs tau = 1: every head query-aware, the heaviest case
        fast_path=FastPath(also=({"tau": 1.0},)),
    )

    def block_statistics(self, k: Tensor) -> list[tuple[str, Tensor]]:
        """The per-key-block summary its query-aware estimate reads: the mean-pooled keys."""
        return [("mean-pooled key", block_means(k, self.block_size))]

    def __post_init__(self) -> None:
        _check_gamma(self.gamma)
        if (
            isinstance(self.tau, bool)
            or not isinstance(self.tau, (int, float))
            or not (0 <= self.tau < math.inf)
        ):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not _is_int(self.min_budget) or self.min_budget < 0:
            raise ValueError(
                f"min_budget must be an integer >= 0 (tokens), got {self.min_budget!r}"
            )
        if self.max_budget is not None and (
            not _is_int(self.max_budget) or self.max_budget < max(self.min_budget, 1)
        ):
            raise ValueError(
                f"max_budget must be null or an integer >= min_budget ({self.min_budget}) and "
                f">= 1 (tokens), got {self.max_budget!r}"
            )
        check_impl(self.impl)

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def with_knob(self, value: float) -> FlexPrefill:
        _check_gamma(value)
        return dataclasses.replace(self, gamma=value)

    def runs_dense(self, n: int) -> bool:
        """Prompts this short are attended densely (upstream's threshold)."""
        bs = self.block_size
        return n <= max(2 * bs, math.ceil(self.min_budget / bs) * bs)

    def _rule(self) -> tuple:
        return (self.gamma, self.tau, self.min_budget, self.max_budget, self.block_size)

    def estimate(self, q: Tensor, k: Tensor, scale: float | None = None) -> FlexPrefillEstimate:
        """Steps 1-4 of the rule; needs N > block_size (see `runs_dense`)."""
        check_qk(q, k)
        run = flexprefill_estimate if self._fast(q) else flexprefill_estimate_ref
        return run(q, k, *self._rule(), scale)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        """q [B, Hq, N, D], k [B, Hkv, N, D] -> kept key blocks per query head."""
        check_inputs(q, k)
        b, hq, n, d = q.shape
        bs = self.block_size
        if self.runs_dense(n):
            return BlockSelection.full(b, hq, n, bs, q.device)
        if self._fast(q):
            count, index, _ = flexprefill_select(q, k, *self._rule(), scale)
            return BlockSelection(count, index, bs, bs, n)
        keep, _ = flexprefill_select_ref(q, k, *self._rule(), scale)
        return BlockSelection.from_mask(keep, bs, bs, n)

    def _fast(self, q: Tensor) -> bool:
        """The Triton path (see `use_triton`); "auto" keeps the reference where it cannot run."""
        if not use_triton(self.impl, q.device):
            return False
        if supported(self.block_size, q.shape[2], q.shape[-1]):
            return True
        if self.impl == "triton":
            raise ValueError(
                f"impl='triton' needs block_size <= 128 and head dim <= 256; got block_size="
                f"{self.block_size}, head dim {q.shape[-1]}"
            )
        return False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_gamma(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"gamma must be a number in [0, 1], got {value!r}")


def main() -> None:
    """Print each head's decision and density on a prompt with a recency bias, sinks and one
    strong column (heads 0-1), and keys constant over blocks (heads 2-3)."""
    n, d, bs = 16384, 64, 128
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, n, d, generator=gen), torch.randn(1, 2, n, d, generator=gen)
    pos = torch.arange(n, dtype=torch.float32) * (math.pi / n)
    rot = torch.stack([pos.cos(), pos.sin()], -1) * 6.0  # q_p . k_t = 36 cos(pi (p - t) / n)
    q[..., :2], k[:, 0, :, :2] = rot, rot
    q[..., 2:4], k[:, 0, :, 2:4] = 3.0, 0.0
    k[0, 0, :4, 2], k[0, 0, n // 3, 3] = 6.0, 30.0  # sinks, one strong column
    k[0, 1] = torch.randn(n // bs, d, generator=gen).repeat_interleave(bs, 0)
    sel = FlexPrefill()
    est, s = sel.estimate(q, k), sel.select(q, k)
    print(f"N={n} block {bs} gamma {sel.gamma} tau {sel.tau}: density {s.density():.3f}")
    for h in range(q.shape[1]):
        kind = "query-aware" if est.query_aware[0, h] else "vertical-slash"
        print(
            f"  head {h}: sqrt-JSD {est.distance[0, h]:.3f} -> {kind}, budgets v/s "
            f"{int(est.n_vertical[0, h])}/{int(est.n_slash[0, h])} blocks, "
            f"density {float(s.head_density()[0, h]):.3f}"
        )


if __name__ == "__main__":
    main()
