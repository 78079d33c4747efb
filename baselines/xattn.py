"""XAttention (Xu et al., ICML'25): stride-S antidiagonal scoring, cumulative-mass threshold tau.

The rule, as the public code runs it (docs/baselines.md §3.1; `xattn_estimate` with
select_mode "inverse" and `find_blocks_chunked`), per query head, with R = N / S reshaped positions:

    Kr[c] = concat_t k[c S + t]           t = 0..S-1   (S consecutive keys)
    Qr[r] = concat_t q[r S + S - 1 - t]                (S consecutive queries, reversed)
    Qr[r] . Kr[c] = the sum of the S logits on the antidiagonal of the S x S token tile (r, c)
    A[r, c] = softmax over c <= r of  Qr[r] . Kr[c] * scale / S       (causal per reshaped cell)
    mass[i, j] = sum of A over the (B/S x B/S) cells of block pair (i, j)
    per query block i:  required = tau * sum_j mass[i, j]
        keep block 0 and the diagonal i, counting their mass first; then the other blocks
        j in 1..i-1 in descending mass, each kept while the mass kept *before* it is < required
        (so the block that crosses tau is kept, and tau = 0 keeps only block 0 and the diagonal)

Knob: tau; a larger tau keeps more blocks. Stride S (16 by default, the paper's primary setting;
8 allowed) must divide the block size (128 by default). GQA: query head h reads KV head
h // (Hq / Hkv) without repeating K; batch > 1 runs each sequence independently.

Quirks of the code that we keep on purpose (the ranking of blocks depends on them):
- The logits are divided by S as well as by sqrt(D): each antidiagonal sum becomes a mean of S
  token logits (`norm`, a further divisor, is 1 by default and not a field here).
- Causality is applied per reshaped cell, not per token: the diagonal cell (r = c) is scored in
  full, so half of its antidiagonal pairs have the key after the query.
- A reshaped row or column that holds some real tokens is scored with zeros for the padded ones
  (the divisor stays S); rows without a real token add nothing, so the row total of the last,
  partial query block is its number of real reshaped rows.
- tau is relative to the whole row mass, forced blocks included; every row of A sums to 1, so a
  row total is B/S, not 1.

Where we deliberately differ from upstream (mit-han-lab/x-attention, snapshot e37988770b):
- Upstream asserts batch 1 and num_q_heads == num_kv_heads (callers repeat K/V); we select per
  query head from the KV head directly, for any batch. Same result as repeating K/V.
- Upstream rounds the reshaped logits and the block masses to the input dtype (bf16) before the
  cumulative selection; we keep them in fp32 and run the selection in fp64.
- Ties between equal masses go to the lower block id (upstream's unstable sort leaves them open).
- One scalar tau. The paper's RULER runs use per-(layer, head) profiled tau tables; calibration here
  moves a single tau to the target density. tau is limited to [0, 1] (tau = 1 keeps every block
  whose mass is above rounding).
- Stride 4 (also in upstream's RULER script) is not offered; S in {8, 16} as the harness specifies.
- `scale` is the model's softmax scale when given (upstream always uses 1/sqrt(D)).
- No keep_sink / keep_recent options (both off by default upstream), no chunked-prefill offset
  (q_len == k_len), and the query chunk size only bounds memory: it never changes the result.
- The first chunk of query rows follows the rule above (docs/baselines.md §3.3). Upstream's
  `find_blocks_chunked` (xattn/src/utils.py) marks block 0 and then writes the chunk's diagonal
  over the columns the chunk spans; in the first chunk (it starts at block 0) that unmarks block 0
  for every row but the first. Such a row has one forced block instead of two, while the running
  sum still reserves two leading slots, so it lags by one block: the candidate ranked k-th is
  decided on the diagonal plus the candidates ranked at least two places above it (the top one
  on nothing). Block 0 is ranked by its mass instead of counted first (it is still kept: every
  unkept slot points at block 0). The net effect is extra blocks in those rows: about 300 at 128K
  (32 heads, tau 0.9), all in the first 16 query blocks, the first chunk there. Later chunks start
  past block 0 and run the intended rule. `upstream_first_chunk=True` reproduces the first chunk
  as upstream runs it, with upstream's automatic chunk size (`Xattention_prefill`,
  chunk_size=None): max(2048, min(P, 2^28 / P)) tokens, P the next power of two >= N, so the
  whole prompt is the first chunk up to 16K tokens (and 2048 tokens, 16 blocks, at 128K). It runs
  on the PyTorch path. Off by default: the default is the rule as stated, and its records and
  calibrations do not list the field.
The paper's text was not re-checked against this; where the code is explicit, we follow the code.

Field `impl` picks the code, as for the RBS family: "torch" the PyTorch reference below (fp32 mass,
fp64 rule), "triton" the fused kernels of kernels/xattn_select.py (the reshaped GEMM, the softmax
and the block sums in one pass, the rule by bisection; upstream has Triton kernels for the same
steps), on CUDA or under TRITON_INTERPRET=1; "auto" (the default) means "triton" on CUDA when
Triton is installed and block_size / stride is a power of two <= 128, else "torch"; with
`upstream_first_chunk` on, always "torch" (the Triton kernels apply the intended rule in every row).
Both give the same selection up to blocks whose cumulative mass sits within rounding of tau.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rbs_bench.kernels.xattn_select import (
    antidiagonal_mass_ref,
    cumulative_keep,
    supported,
    xattn_select,
)
from torch import Tensor

from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import BlockSelection, check_impl, check_inputs, use_triton

__all__ = [
    "STRIDES",
    "TAU",
    "XAttention",
    "antidiagonal_mass_ref",
    "cumulative_keep",
    "upstream_chunk_tokens",
    "upstream_first_chunk_keep",
]

TAU = 0.9  # xattn_estimate's and MInference's default; near the S=16 profiled table's mean 0.91
STRIDES = (8, 16)


def _check_stride(stride, block_size) -> None:
    if not isinstance(stride, int) or isinstance(stride, bool) or stride not in STRIDES:
        raise ValueError(f"stride must be one of {STRIDES}, got {stride!r}")
    if block_size % stride:
        raise ValueError(f"block_size ({block_size}) must be a multiple of stride ({stride})")


def upstream_chunk_tokens(n: int) -> int:
    """Query rows per chunk that upstream's `Xattention_prefill` picks for an n-token prompt
    (chunk_size=None): P = the next power of two >= n, then min(P, 2^28 / P), at least 2048."""
    p = 1 << max(n - 1, 0).bit_length()
    return max(2048, min(p, (1 << 28) // p))


def upstream_first_chunk_keep(mass: Tensor, tau: float, rows: int) -> Tensor:
    """bool [..., rows, M]: upstream's selection of the first `rows` query blocks (rows <= M).

    Row i >= 1 has only the diagonal forced; the candidates j < i (block 0 among them) are ranked
    by descending mass (ties: lower id first), and the candidate of rank k is kept while
    (diagonal mass if k >= 1) + (mass of ranks 0 .. k-2) < tau * (row total): the running sum lags
    by one block. Block 0 and the diagonal are kept whatever their rank. Row 0 keeps block 0.
    """
    m = mass.shape[-1]
    i = torch.arange(rows, device=mass.device)[:, None]
    j = torch.arange(m, device=mass.device)[None, :]
    v = mass[..., :rows, :].double().masked_fill(j > i, 0.0)
    required = tau * v.sum(-1, keepdim=True)
    diagonal = v.masked_fill(j != i, 0.0).sum(-1, keepdim=True)
    ranked, order = v.masked_fill(j >= i, -1.0).sort(dim=-1, descending=True, stable=True)
    gain = ranked.clamp_min(0.0)
    lagged = F.pad(gain.cumsum(-1)[..., :-2], (2, 0))[..., :m]  # rank k: ranks 0 .. k-2
    before = lagged + diagonal * (torch.arange(m, device=mass.device) >= 1)
    keep_ranked = (before < required) & (ranked >= 0)  # non-candidates were ranked at -1
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    return keep | (((j == 0) | (j == i)) & (j <= i))


@dataclass(frozen=True)
class XAttention:
    """Antidiagonal block mass, cumulative threshold tau per query block, block 0 and diagonal kept.
    Knob: tau (larger keeps more)."""

    tau: float = TAU
    stride: int = 16
    block_size: int = 128
    impl: str = "auto"
    upstream_first_chunk: bool = False  # upstream's extra blocks in the first chunk (see above)

    name = "xattn"
    knob = "tau"
    knob_direction = 1  # a larger tau keeps more blocks
    knob_range = (0.0, 1.0)  # a fraction: calibration searches it linearly
    is_dense = False
    info = MethodInfo(
        display="XAttn",
        order=2,
        sweep=("tail", 0.0, 1.0 - 1e-4),
        style=("#ff7f0e", "P"),
        throughput=True,
    )

    def __post_init__(self) -> None:
        t = self.tau
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t <= 1):
            raise ValueError(f"tau must be a number in [0, 1], got {t!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        _check_stride(self.stride, self.block_size)
        check_impl(self.impl)
        if not isinstance(self.upstream_first_chunk, bool):
            raise ValueError(
                f"upstream_first_chunk must be true or false, got {self.upstream_first_chunk!r}"
            )
        if self.upstream_first_chunk and self.impl == "triton":
            raise ValueError(
                "upstream_first_chunk runs on the PyTorch path only; use impl='auto' or 'torch'"
            )

    def fields(self) -> dict:
        out = dataclasses.asdict(self)
        if not self.upstream_first_chunk:  # the default's records and calibrations predate it
            del out["upstream_first_chunk"]
        return out

    def with_knob(self, value: float) -> XAttention:
        return dataclasses.replace(self, tau=value)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection:
        check_inputs(q, k)
        bs, n = self.block_size, q.shape[2]
        if self._fast(q.device, n):
            count, index = xattn_select(q, k, bs, self.stride, self.tau, scale)
            return BlockSelection(count, index, bs, bs, n)
        mass = antidiagonal_mass_ref(q, k, bs, self.stride, scale)
        keep = cumulative_keep(mass, self.tau)
        if self.upstream_first_chunk:
            rows = min(upstream_chunk_tokens(n) // bs, keep.shape[-2])
            keep[..., :rows, :] = upstream_first_chunk_keep(mass, self.tau, rows)
        return BlockSelection.from_mask(keep, bs, bs, n)

    def _fast(self, device: torch.device, n: int) -> bool:
        """The Triton path (see `use_triton`); "auto" keeps the reference where it cannot run."""
        if self.upstream_first_chunk or not use_triton(self.impl, device):
            return False
        if supported(self.block_size, self.stride, n):
            return True
        if self.impl == "triton":
            raise ValueError(
                f"impl='triton' needs block_size / stride a power of two <= 128; got "
                f"{self.block_size} / {self.stride}"
            )
        return False


def main() -> None:
    """Print the selection of one head on a prompt with a local (slash) and a vertical pattern."""
    torch.manual_seed(0)
    n, d = 2048, 64
    pos = torch.arange(n)[:, None] * torch.logspace(-3, 0, d // 2)[None, :]
    rope = torch.cat([pos.cos(), pos.sin()], -1)  # nearby tokens align: a slash pattern
    q = 2.0 * rope + torch.randn(1, 4, n, d)
    k = 2.0 * rope + torch.randn(1, 2, n, d)
    k[:, :, 300:310] += 3.0 * q[:, ::2, 1800:1810].mean(2, keepdim=True)  # a vertical stripe
    sel = XAttention()
    s = sel.select(q, k)
    print(f"{sel.name}: {sel.fields()}")
    print(f"density {s.density():.4f}; kept per query block (head 0):", s.kv_count[0, 0].tolist())
    kept = s.kv_indices[0, 0, 14, : s.kv_count[0, 0, 14]].tolist()
    print(f"kept blocks of query block 14 (head 0; the stripe is in block 2): {kept}")


if __name__ == "__main__":
    main()
