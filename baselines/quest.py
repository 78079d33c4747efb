"""Quest-style prefill selection: per-block min/max key box bound, top fraction of the candidates.

Quest (Tang et al., ICML'24) is decode-only; this is the prefill adaptation of
docs/baselines.md §6.2 (our construction, not public code). Per KV head and key block j keep
the elementwise extremes of the block's real keys, `kmin_j` and `kmax_j` (D floats each). Then:

    bound(t, j) = q_t+ . kmax_j + q_t- . kmin_j     (q+ = max(q, 0), q- = min(q, 0))
                = max of q_t . k over the box [kmin_j, kmax_j], so >= q_t . k for every key of j
    score[i, j] = max over the real tokens t of query block i of bound(t, j)
    keep the ceil(ratio * |C_i|) highest-scoring candidates (at least 1) of C_i = {j < i},
    ties broken toward the lower block id, plus RBS's forced blocks (2 sinks, a window of 4
    blocks ending at the diagonal, the last 2 query blocks dense)

Selection is per query head, each with its KV head's boxes (Quest's own evaluation repeats K/V, so
it is per query head too). Knob: ratio, the fraction of candidates kept; a larger ratio keeps more
blocks. The default 0.1 is our choice (the paper calibrates it, e.g. 0.0405 for 5.34% density at
128K); calibration moves it to the target density anyway.

Where we deliberately differ from Quest:
- Harness blocks (128 tokens by default, a field) instead of 16-token pages, and one bound per
  (query block, key block) pair: the max of the row-exact token bounds, a valid upper bound on the
  largest logit of the tile (docs/baselines.md §6.2). The looser box-box bound is not used.
- A fraction of the candidates instead of a fixed token budget, so one knob spans every context
  length; the count is ceil(ratio * |C_i|), computed with a 1e-9 tolerance so that 0.1 * 30 gives 3.
- Forced blocks are RBS's (for parity with the other block selectors) instead of Quest's "last page
  always kept"; the top-k counts over every candidate, forced ones included, as RBS's row max does.
- Every layer is sparse (Quest skips the first two layers); the harness applies one selector to all.
- Ties: lower block id first, so the selection is deterministic (no tie order of Quest's own
  top-k is relied on or reproduced).
- `scale` is accepted and unused: a positive scale does not change the ranking.

Field `impl` picks the code, as for the RBS family: "torch" the PyTorch reference (fp32 scores,
a stable sort), "triton" the kernels of kernels/quest_select.py (box scores with two tensor-core
dots and a max per query block, top-k by bisection; Quest's own estimate kernels are CUDA, for
decode), on CUDA or under TRITON_INTERPRET=1; "auto" (the default) means "triton" on CUDA when
Triton is installed, else "torch". Both give the same selection up to near ties at the top-k cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rbs_bench.kernels.quest_select import (
    MAX_BLOCKS,
    box_scores_ref,
    box_stats,
    box_stats_ref,
    quest_select,
    top_fraction,
)
from rbs_bench.kernels.triton_util import triton_available
from torch import Tensor

from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.rbs import SELECTOR_TABLES
from rbs_bench.methods.selection import (
    BlockSelection,
    TopRatio,
    use_triton,
)

__all__ = ["Quest", "box_scores_ref", "box_stats_ref", "top_fraction"]


@dataclass(frozen=True)
class Quest(TopRatio):
    """Quest's box bound per (query block, key block), top `ratio` of the candidates, RBS's forced
    blocks. Knob: ratio (larger keeps more)."""

    name = "quest"
    info = MethodInfo(
        display="Quest-style",
        order=5,
        paper_rows=dict.fromkeys(SELECTOR_TABLES, "Quest-style"),
        sweep=("lin", 0.0, 1.0),
        style=("#8c564b", "^"),
        throughput=True,
    )

    def block_statistics(self, k: Tensor) -> list[tuple[str, Tensor]]:
        """The per-key-block box this rule reads from keys k [B, Hkv, N, D], built as `select`
        builds it on k's device."""
        fast = k.is_cuda and triton_available() and self.impl != "torch"
        kmin, kmax = (box_stats if fast else box_stats_ref)(k, self.block_size)
        return [("min", kmin), ("max", kmax)]

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        self._check(q, k)
        bs, n = self.block_size, q.shape[2]
        if use_triton(self.impl, q.device) and -(-n // bs) <= MAX_BLOCKS:
            forced = (self.sink_blocks, self.window_blocks, self.last_q_blocks)
            count, index = quest_select(q, *box_stats(k, bs), bs, self.ratio, *forced)
            return BlockSelection(count, index, bs, bs, n)
        kmin, kmax = box_stats_ref(k, self.block_size)
        return self._keep_top(box_scores_ref(q, kmin, kmax, self.block_size), n)


def main() -> None:
    """Print one head's selection on a prompt with local attention and one needle key."""
    torch.manual_seed(0)
    n, d = 4096, 64
    pos = torch.arange(n)[:, None] * torch.logspace(-2.5, 0, d // 2)[None, :]
    rope = torch.cat([pos.cos(), pos.sin()], -1)  # q_t . k_s is large when |t - s| is small
    q = 2.0 * rope + torch.randn(1, 4, n, d)
    k = 2.0 * rope + torch.randn(1, 2, n, d)
    k[:, :, 700] += 0.5 * q[:, ::2, 3000:3200].sum(2)  # block 5 holds one key late queries look for
    sel = Quest()
    s = sel.select(q, k)
    print(f"{sel.name}: {sel.fields()}")
    print(f"density {s.density():.4f}; kept per query block (head 0):", s.kv_count[0, 0].tolist())
    kept = s.kv_indices[0, 0, 24, : s.kv_count[0, 0, 24]].tolist()
    print(f"kept blocks of query block 24 (head 0; the needle is in block 5): {kept}")


if __name__ == "__main__":
    main()
