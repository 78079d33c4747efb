"""The oracle: per query block, the key blocks that hold the most true attention mass.

    mass[i, j]  = the dense causal softmax mass of key block j summed over the queries of block i
                  (kernels/block_mass.py: `block_mass` on CUDA, `block_mass_ref` elsewhere)
    keep        = the ceil(ratio x |C_i|) candidates b < i with the largest mass[i, b] (>= 1 when
                  there is a candidate; ties to the lower block id), then the forced blocks every
                  block selector shares (sink, window ending at the diagonal, last query rows)

It reads the dense attention, so it is no prefill method: it is the upper reference a selector's
kept blocks are judged against at the same density. Knob: ratio, as Quest's (baselines/quest.py),
so calibration reaches any density above the forced floor.

One layer reads the block mass up to three times with the same q and k: the oracle's selection,
its density curve (calibration) and the attention recall (`recall=true`); mass.py keeps the last
result while those q and k live, so one kernel pass serves the three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rbs_bench.kernels.quest_select import MAX_BLOCKS, top_fraction_select
from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.mass import true_block_mass
from rbs_bench.methods.selection import (
    BlockSelection,
    TopRatio,
    candidate_mask,
    causal_block_mask,
    forced_mask,
    use_triton,
)


@dataclass(frozen=True)
class Oracle(TopRatio):
    """Top `ratio` of each query block's candidates by true attention mass, plus forced blocks."""

    name = "oracle"
    info = MethodInfo(
        display="Oracle",
        order=9,
        sweep=("lin", 0.0, 1.0),
        style=("#2ca02c", "*"),
        reference=True,  # never the best of a row in the tables
        compare=False,  # reads the dense attention: not in the speed or observation studies
    )

    def _triton(self, q: Tensor) -> bool:
        """Whether this selector's block mass comes from the Triton kernel."""
        return use_triton(self.impl, q.device)

    def density_curve(self, q: Tensor, k: Tensor, scale, values) -> np.ndarray:
        """Density [V] at each ratio in `values`, exact, from one block-mass pass (what `select`
        at each ratio would measure): a row keeps its forced blocks and its first
        min(c, max(1, ceil(ratio c))) candidates in descending mass."""
        bs, n = self.block_size, q.shape[2]
        mass = true_block_mass(q, k, bs, scale, self._triton(q))  # [B, H, M, M]: select's own
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
        fast = self._triton(q)
        mass = true_block_mass(q, k, bs, scale, fast)
        if fast and -(-n // bs) <= MAX_BLOCKS:
            forced = (self.sink_blocks, self.window_blocks, self.last_q_blocks)
            count, index = top_fraction_select(mass, self.ratio, *forced)
            return BlockSelection(count, index, bs, bs, n)
        return self._keep_top(mass, n)
