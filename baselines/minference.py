"""MInference 1.0 vertical-slash (Jiang et al., NeurIPS'24), from docs/baselines.md §5.

Rule, per (batch, query head), on a prompt of N tokens:
  1. softmax rows of the last L = min(last_q, N) queries against every key (causal, fp32);
  2. vertical[t] = column sum of those rows, slash[d] = sum along diagonal offset d = query - key;
  3. the first `sink_tokens` columns and the `local_diagonals` nearest diagonals are forced;
  4. keep the top nv columns and top ns diagonals, nv = min(N, max(round(vertical_size * ratio),
     sink_tokens)), ns = min(N, max(round(slash_size * ratio), local_diagonals)).
The result is a token-level `VerticalSlashPattern`, executed by its own `attend` (the PyTorch
reference in kernels/vertical_slash_attn.py). Knob: `ratio` (larger keeps more: direction +1).

Where we deliberately differ from the public code (microsoft/MInference, minference_forward.py):
- Sizes are one (vertical_size, slash_size) pair for every head and layer, the default the public
  code uses for heads without a searched entry, (1000, 6096). Upstream looks up per-layer, per-head
  sizes searched offline on one example; the selector API has no layer index, and a searched
  config would tie the baseline to one model. Calibration moves the single `ratio` instead.
- The ratio scales the sizes with round(), not int() (docs/baselines.md §5.3). Upstream
  (`minference_prefill_kernel` in minference/modules/minference_forward.py) truncates:
  int(vertical_size * minference_ratio), likewise for slash_size. The two differ by one column
  or one diagonal where the product's fraction is >= 0.5 (6096 * 0.1 = 609.6: 610 here, 609
  upstream), and where float rounding leaves the product a hair below a whole number (100 * 0.29
  = 28.999999999999996: 29 here, 28 upstream). round() gives the size nearest the stated product,
  free of that float noise; both are monotone in the ratio, and at ratio 1 (upstream applies the
  ratio only when one is configured) they agree. Kept on purpose: this is not a bug on either
  side, and switching would move every committed calibration (results/calibration/*/
  minference.yaml) by up to one column and one diagonal per head.
- The slash floor is `local_diagonals` (100), not 50. Upstream forces 100 diagonals but floors
  the count at 50, so with fewer than 100 requested, top-k picks an arbitrary subset of the tied
  forced diagonals; here every forced column and diagonal is always kept.
- Ties are broken by position (stable sort), so a larger `ratio` keeps a superset: the knob is
  monotone. Upstream's `topk` leaves tie order unspecified.
- The estimate uses the attention's own scale (`scale`, the model's scaling; default
  1/sqrt(d)); upstream divides by sqrt(head_dim).
- GQA without repeating K/V (query head h reads KV head h // group) and batch > 1 are supported;
  upstream repeats K/V and loops over heads with batch 1.
- Execution attends exactly the pattern's keys (each once). Upstream's kernel turns the
  diagonals into 64-key ranges per 64-query block and computes each range with only the causal
  mask, so a query also sees up to 63 neighbouring offsets of every kept diagonal: upstream
  attends a superset of the stated pattern. Our Triton executor (the default on CUDA) walks the
  same kind of ranges (diagonals closer than 64 merged into one range per 64-query block, then
  the kept columns gathered, one online softmax over both), but masks each range down to the
  kept diagonals and skips a gathered column where the query already reaches it through a kept
  diagonal, so no key counts twice (upstream drops the columns that fall inside a range). The
  other executors: compiled FlexAttention over the touched 128-blocks with a token-exact
  mask_mod, and a PyTorch reference. We keep the stated pattern (the method's definition) and say
  so in the tables. A pattern that keeps all N diagonals (any prompt up to slash_size tokens at
  ratio 1) is causal attention and runs as dense SDPA.
- Field `impl` picks the selector's code: "torch" the PyTorch estimate (it builds the last
  queries' [L, N] probabilities per KV group) and sorts, "triton" the estimate kernels and a radix
  top-k (kernels/vertical_slash_attn.py: no [L, N] tensor, no sort), on CUDA or under
  TRITON_INTERPRET=1; "auto" (the default) means "triton" on CUDA when Triton is installed and
  last_q <= 128, else "torch". The lines agree up to estimates within rounding of each other.
  `rbs_bench.bench.fast_paths` compares the two paths' columns and diagonals and times them, and
  times the Triton and Flex executors on the Triton pattern (`info.fast_path`).
- Density: the pattern is not block-level, so density (and head_density) is the fraction of causal
  128x128 block pairs the pattern touches, a pair counting as touched when any (q, k) in it with
  k <= q lies on a kept column or diagonal. That is the cost a block kernel would pay, and it is
  how the tables report MInference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from rbs_bench.kernels.block_mass import causal_softmax_chunks
from rbs_bench.kernels.pattern_mass import pattern_kept_mass
from rbs_bench.kernels.triton_util import triton_available
from rbs_bench.kernels.vertical_slash_attn import (
    attention_supported,
    check_pattern,
    estimate_supported,
    membership,
    top_k_ids,
    top_k_ids_ref,
    vertical_slash_attention,
    vertical_slash_attention_flex,
    vertical_slash_attention_ref,
    vertical_slash_block_mask,
    vertical_slash_estimate,
    vertical_slash_estimate_ref,
    vertical_slash_token_mask,
)
from torch import Tensor

from rbs_bench.methods.info import FastPath, MethodInfo
from rbs_bench.methods.selection import causal_block_mask, check_impl, check_inputs, use_triton

EXECUTORS = ("reference", "flex", "triton")

DENSITY_BLOCK = 128  # block size the token pattern's density is counted at (docs/design.md §3)


@dataclass(frozen=True)
class VerticalSlashPattern:
    """MInference's token-level pattern, per (batch, query head); what `MInference` returns.

    columns:   int32 [B, H, Nv]  kept key positions, ascending (-1 = padding, for other makers)
    diagonals: int32 [B, H, Ns]  kept offsets d = query - key >= 0, ascending (-1 = padding)
    Query p attends to {c <= p in columns} ∪ {p - d : d <= p in diagonals}.
    Density is the fraction of causal `block_size` x `block_size` block pairs the pattern touches
    (a pair is touched when any (q, k) in it with k <= q lies on a kept column or diagonal).
    """

    columns: Tensor
    diagonals: Tensor
    seq_len: int
    block_size: int = DENSITY_BLOCK

    def __post_init__(self) -> None:
        check_pattern(self.columns, self.diagonals, self.seq_len)
        if self.columns.shape[:2] != self.diagonals.shape[:2]:
            raise ValueError(
                f"columns {tuple(self.columns.shape)} and diagonals "
                f"{tuple(self.diagonals.shape)} disagree on [B, H]"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Mq, Mk) of the block mask."""
        m = math.ceil(self.seq_len / self.block_size)
        return *self.columns.shape[:2], m, m

    @staticmethod
    def kept_masses(q: Tensor, k: Tensor, scale: float | None, patterns: list) -> list[Tensor]:
        """`kept_mass` of several patterns from one dense pass (`pattern_mass`). A selection that
        is no block mask brings this, so that analyses such as rbs_bench.observations measure
        it without knowing the method."""
        return pattern_mass(q, k, scale, patterns)

    def mask(self) -> Tensor:
        """bool [B, H, Mq, Mk]: block pairs the pattern touches; for tests and small inputs."""
        return vertical_slash_block_mask(
            self.columns, self.diagonals, self.seq_len, self.block_size
        )

    def kept_mass(self, q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
        """fp32 [B, H]: the dense causal softmax mass on the pattern, summed over the queries."""
        return pattern_mass(q, k, scale, [self])[0]

    def token_mask(self) -> Tensor:
        """bool [B, H, N, N]: the attended (query, key) pairs; for tests and small inputs."""
        return vertical_slash_token_mask(self.columns, self.diagonals, self.seq_len)

    def causal_pairs(self) -> int:
        """Causally valid block pairs of one (batch, head)."""
        bs = self.block_size
        return int(causal_block_mask(self.seq_len, bs, bs).sum())

    def head_density(self) -> Tensor:
        """float [B, H]: touched / causally valid block pairs of each (batch, head)."""
        return self.mask().sum((-1, -2)).double() / self.causal_pairs()

    def density(self) -> float:
        """Touched / causally valid block pairs over the whole pattern (forced lines included)."""
        return float(self.head_density().mean())

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, executor: str = "auto"
    ) -> Tensor:
        """out [B, Hq, N, D]: attention over exactly the pattern's keys (q [B, Hq, N, D], k/v
        [B, Hkv, N, D]). executor: "reference" (PyTorch, any device), "triton" (the Triton
        kernel: CUDA, or the CPU under TRITON_INTERPRET=1), "flex" (compiled FlexAttention,
        CUDA), "auto" (triton on CUDA, flex where it cannot run; the reference elsewhere)."""
        if q.shape[2] != self.seq_len:
            raise ValueError(
                f"pattern was made for seq_len={self.seq_len} but q has N={q.shape[2]}"
            )
        if executor == "auto":
            executor = "reference"
            if q.device.type == "cuda":
                fits = triton_available() and attention_supported(q.shape[-1], q.dtype)
                executor = "triton" if fits else "flex"
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; choose auto, {', '.join(EXECUTORS)}")
        if self.covers_every_diagonal():  # the exact same set as causal attention
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        run = {
            "reference": vertical_slash_attention_ref,
            "flex": vertical_slash_attention_flex,
            "triton": vertical_slash_attention,
        }[executor]
        return run(q, k, v, self.columns, self.diagonals, scale=scale)

    def covers_every_diagonal(self) -> bool:
        """Every (b, h) keeps all N diagonals (ids are unique and < N), i.e. dense causal."""
        return self.diagonals.shape[-1] == self.seq_len and bool((self.diagonals >= 0).all())


def pattern_difference(got: VerticalSlashPattern, want: VerticalSlashPattern) -> tuple[int, int]:
    """(columns and diagonals kept by one pattern and not the other, those `want` keeps)."""
    n = want.seq_len
    differ = kept = 0
    for g, w in ((got.columns, want.columns), (got.diagonals, want.diagonals)):
        differ += int((membership(g, n) ^ membership(w, n)).sum())
        kept += w.numel()
    return differ, kept


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# Query rows per chunk of `pattern_mass`: at most 512 (128 on a CPU), fewer where a chunk's fp32
# rows [B, Hq, T, N] (at most about five live at once: logits, softmax, the skewed copy for the
# diagonal sums) would pass this many bytes. At 128K with 32 heads a 512-row chunk held 34 GiB;
# 4 GiB keeps 51 rows.
PATTERN_MASS_WORKSPACE = 4 * 2**30


def pattern_mass(
    q: Tensor,
    k: Tensor,
    scale: float | None,
    patterns: list,
    chunk: int | None = None,
    triton_path: bool | None = None,
) -> list[Tensor]:
    """fp32 [B, Hq] per token pattern (MInference): the dense softmax mass, summed over the query
    rows, on the pattern's (query, key) pairs. `triton_path` (by default on CUDA where Triton is
    installed): the fused kernel, kernels/pattern_mass.py, two causal QK^T passes per pattern with
    nothing of size N x N stored. Otherwise one chunked dense pass in PyTorch serves every pattern
    (`chunk` query rows at a time; by default as many as PATTERN_MASS_WORKSPACE allows, at most
    4096 on CUDA, where a chunk is some twenty kernel launches whatever its rows, and 128 on a
    CPU): kept = column mass of its columns + diagonal mass of its offsets - the pairs on both;
    only the overlap term reads single entries, at the union of the patterns' columns
    (O(N x columns)).
    """
    if triton_path is None:
        triton_path = q.is_cuda and triton_available()
    b, h, n, _ = q.shape
    on_cols = [membership(p.columns, n) for p in patterns]  # bool [B, H, N] over keys
    on_diags = [membership(p.diagonals, n) for p in patterns]  # bool [B, H, N] over offsets
    if triton_path and patterns:
        cols, diags = torch.stack(on_cols), torch.stack(on_diags)
        return list(pattern_kept_mass(q, k.to(q.dtype), cols, diags, scale).unbind(0))
    if chunk is None:
        # on a CPU, 128 rows keep a chunk near the cache (half the time of 512 rows at 4K)
        cap = 4096 if q.is_cuda else 128
        chunk = max(1, min(cap, PATTERN_MASS_WORKSPACE // (5 * 4 * b * h * n)))
    col_mass = q.new_zeros(b, h, n, dtype=torch.float32)  # sum over rows t of p_t(s), per key s
    diag_mass = q.new_zeros(b, h, n, dtype=torch.float32)  # sum over t of p_t(t - d), per offset d
    union = torch.stack(on_cols).any(0)  # [B, H, N]
    width = int(union.sum(-1).max())
    ucols = union.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :width]
    valid = union.gather(-1, ucols)  # [B, H, U]: False on padding
    in_col = [oc.gather(-1, ucols) & valid for oc in on_cols]  # [B, H, U] per pattern
    overlap = [q.new_zeros(b, h, dtype=torch.float32) for _ in patterns]
    for t0, t1, p in causal_softmax_chunks(q, k, scale, chunk, trim=True):  # p [B, H, T, t1]
        rows = torch.arange(t0, t1, device=q.device)[:, None]
        t = t1 - t0
        col_mass[..., :t1] += p.sum(2)
        # Diagonal sums without an index. Offsets d <= t0 (every row has its key t0 + r - d):
        # a view of p whose row stride is one longer than p's shifts row r by r, so its column
        # j holds p[r, r + j], offset d = t0 - j.
        view = p.as_strided((b, h, t, t0 + 1), (h * t * t1, t * t1, t1 + 1, 1), p.storage_offset())
        diag_mass[..., : t0 + 1] += view.sum(2).flip(-1)
        # Offsets d = t0 + e, 0 < e < T (row r's key r - e, for r >= e): the sub-diagonals of the
        # first T keys, shifted the same way after T zeros before each row.
        head = F.pad(p[..., :t], (t, 0))  # [B, H, T, 2T]
        view = head.as_strided((b, h, t, t - 1), (h * t * 2 * t, 2 * t * t, 2 * t + 1, 1), 1)
        diag_mass[..., t0 + 1 : t1] += view.sum(2).flip(-1)
        cu = ucols[:, :, None, :].expand(-1, -1, t, -1)  # [B, H, T, U]
        pu = p.gather(-1, cu.clamp_max(t1 - 1)).masked_fill_(cu >= t1, 0)  # 0 after the query
        off = (rows - cu).clamp_min(0).flatten(2)
        for acc, od, ic in zip(overlap, on_diags, in_col):
            both = od.gather(-1, off).view_as(pu) & ic[:, :, None, :]
            acc += (pu * both).sum((-1, -2))
    out = []
    for oc, od, ov in zip(on_cols, on_diags, overlap):
        out.append((col_mass * oc).sum(-1) + (diag_mass * od).sum(-1) - ov)
    return out


@dataclass(frozen=True)
class MInference:
    """Vertical-slash selection from the last queries' attention. Knob: ratio (larger = more)."""

    vertical_size: int = 1000
    slash_size: int = 6096
    ratio: float = 1.0
    last_q: int = 64
    sink_tokens: int = 30
    local_diagonals: int = 100
    impl: str = "auto"

    name = "minference"
    knob = "ratio"
    knob_direction = 1  # a larger ratio keeps more columns and diagonals
    knob_range = (1e-3, 1e2)  # open-ended: calibration searches it in log space
    is_dense = False
    block_size = DENSITY_BLOCK  # the density granularity; the pattern itself is token-level
    info = MethodInfo(
        display="MInference",
        order=4,
        sweep=("log", 1e-2, 1.0),
        style=("#7f7f7f", "*"),
        own_executor=True,  # a VerticalSlashPattern with its own attend
        throughput=True,
        # the two selector paths differ in columns and diagonals; the Triton and Flex executors
        # are timed and checked against FlexAttention on fp32 inputs
        fast_path=FastPath(compare=pattern_difference, executors=("flex", "triton")),
    )

    def __post_init__(self) -> None:
        _check_int("vertical_size", self.vertical_size, 0)
        _check_int("slash_size", self.slash_size, 0)
        _check_int("last_q", self.last_q, 1)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("local_diagonals", self.local_diagonals, 0)
        _check_ratio(self.ratio)
        check_impl(self.impl)

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def with_knob(self, value: float) -> MInference:
        _check_ratio(value)
        return dataclasses.replace(self, ratio=value)

    def sizes(self, n: int) -> tuple[int, int]:
        """(columns, diagonals) kept per head on a prompt of n tokens."""
        nv = max(round(self.vertical_size * self.ratio), self.sink_tokens)
        ns = max(round(self.slash_size * self.ratio), self.local_diagonals)
        return min(n, nv), min(n, ns)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> VerticalSlashPattern:
        """q [B, Hq, N, D], k [B, Hkv, N, D] -> the per-query-head pattern."""
        fast, vertical, slash = self._estimate(q, k, scale)
        return self._pattern(vertical, slash, fast)

    def density_curve(self, q: Tensor, k: Tensor, scale, values) -> np.ndarray:
        """Density [V] at each ratio in `values`, what `select` at that ratio measures, from one
        estimate (it does not depend on the ratio; only the kept counts do): calibration scores
        a layer at a dozen ratios per step."""
        fast, vertical, slash = self._estimate(q, k, scale)
        return np.asarray(
            [self.with_knob(r)._pattern(vertical, slash, fast).density() for r in values]
        )

    def _estimate(self, q: Tensor, k: Tensor, scale) -> tuple[bool, Tensor, Tensor]:
        """(Triton path?, vertical, slash): fp32 [B, Hq, N] scores, the forced ones infinite."""
        check_inputs(q, k)
        fast = self._fast(q)
        estimate = vertical_slash_estimate if fast else vertical_slash_estimate_ref
        vertical, slash = estimate(q, k, self.last_q, scale)
        vertical[..., : self.sink_tokens] = float("inf")
        slash[..., : self.local_diagonals] = float("inf")
        return fast, vertical, slash

    def _pattern(self, vertical: Tensor, slash: Tensor, fast: bool) -> VerticalSlashPattern:
        """The top columns and diagonals of the scores at this ratio."""
        b, hq, n = vertical.shape
        nv, ns = self.sizes(n)
        if fast:
            cols = top_k_ids(vertical.view(b * hq, n), nv).view(b, hq, nv)
            diags = top_k_ids(slash.view(b * hq, n), ns).view(b, hq, ns)
        else:
            cols, diags = top_k_ids_ref(vertical, nv), top_k_ids_ref(slash, ns)
        return VerticalSlashPattern(cols, diags, n)

    def _fast(self, q: Tensor) -> bool:
        """The Triton selector (see `use_triton`); "auto" keeps the reference where it cannot."""
        if not use_triton(self.impl, q.device):
            return False
        if estimate_supported(min(self.last_q, q.shape[2]), q.shape[-1]):
            return True
        if self.impl == "triton":
            raise ValueError(
                f"impl='triton' needs last_q <= 128 and head dim <= 256; got last_q="
                f"{self.last_q}, head dim {q.shape[-1]}"
            )
        return False


def _check_ratio(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"ratio must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"ratio must be a finite number >= 0, got {value!r}")


def demo_qk(n: int, d: int = 64, heads: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    """q [1, heads, n, d], k [1, 1, n, d] with a recency bias (a slow rotation in dims 0-1), four
    sink keys (dim 2) and one key every late query attends to at n // 3 (dim 3)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, heads, n, d, generator=gen), torch.randn(1, 1, n, d, generator=gen)
    pos = torch.arange(n, dtype=torch.float32) * (math.pi / n)
    rot = torch.stack([pos.cos(), pos.sin()], -1) * 6.0  # q_p . k_t = 36 cos(pi (p - t) / n)
    q[..., :2], k[..., :2] = rot, rot
    q[..., 2:4], k[..., 2:4] = 3.0, 0.0
    k[0, 0, :4, 2] = 6.0
    k[0, 0, n // 3, 3] = 30.0
    return q, k


def main() -> None:
    """Print the pattern of one prompt at three ratios."""
    n = 16384
    q, k = demo_qk(n)
    for ratio in (0.05, 0.2, 1.0):
        pat = MInference(ratio=ratio).select(q, k)
        cols = pat.columns[0, 0].tolist()
        sinks = cols[:30] == list(range(30))
        print(
            f"N={n} ratio {ratio}: {len(cols)} columns (sinks 0-29 kept: {sinks}, "
            f"key {n // 3} kept: {n // 3 in cols}), {pat.diagonals.shape[-1]} diagonals, "
            f"touched 128-block density {pat.density():.3f}"
        )


if __name__ == "__main__":
    main()
