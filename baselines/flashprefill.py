"""FlashPrefill (Fan et al., 2026), v1 selection: full-query x mean-key tile mass, max-relative.

The rule (docs/baselines.md §2.1), per query head h, query block i and key block j:

    kbar_j  = mean of the keys of block j (the query side is NOT pooled)
    S[i, j] = sum over the rows r of block i of exp(q_r . kbar_j * scale - M_i)   (one shared max)
    keep j  iff  S[i, j] >= alpha * max_j' S[i, j']
            or j is one of the first 2 (sink) blocks, or one of the 4 blocks ending at the diagonal,
            or i is one of the last 2 query blocks (those rows are dense)

log S[i, j] + M_i is the log-sum-exp over the block's rows of the scaled centroid logits, i.e. the
base score L[i, j] of RBS (docs/design.md §4.3), and the threshold compares the same quantity.
So this is the `centroid` rule: the class reuses `Centroid` and differs only in its defaults
(alpha 0.12, the value the paper's Qwen3-MoE runs use). Knob: alpha; a larger alpha keeps fewer
blocks. It inherits `Centroid`'s `impl` field too: the PyTorch reference, or the fused Triton
kernels on CUDA.

Where we deliberately differ from upstream (qhfan/FlashPrefill v1, snapshot 74e42f3d4f):
- The row max runs over the candidates b < i only (docs/design.md §4.4). Upstream also scores
  the diagonal tile, from the rows that see its last key (just the block's last row), and lets it
  enter the max. That tile can only raise the threshold, and only when one row outweighs every
  full tile; the diagonal itself is kept by the window in both.
- alpha defaults to 0.12, the shipped Qwen3-MoE setting the paper uses, not the class default 0.7
  (Llama configs use 0.18, Qwen2/2.5 0.08).
- No `min_budget` (top-k floor): upstream's default is 0, and the Qwen3 config's `min_budget=4` is
  never read (the layer reads a misspelt `min_buget=0`).
- Scores are fp32 and in natural-log space; upstream computes from bf16 inputs in the log2 domain.
  Blocks whose ratio sits at alpha within rounding can flip.
- `block_size` and the forced-block counts are fields (upstream asserts block = k_stride = 128).
- `scale` is the model's softmax scale when given (upstream always uses 1/sqrt(D)); the two agree
  for standard attention.
Not a difference: selection is per query head, each reading its KV head's means without repeating
K/V, and batch > 1 is supported, as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.rbs import Centroid

ALPHA = 0.12  # FlashPrefill's Qwen3-MoE setting (ruler/models/qwen3.py), used by the paper


@dataclass(frozen=True)
class FlashPrefill(Centroid):
    """FlashPrefill v1: the centroid rule with alpha 0.12, 2 sinks, window 4, last 2 rows dense."""

    alpha: float = ALPHA
    name = "flashprefill"
    info = MethodInfo(
        display="FlashPrefill",
        order=1,
        sweep=("log", 1e-7, 1.0),
        style=("#6baed6", "v"),
        overlay=True,  # the centroid rule: its coverage curve is centroid's
        throughput=True,
    )


def main() -> None:
    """Print one head's selection on a prompt with local attention and one block read from afar."""
    torch.manual_seed(0)
    n, d = 4096, 64
    pos = torch.arange(n)[:, None] * torch.logspace(-2.5, 0, d // 2)[None, :]
    rope = torch.cat([pos.cos(), pos.sin()], -1)  # q_t . k_s is large when |t - s| is small
    q = 2.0 * rope + torch.randn(1, 4, n, d)
    k = 2.0 * rope + torch.randn(1, 2, n, d)
    k[:, :, 640:768] += q[:, ::2, 3000:3200].mean(2, keepdim=True)  # block 5, read by late queries
    sel = FlashPrefill()
    s = sel.select(q, k)
    print(f"{sel.name}: {sel.fields()}")
    print(f"density {s.density():.4f}; kept per query block (head 0):", s.kv_count[0, 0].tolist())
    kept = s.kv_indices[0, 0, 24, : s.kv_count[0, 0, 24]].tolist()
    print(f"kept blocks of query block 24 (head 0; block 5 holds the far evidence): {kept}")


if __name__ == "__main__":
    main()
