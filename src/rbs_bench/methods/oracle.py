"""The oracle: per query block, the key blocks that hold the most true attention mass.

    mass[i, j]  = the dense causal softmax mass of key block j summed over the queries of block i
                  (kernels/block_mass.py: `block_mass` on CUDA, `block_mass_ref` elsewhere)
    keep        = the ceil(ratio x |C_i|) candidates b < i with the largest mass[i, b] (>= 1 when
                  there is a candidate; ties to the lower block id), then the forced blocks every
                  block selector shares (sink, window ending at the diagonal, last query rows)

It reads the dense attention, so it is no prefill method: it is the upper reference a selector's
kept blocks are judged against at the same density. Knob: ratio, as Quest's (baselines/quest.py),
so calibration reaches any density above the forced floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rbs_bench.kernels.block_mass import block_mass, block_mass_ref
from rbs_bench.kernels.quest_select import MAX_BLOCKS, top_fraction, top_fraction_select
from rbs_bench.kernels.triton_util import triton_available
from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import (
    BlockSelection,
    BlockSelector,
    candidate_mask,
    causal_block_mask,
    check_impl,
    forced_mask,
    use_triton,
)

RATIO = 0.1


def true_block_mass(q: Tensor, k: Tensor, block_size: int, scale: float | None = None) -> Tensor:
    """fp32 [B, Hq, M, M] dense causal softmax mass per block pair: the Triton kernel on CUDA,
    the chunked PyTorch reference elsewhere."""
    if q.is_cuda and triton_available():
        return block_mass(q, k.to(q.dtype), block_size, scale)
    return block_mass_ref(q, k, block_size, scale)


@dataclass(frozen=True)
class Oracle(BlockSelector):
    """Top `ratio` of each query block's candidates by true attention mass, plus forced blocks."""

    ratio: float = RATIO
    impl: str = "auto"

    name = "oracle"
    knob = "ratio"
    knob_direction = 1  # a larger ratio keeps more blocks
    knob_range = (0.0, 1.0)  # a fraction: calibration searches it linearly
    info = MethodInfo(
        display="Oracle",
        order=9,
        sweep=("lin", 0.0, 1.0),
        style=("#2ca02c", "*"),
        reference=True,  # never the best of a row in the tables
        compare=False,  # reads the dense attention: not in the speed or observation studies
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        r = self.ratio
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 <= r <= 1):
            raise ValueError(f"ratio must be a number in [0, 1], got {r!r}")
        check_impl(self.impl)

    def density_curve(self, q: Tensor, k: Tensor, scale, values) -> np.ndarray:
        """Density [V] at each ratio in `values`, exact, from one block-mass pass (what `select`
        at each ratio would measure): a row keeps its forced blocks and its first
        min(c, max(1, ceil(ratio c))) candidates in descending mass."""
        bs, n = self.block_size, q.shape[2]
        mass = true_block_mass(q, k, bs, scale)  # [B, H, M, M]
        m = mass.shape[-1]
        cand = candidate_mask(m, q.device)
        forced = forced_mask(m, self.sink_blocks, self.window_blocks, self.last_q_blocks, q.device)
        order = mass.masked_fill(~cand, -math.inf).sort(dim=-1, descending=True, stable=True)[1]
        free = (cand & ~forced).expand_as(mass).gather(-1, order)  # ranked: adds a block if kept
        gained = torch.nn.functional.pad(free.long().cumsum(-1), (1, 0))  # [B, H, M, M + 1]
        n_cand = cand.sum(-1)  # [M]
        base = int((forced & causal_block_mask(n, bs, bs, q.device)).sum())
        total = int(causal_block_mask(n, bs, bs).sum())
        out = []
        for r in values:
            count = torch.clamp(torch.ceil(r * n_cand.double() - 1e-9), min=1).long()
            count = torch.minimum(count, n_cand).expand(*mass.shape[:2], m)
            kept = gained.gather(-1, count[..., None]).squeeze(-1).sum(-1)  # [B, H]
            out.append(float(((base + kept).double() / total).mean()))
        return np.asarray(out)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        self._check(q, k)
        bs, n = self.block_size, q.shape[2]
        if use_triton(self.impl, q.device) and -(-n // bs) <= MAX_BLOCKS:
            mass = block_mass(q, k.to(q.dtype), bs, scale)
            forced = (self.sink_blocks, self.window_blocks, self.last_q_blocks)
            count, index = top_fraction_select(mass, self.ratio, *forced)
            return BlockSelection(count, index, bs, bs, n)
        mass = block_mass_ref(q, k, bs, scale)
        cand = candidate_mask(mass.shape[-1], q.device)
        return self._finish(top_fraction(mass, cand, self.ratio), n)


def attention_recall(q: Tensor, k: Tensor, selection, scale: float | None = None) -> Tensor:
    """fp32 [B, Hq]: the share of the dense causal softmax mass, summed over all queries, that
    lies on the pairs `selection` keeps (1 for dense attention).

    A block selection keeps whole block pairs, so its kept mass is the block mass on its mask; a
    selection of another shape (MInference's token pattern) brings its own `kept_mass(q, k,
    scale)`. Every query's softmax sums to 1, so the total is the number of queries N.
    """
    own = getattr(selection, "kept_mass", None)
    if own is not None:
        kept = own(q, k, scale)
    else:
        mass = true_block_mass(q, k, selection.block_q, scale)
        kept = (mass * selection.mask()).sum((-1, -2))
    return kept.float() / q.shape[2]
