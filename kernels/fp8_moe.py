"""The experts of a block-FP8 mixture-of-experts layer in a prefill, in four passes over the rows.

A top-k MoE block sends each of its N tokens to k experts. Written with the grouped product of
`fp8_gemm` alone, the experts cost, besides their two products: a gather of the N x k rows into
a new bf16 buffer, their quantisation (a second pass over that buffer), the gated activation
(one more bf16 buffer) and its quantisation. `fp8_moe_experts` does the same arithmetic in four
passes:

1. the rows quantised in one kernel (`scatter_quant`): each token is read once, quantised once
   with `fp8_gemm`'s activation arithmetic (e4m3 and one fp32 scale per 128-wide group) and
   stored whole at each of its k rows; a small kernel writes the padding rows as a zero token's.
   No bf16 gather buffer is written, x is read once and the rows written once, as e4m3 (about
   2.8 GB at 128K tokens of Qwen3-30B-A3B, where quantising the tokens and then gathering their
   bytes moved about 5 GB);
2. the gate_up product of each expert's rows;
3. `_gated_quant_kernel`: silu(gate) * up, rounded to the hidden dtype as transformers rounds it,
   then quantised for the down product (one read of the gate_up output, FP8 written);
4. the down product, then `moe_combine`: each token's weighted sum of its k rows.

Row layout (`expert_rows`). The rows are sorted by expert and each expert's rows are padded with
zero rows to a multiple of `PAD_ROWS` = 4, the row counts cuBLAS's block-scaled GEMM accepts,
into R = N x k + 3 E rows (the rows past the last expert are unused). Computed on the device, a
counting sort in four launches; when cuBLAS runs the products the host reads the experts' row
ranges once per call, with pass 1 queued behind the read so that the GPU works while it waits.

Products. On Hopper with 128 x 128 weight blocks each expert's product is one call of cuBLAS's
block-scaled FP8 GEMM (`torch._scaled_mm`, see `fp8_gemm.cublas_linear`), writing straight into
its rows of the output. cuBLAS reads an activation scale tensor [m, K / 128] stored row-count-
major, so pass 1 and 3 write each expert's scales as one such block (`blocked` scales). A weight
whose K / 128 is not a multiple of 4 (down: K = 768) has its scales laid out as this torch build's
cuBLAS reads them (`cublas_weight_scales`, decided once per device against the Triton product).
Elsewhere the products are the grouped Triton kernel of `fp8_gemm` on the quantised rows, with
group-major scales [K / 128, R].

The values equal `fp8_moe_experts_ref`'s, the same steps in PyTorch (the gather, the references
of `fp8_gemm`, transformers' gate, `moe_combine_ref`), up to the products' fp32 summation order;
quantising a row and gathering it commute exactly (`scatter_quant_ref` quantises, then
gathers). Exposed as the custom op `rbs_bench::fp8_moe_experts`, opaque to torch.compile.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from . import cublaslt, fp8_gemm
from .fp8_gemm import (
    CUBLAS_BLOCK,
    FP8_DTYPE,
    _dynamic_scales,
    _rounded,
    _to_e4m3,
    act_quant_ref,
    fp8_grouped_linear_ref,
)
from .moe_combine import _launch as _combine
from .moe_combine import moe_combine_ref
from .triton_util import INTERPRET, check_triton_launch, jit, tl, triton

PAD_ROWS = 4  # cuBLAS's block-scaled recipe takes row counts that are a multiple of 4
# Rows and warps per program of the gate's quantisation pass (`bench.moe_passes` times others).
GATED_ROWS = 32
GATED_WARPS = 4
# Whole tokens and warps per program of pass 1 (`scatter_quant`). At 128K tokens on an H200 it
# took 1.11 ms where quantising the tokens then gathering their bytes into the rows took 0.29 +
# 1.20 ms (results/scale/logs/h200_s21_callB_scatter_whole_rows_fp8_gemm_ttft.txt); storing
# 128-byte pieces of rows (a program per 32 tokens and one group) took 1.27 ms (..._callA_...).
SCATTER_ROWS = 4
SCATTER_WARPS = 4
# cuBLAS runs the products from this many rows per expert on average where its calls go straight
# to cuBLASLt (`cublaslt`), from CUBLAS_MIN_ROWS_SCALED_MM through `torch._scaled_mm`; fewer rows
# stay on Triton. The block of Qwen3-30B-A3B on an H200 (2 launch threads), Triton / direct /
# torch._scaled_mm, ms: 2,048 rows per expert (a 32K-token chunk) 4.86 / 4.56 / 6.98 (another
# run: Triton 4.89, direct 5.17); 2,560 rows 5.92 / 5.02 / 6.56; 4,096 rows 10.49 / 7.51 / 8.15;
# 8,192 rows (128K tokens) 20.01 / 13.65 / 14.01
# (results/scale/logs/h200_s23_callD_crossover_tests_fp8_gemm.txt; the other run: ..._callABC_...).
# Through torch._scaled_mm each call cost the host about 50 us on an H100, where at 2,048 rows the
# block took 14.5 ms against 6.4 ms on Triton, at 8,192 rows 16.9 ms against 22.8 ms
# (results/speed/fp8_gemm_*.csv, layer experts).
CUBLAS_MIN_ROWS = 2560
CUBLAS_MIN_ROWS_SCALED_MM = 6144
# Host threads that launch the per-expert cuBLAS calls of one product, each on its own CUDA stream
# (`launch_shares`). Through torch._scaled_mm one call cost the host about 45 us and down's
# product about 31 us of an H200, so from one thread down's 128 calls kept the GPU waiting; straight
# to cuBLASLt (12-13.5 us a call) two threads still gave the fastest block at 128K tokens, 13.83
# against 14.33-14.61 ms from one (results/scale/logs/h200_s23_callABC_direct_cublaslt.txt, call B).
# RBS_BENCH_FP8_LAUNCH_THREADS overrides it (1: every call from the caller's thread, on its stream).
LAUNCH_THREADS = 2
# The row layout's counting sort (`expert_rows`): slots per chunk (each program compares a chunk's
# slots pairwise, a [ROWS_CHUNK, ROWS_CHUNK] tile), chunks (rows) per step of the loop of a
# program that scans an expert's chunks (writes its rows), and warps per program. At 128K tokens
# on an H200 the four kernels took 130 us of GPU with 64 slots in one warp, 361 us with 128 in
# four, where the PyTorch reference takes 200 us of GPU and 742 us of host
# (results/scale/logs/h200_s19_callC_expert_rows_probe.txt).
ROWS_CHUNK = 64
ROWS_SCAN = 1024
ROWS_WARPS = 1


# ------------------------------------------------------------------------------ reference


def silu_gate_ref(h: Tensor) -> Tensor:
    """transformers' default gate of a concatenated gate_up output [S, 2I]: silu(gate) * up, each
    step rounded to h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _sorted_rows(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(expert ids sorted, the sort's permutation of the N x k slots, per-expert row counts)."""
    flat = top_k_index.reshape(-1).long()
    ids, perm = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    return ids, perm, counts


def fp8_moe_experts_ref(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    gate_up_scale_inv: Tensor,
    down: Tensor,
    down_scale_inv: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """hidden [N, H], top_k_index / top_k_weights [N, k], gate_up [E, 2I, H], down [E, H, I]
    (e4m3, with their block scales) -> [N, H] in hidden's dtype: every (token, expert) row through
    its expert's gate_up, transformers' gate, its down, then each token's weighted sum."""
    n, k = top_k_index.shape
    _, perm, counts = _sorted_rows(top_k_index, gate_up.shape[0])
    offsets = torch.cumsum(counts, 0)
    x = hidden[perm // k]
    h = fp8_grouped_linear_ref(x, gate_up, gate_up_scale_inv, offsets, block_size)
    y = fp8_grouped_linear_ref(silu_gate_ref(h), down, down_scale_inv, offsets, block_size)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=perm.device)
    return moe_combine_ref(y, pos.view(n, k), top_k_weights.to(y.dtype))


# ------------------------------------------------------------------------------ row layout


@dataclass
class ExpertRows:
    """The padded, expert-sorted row layout of one call (all on the device).

    src [R] int32: the token each row reads, -1 for a padding or unused row; pos [N, k] int64:
    the row of each (token, slot); ends [E] int32: cumulative row ends of the experts (each a
    multiple of PAD_ROWS); first / count [R] int32: the first row and the row count of the
    expert a row belongs to (the rows past ends[-1] form one more block), for blocked scales."""

    src: Tensor
    pos: Tensor
    ends: Tensor
    first: Tensor
    count: Tensor

    @property
    def rows(self) -> int:
        return self.src.shape[0]


def expert_rows_ref(top_k_index: Tensor, num_experts: int) -> ExpertRows:
    """`expert_rows` in PyTorch: a stable sort of the slots by expert, then indexing."""
    n, k = top_k_index.shape
    slots = n * k
    rows = slots + (PAD_ROWS - 1) * num_experts
    dev = top_k_index.device
    ids, perm, counts = _sorted_rows(top_k_index, num_experts)
    padded = (counts + PAD_ROWS - 1) // PAD_ROWS * PAD_ROWS
    ends = torch.cumsum(padded, 0)
    first = ends - padded
    start = torch.cumsum(counts, 0) - counts
    row = first[ids] + torch.arange(slots, device=dev) - start[ids]  # the row of sorted slot j
    src = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    src[row] = (perm // k).to(torch.int32)
    pos = torch.empty(slots, dtype=torch.int64, device=dev)
    pos[perm] = row
    block = torch.searchsorted(ends, torch.arange(rows, device=dev), right=True)  # E: unused
    first_all = torch.cat([first, ends[-1:]])
    count_all = torch.cat([padded, rows - ends[-1:]])
    return ExpertRows(
        src=src,
        pos=pos.view(n, k),
        ends=ends.to(torch.int32),
        first=first_all[block].to(torch.int32),
        count=count_all[block].to(torch.int32),
    )


def expert_rows(top_k_index: Tensor, num_experts: int) -> ExpertRows:
    """The layout of the module docstring for top_k_index [N, k] (ids in [0, E)), equal to
    `expert_rows_ref`'s (the slots of an expert in their order), with no host sync: on CUDA (or
    under TRITON_INTERPRET=1) a counting sort in four Triton launches; elsewhere the reference.

    The slots are cut into chunks of `ROWS_CHUNK`. `_rows_hist_kernel` counts each chunk's slots
    per expert; `_rows_scan_kernel` sums, per expert, the counts of the chunks before each one;
    `_rows_place_kernel` puts slot s of expert e at row first_e + (e's slots in earlier chunks)
    + (e's earlier slots in its chunk); `_rows_blocks_kernel` writes, one program per expert,
    each row's expert block (first, count), marks the padding rows and writes the ends. The
    reference's sort, cumsums, scatters and searchsorted are some 60 launches, each a few
    microseconds of GPU and 10-20 of host: at 128K tokens on an H200 the reference costs 742 us
    of host and 200 us of GPU a call, the four kernels 167 us of host and 130 us of GPU
    (results/scale/logs/h200_s19_callC_expert_rows_probe.txt)."""
    n, k = top_k_index.shape
    dev = top_k_index.device
    if n * k == 0 or triton is None or not (top_k_index.is_cuda or INTERPRET):
        return expert_rows_ref(top_k_index, num_experts)
    slots, experts = n * k, num_experts
    rows = slots + (PAD_ROWS - 1) * experts
    ids = top_k_index.reshape(-1)
    chunks = triton.cdiv(slots, ROWS_CHUNK)
    block_e = triton.next_power_of_2(experts)
    hist = torch.empty(experts, chunks, dtype=torch.int32, device=dev)
    before = torch.empty_like(hist)
    counts = torch.empty(experts, dtype=torch.int32, device=dev)
    layout = ExpertRows(
        src=torch.empty(rows, dtype=torch.int32, device=dev),
        pos=torch.empty(n, k, dtype=torch.int64, device=dev),
        ends=torch.empty(experts, dtype=torch.int32, device=dev),
        first=torch.empty(rows, dtype=torch.int32, device=dev),
        count=torch.empty(rows, dtype=torch.int32, device=dev),
    )
    warps = ROWS_WARPS
    _rows_hist_kernel[(chunks,)](ids, hist, slots, chunks, experts, CHUNK=ROWS_CHUNK,
                                 BLOCK_E=block_e, num_warps=warps)  # fmt: skip
    _rows_scan_kernel[(experts,)](hist, before, counts, chunks, BLOCK_C=ROWS_SCAN,
                                  num_warps=warps)  # fmt: skip
    _rows_place_kernel[(chunks,)](
        ids, before, counts, layout.src, layout.pos, slots, chunks, experts, k, PAD=PAD_ROWS,
        CHUNK=ROWS_CHUNK, BLOCK_E=block_e, num_warps=warps,
    )  # fmt: skip
    _rows_blocks_kernel[(experts + 1,)](
        counts, layout.src, layout.first, layout.count, layout.ends, rows, experts,
        PAD=PAD_ROWS, BLOCK_R=ROWS_SCAN, BLOCK_E=block_e, num_warps=warps,
    )  # fmt: skip
    return layout


# ------------------------------------------------------------------------------ kernels


@jit
def _rows_hist_kernel(Ids, Hist, S, C, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    # Hist [E, C]: how many slots of chunk c go to expert e
    c = tl.program_id(0)
    s = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(Ids + s, mask=s < S, other=-1)
    e = tl.arange(0, BLOCK_E)
    hist = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(Hist + e * C + c, hist, mask=e < E)


@jit
def _rows_scan_kernel(Hist, Before, Counts, C, BLOCK_C: tl.constexpr):
    # Before [E, C]: expert e's slots in the chunks before chunk c; Counts [E]: all of them
    e = tl.program_id(0)
    total = tl.sum(tl.zeros([BLOCK_C], dtype=tl.int32), axis=0)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        h = tl.load(Hist + e * C + c, mask=c < C, other=0)
        tl.store(Before + e * C + c, total + tl.cumsum(h, 0) - h, mask=c < C)
        total += tl.sum(h, axis=0)
    tl.store(Counts + e, total)


@jit
def _expert_blocks(Counts, E, PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """(e, count, padded count, first row, row end) of each expert, [BLOCK_E] each (zero counts
    past E, whose first and end are the last expert's end)."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + e, mask=e < E, other=0)
    padded = (counts + PAD - 1) // PAD * PAD
    ends = tl.cumsum(padded, 0)
    return e, counts, padded, ends - padded, ends


@jit
def _rows_place_kernel(
    Ids,
    Before,
    Counts,
    Src,
    Pos,
    S,
    C,
    E,
    K,
    PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # slot s (token s // K) of expert e: row first_e + Before[e, c] + e's earlier slots in chunk c
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    s = c * CHUNK + i
    ok = s < S
    ids = tl.load(Ids + s, mask=ok, other=-1)
    e, _, _, first, _ = _expert_blocks(Counts, E, PAD, BLOCK_E)
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(tl.where(ids[:, None] == e[None, :], first[None, :], 0), axis=1)
    before = tl.load(Before + ids * C + c, mask=ok, other=0)
    row = start + before + rank
    tl.store(Src + row, (s // K).to(tl.int32), mask=ok)
    tl.store(Pos + s, row.to(tl.int64), mask=ok)


@jit
def _rows_blocks_kernel(
    Counts,
    Src,
    First,
    Count,
    Ends,
    R,
    E,
    PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # program x < E: expert x's rows, each given the block (first, count), Src = -1 on the padding
    # rows past its slots (`_rows_place_kernel` writes the others); program E: the unused rows
    # past the last expert, one block of their own
    x = tl.program_id(0)
    e, counts, padded, first, ends = _expert_blocks(Counts, E, PAD, BLOCK_E)
    mine = e == x
    used_rows = tl.sum(padded, axis=0)
    start = tl.where(x < E, tl.sum(tl.where(mine, first, 0), axis=0), used_rows)
    size = tl.where(x < E, tl.sum(tl.where(mine, padded, 0), axis=0), R - used_rows)
    taken = tl.sum(tl.where(mine, counts, 0), axis=0)  # 0 for the unused rows
    for offset in range(0, size, BLOCK_R):
        local = offset + tl.arange(0, BLOCK_R)
        ok = local < size
        r = start + local
        tl.store(First + r, tl.full([BLOCK_R], 0, tl.int32) + start, mask=ok)
        tl.store(Count + r, tl.full([BLOCK_R], 0, tl.int32) + size, mask=ok)
        tl.store(Src + r, tl.full([BLOCK_R], -1, tl.int32), mask=ok & (local >= taken))
    if x == 0:
        tl.store(Ends + e, ends, mask=e < E)


@jit
def _scale_offsets(rows, g, r_ok, First, Count, R, G, BLOCKED: tl.constexpr):
    """Where the scale of group g of row `rows` lies (broadcast together): BLOCKED, expert x's
    scales [G, count_x] at G * first_x, row-count-major; else group-major [G, R], g * R + row."""
    rows64 = rows.to(tl.int64)
    if BLOCKED:
        first = tl.load(First + rows, mask=r_ok, other=0).to(tl.int64)
        count = tl.load(Count + rows, mask=r_ok, other=0).to(tl.int64)
        return (G - 1) * first + rows64 + g * count
    else:
        return g * R + rows64


@jit
def _quant_store(
    y,
    rows,
    cols,
    r_ok,
    c_ok,
    XQ,
    XS,
    First,
    Count,
    stride_qm,
    R,
    G,
    BLOCKED: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Quantise the [BLOCK_ROWS, GROUP] fp32 tile y (group pid 1) as `fp8_gemm`'s activation
    pass does, and store it and its scales (`_scale_offsets`)."""
    s = _dynamic_scales(y)
    ok = r_ok[:, None] & c_ok[None, :]
    q_ptrs = XQ + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :]
    tl.store(q_ptrs, _to_e4m3(y, s, ROUND), mask=ok)
    g = tl.program_id(1)
    where = _scale_offsets(rows, g, r_ok, First, Count, R, G, BLOCKED)
    tl.store(XS + where, s, mask=r_ok)


@jit
def _scatter_quant_kernel(
    X,
    Pos,
    XQ,
    XS,
    First,
    Count,
    N,
    R,
    K,
    stride_xm,
    stride_qm,
    G,
    TOP_K: tl.constexpr,
    BLOCKED: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
):
    # one program: BLOCK_M whole tokens (BLOCK_G groups of GROUP >= K), quantised once and
    # stored at each of the tokens' TOP_K rows Pos [N, TOP_K], every row in one piece
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_G * GROUP)
    t_ok = tokens < N
    ok = t_ok[:, None] & (cols < K)[None, :]
    tokens64 = tokens.to(tl.int64)
    x = tl.load(X + tokens64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
    x = tl.reshape(x.to(tl.float32), (BLOCK_M * BLOCK_G, GROUP))  # one group a row
    s = _dynamic_scales(x)
    q = tl.reshape(_to_e4m3(x, s, ROUND), (BLOCK_M, BLOCK_G * GROUP))
    s = tl.reshape(s, (BLOCK_M, BLOCK_G))
    g = tl.arange(0, BLOCK_G)[None, :]
    s_ok = t_ok[:, None] & (g < G)
    for j in tl.static_range(TOP_K):
        rows = tl.load(Pos + tokens64 * TOP_K + j, mask=t_ok, other=0)
        tl.store(XQ + rows[:, None] * stride_qm + cols[None, :], q, mask=ok)
        where = _scale_offsets(rows[:, None], g, t_ok[:, None], First, Count, R, G, BLOCKED)
        tl.store(XS + where, s, mask=s_ok)


@jit
def _padding_quant_kernel(
    Src,
    Ends,
    XQ,
    XS,
    First,
    Count,
    R,
    K,
    E,
    stride_qm,
    G,
    PAD: tl.constexpr,
    BLOCKED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
):
    # the rows no token reads, whole, as a zero token's: e4m3 zeros and the zero group's scale.
    # Program e < E: the last PAD rows of expert e (its padding is fewer than PAD rows, all at
    # its end; rows another expert's tokens fill are skipped); program E + i: rows PAD i.. past
    # the last expert's end
    e = tl.program_id(0)
    end = tl.load(Ends + tl.minimum(e, E - 1))
    start = tl.where(e < E, end - PAD, end + (e - E) * PAD)
    rows = start + tl.arange(0, PAD)
    in_range = (rows >= 0) & (rows < R)
    src = tl.load(Src + rows, mask=in_range, other=0)
    r_ok = in_range & (src < 0)
    cols = tl.arange(0, BLOCK_G * GROUP)
    rows64 = rows.to(tl.int64)
    zero = tl.zeros([PAD, BLOCK_G * GROUP], dtype=tl.float32).to(tl.float8e4nv)
    tl.store(XQ + rows64[:, None] * stride_qm + cols[None, :], zero,
             mask=r_ok[:, None] & (cols < K)[None, :])  # fmt: skip
    g = tl.arange(0, BLOCK_G)[None, :]
    s = _dynamic_scales(tl.zeros([PAD * BLOCK_G, 1], dtype=tl.float32))  # a zero group's
    where = _scale_offsets(rows[:, None], g, r_ok[:, None], First, Count, R, G, BLOCKED)
    tl.store(XS + where, tl.reshape(s, (PAD, BLOCK_G)), mask=r_ok[:, None] & (g < G))


@jit
def _gated_quant_kernel(
    H,
    XQ,
    XS,
    First,
    Count,
    R,
    INTER,
    stride_hm,
    stride_qm,
    G,
    BLOCKED: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    # silu(gate) * up of h = [gate | up] [R, 2I], each step rounded to h's dtype as transformers'
    # gate computes it, then quantised
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    r_ok = rows < R
    c_ok = cols < INTER
    ok = r_ok[:, None] & c_ok[None, :]
    ptrs = H + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    gate = tl.load(ptrs, mask=ok, other=0.0)
    up = tl.load(ptrs + INTER, mask=ok, other=0.0)
    gf = gate.to(tl.float32)
    act = _rounded(gf / (1.0 + tl.exp(-gf)), gate.dtype, ROUND)
    y = _rounded(act * up.to(tl.float32), gate.dtype, ROUND)
    _quant_store(y, rows, cols, r_ok, c_ok, XQ, XS, First, Count, stride_qm, R, G, BLOCKED, ROUND)


def place_scales(scales: Tensor, layout: ExpertRows, blocked: bool) -> Tensor:
    """Row scales [R, G] laid out flat [G * R] as the products read them: blocked, expert x's
    [G, count_x] at G * first_x (row-count-major); else group-major [G, R]."""
    r, groups = scales.shape
    rows = torch.arange(r, device=scales.device)
    g = torch.arange(groups, device=scales.device)[:, None]
    if blocked:
        where = (groups - 1) * layout.first.long() + rows + g * layout.count.long()
    else:
        where = g * r + rows
    out = torch.empty(groups * r, dtype=scales.dtype, device=scales.device)
    out[where] = scales.t()
    return out


def scatter_quant_ref(x: Tensor, layout: ExpertRows, blocked: bool) -> tuple[Tensor, Tensor]:
    """`scatter_quant` in PyTorch: the tokens and a zero row quantised by `act_quant_ref`, then
    row r of the layout = row src[r] (the zero row where src is -1), scales by `place_scales`."""
    n, k = x.shape
    tq, ts = act_quant_ref(torch.cat([x, x.new_zeros(1, k)]), CUBLAS_BLOCK[1])
    src = torch.where(layout.src >= 0, layout.src, n).long()
    return tq[src], place_scales(ts[src], layout, blocked)


def scatter_quant(x: Tensor, layout: ExpertRows, blocked: bool) -> tuple[Tensor, Tensor]:
    """Pass 1: row r of the layout = x[src[r]] quantised, a zero token's values where src is -1
    (e4m3 [R, K], fp32 scales [G * R], blocked or group-major [G, R]). Each token of x [N, K] is
    read and quantised once, by `fp8_act_quant`'s arithmetic, and stored whole at each of its k
    rows (`layout.pos`); a second, small kernel writes the padding rows."""
    check_triton_launch("scatter_quant", x, layout.pos)
    (n, k), r, top_k = x.shape, layout.rows, layout.pos.shape[1]
    group = CUBLAS_BLOCK[1]
    groups = triton.cdiv(k, group)
    experts = layout.ends.shape[0]
    xq = torch.empty(r, k, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty(groups * r, dtype=torch.float32, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    pos = layout.pos.contiguous()
    spare = (PAD_ROWS - 1) * experts  # rows past the last expert: at most all the padding
    block_g = triton.next_power_of_2(groups)
    _padding_quant_kernel[(experts + triton.cdiv(spare, PAD_ROWS),)](
        layout.src, layout.ends, xq, xs, layout.first, layout.count, r, k, experts,
        xq.stride(0), groups, PAD=PAD_ROWS, BLOCKED=blocked, BLOCK_G=block_g, GROUP=group,
        num_warps=SCATTER_WARPS,
    )  # fmt: skip
    if n:
        _scatter_quant_kernel[(triton.cdiv(n, SCATTER_ROWS),)](
            x, pos, xq, xs, layout.first, layout.count, n, r, k, x.stride(0), xq.stride(0),
            groups, TOP_K=top_k, BLOCKED=blocked, ROUND=INTERPRET, BLOCK_M=SCATTER_ROWS,
            BLOCK_G=block_g, GROUP=group, num_warps=SCATTER_WARPS,
        )  # fmt: skip
    return xq, xs


def gated_quant(h: Tensor, layout: ExpertRows, blocked: bool) -> tuple[Tensor, Tensor]:
    """Pass 3: silu(gate) * up of h [R, 2I] quantised: (e4m3 [R, I], fp32 scales [G * R])."""
    check_triton_launch("gated_quant", h, layout.ends)
    r, inter = layout.rows, h.shape[1] // 2
    groups = triton.cdiv(inter, CUBLAS_BLOCK[1])
    xq = torch.empty(r, inter, dtype=FP8_DTYPE, device=h.device)
    xs = torch.empty(groups * r, dtype=torch.float32, device=h.device)
    h = h if h.stride(1) == 1 else h.contiguous()
    _gated_quant_kernel[(triton.cdiv(r, GATED_ROWS), groups)](
        h, xq, xs, layout.first, layout.count, r, inter, h.stride(0), xq.stride(0), groups,
        BLOCKED=blocked, ROUND=INTERPRET, BLOCK_M=GATED_ROWS, GROUP=CUBLAS_BLOCK[1],
        num_warps=GATED_WARPS,
    )  # fmt: skip
    return xq, xs


# ------------------------------------------------------------------------------ products


def _padded_view(s: Tensor) -> Tensor:
    """[..., nb, kb] scales stored with rows of round_up(kb, 4) (zeros past kb), seen as a
    tensor of strides (kb, 1): the storage cuBLAS reads, behind the strides torch checks."""
    nb, kb = s.shape[-2:]
    kb4 = -(-kb // 4) * 4
    store = torch.zeros(*s.shape[:-2], nb, kb4, dtype=torch.float32, device=s.device)
    store[..., :kb] = s
    lead = s.shape[:-2]
    size = (*lead, nb, kb)
    stride = (*[nb * kb4] * len(lead), kb, 1)
    return store.as_strided(size, stride)


def _padded_strides(s: Tensor) -> Tensor:
    """The same storage, seen with its own strides (round_up(kb, 4), 1)."""
    nb, kb = s.shape[-2:]
    kb4 = -(-kb // 4) * 4
    store = torch.zeros(*s.shape[:-2], nb, kb4, dtype=torch.float32, device=s.device)
    store[..., :kb] = s
    return store[..., :kb]


SCALE_LAYOUTS = {"plain": lambda s: s.float().contiguous(), "padded_view": _padded_view,
                 "padded_strides": _padded_strides}  # fmt: skip


@functools.cache
def _weight_scale_layout(device: torch.device, kb: int) -> str | None:
    """The layout of `SCALE_LAYOUTS` under which cuBLAS multiplies a weight of kb scale columns
    exactly as the Triton kernel does, tried once per device on a small product; None: none."""
    if kb % 4 == 0:
        return "plain"
    gen = torch.Generator(device=device).manual_seed(0)
    k = kb * CUBLAS_BLOCK[1]
    x = torch.randn(8, k, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(512, k, generator=gen, device=device) * 8).to(FP8_DTYPE)
    s = torch.rand(4, kb, generator=gen, device=device) / 64 + 1e-3
    ref = fp8_gemm._launch(x, w, s, CUBLAS_BLOCK, out_dtype=torch.float32)
    a, a_s = fp8_gemm.fp8_act_quant(x, CUBLAS_BLOCK[1])
    for name, layout in SCALE_LAYOUTS.items():
        try:
            got = torch._scaled_mm(
                a, w.t(), a_s.t(), layout(s).t(), out_dtype=torch.bfloat16
            ).float()
        except RuntimeError:
            continue
        if bool(torch.isfinite(got).all()) and float((got - ref).norm() / ref.norm()) < 1e-2:
            return name
    return None


def cublas_weight_scales(weight_scale_inv: Tensor) -> Tensor | None:
    """The experts' scales [E, nb, kb] as cuBLAS reads them on this device, or None when no
    layout works (the product then stays on Triton)."""
    name = _weight_scale_layout(weight_scale_inv.device, weight_scale_inv.shape[-1])
    return None if name is None else SCALE_LAYOUTS[name](weight_scale_inv)


def launch_threads() -> int:
    """How many host threads launch one product's per-expert calls (`LAUNCH_THREADS`, or
    RBS_BENCH_FP8_LAUNCH_THREADS)."""
    value = os.environ.get("RBS_BENCH_FP8_LAUNCH_THREADS", str(LAUNCH_THREADS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"RBS_BENCH_FP8_LAUNCH_THREADS must be a whole number >= 1; got {value!r}")
    return int(value)


@functools.cache
def _launch_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="rbs-bench-fp8-launch")


@functools.cache
def _side_stream(device: torch.device, i: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def launch_shares(work: list, launch, device: torch.device, threads: int) -> None:
    """launch(work[i::n]) for each share i of n = min(threads, len(work)): share 0 from the
    caller's thread on its current stream, each other share from a pool thread on a stream of its
    own that first waits for the caller's stream, which then waits for them all. torch releases
    the GIL inside each op, so the shares' host work overlaps; on the GPU the calls stay in
    order within a share. A pool thread runs its share in the caller's inference and grad
    modes (both are per thread: a prefill's tensors are inference tensors, which only code in
    inference mode may write). Off CUDA, or with one thread, launch(work) in the caller's
    thread."""
    n = min(threads, len(work))
    if device.type != "cuda" or n <= 1:
        launch(work)
        return
    caller = torch.cuda.current_stream(device)
    start = caller.record_event()
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def share(i: int) -> torch.cuda.Stream:
        stream = _side_stream(device, i)
        stream.wait_event(start)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            with torch.cuda.stream(stream):
                launch(work[i::n])
        return stream

    futures = [_launch_pool(n - 1).submit(share, i) for i in range(1, n)]
    try:
        launch(work[0::n])
    finally:
        for future in futures:
            caller.wait_stream(future.result())


def _cublas_products(
    xq: Tensor, xs: Tensor, weight: Tensor, scales: Tensor, spans: list, out_dtype
) -> Tensor:
    """Each expert's rows [first, first + count) times its weight, one cuBLAS call each, into
    one [R, N] output (blocked scales); unused rows are zeros.

    The calls go straight to cuBLASLt (`cublaslt.Products`: the same algorithm as
    `torch._scaled_mm`, bit for bit, at about 12 us of host time a call against its 20-22) where
    `cublaslt.in_use`, else through `torch._scaled_mm`, with every per-expert view made by one
    call before the loop (`split`, `unbind`; the scales' [count, G] view from one `as_strided`).
    The calls are launched from `launch_threads()` host threads (`launch_shares`): on an H200 at
    128K tokens one thread spent 5.9 ms launching down's 128 `torch._scaled_mm` calls, whose
    kernels take 3.9 ms (results/scale/logs/h200_s18_callA_experts_gaps.txt); taking turns over
    2-4 CUDA streams from one thread gained nothing (17.05-17.67 ms against 17.18-17.35 on one,
    results/scale/logs/h200x2_s11_call2_gpu_suite_streams_ttft.txt)."""
    r, k = xq.shape
    groups = k // CUBLAS_BLOCK[1]
    n = weight.shape[1]
    out = torch.empty(r, n, dtype=out_dtype, device=xq.device)
    used = spans[-1][0] + spans[-1][1] if spans else 0
    work = [(e, first, count) for e, (first, count) in enumerate(spans) if count]
    device = xq.device
    if _direct(xq, xs, weight, scales, out_dtype):
        products = cublaslt.products(device, n, k)
        row, w_bytes, s_bytes = n * out.element_size(), weight.stride(0), 4 * scales.stride(0)
        a0, s0, w0, ws0, o0 = (t.data_ptr() for t in (xq, xs, weight, scales, out))
        calls = [(count, a0 + first * k, s0 + 4 * groups * first, w0 + e * w_bytes,
                  ws0 + e * s_bytes, o0 + first * row) for e, first, count in work]  # fmt: skip

        def launch(share: list) -> None:
            products.launch(share, torch.cuda.current_stream(device))

        launch_shares(calls, launch, device, launch_threads())
    else:
        sizes = [count for _, count in spans] + [r - used]
        rows, outs = xq.split(sizes), out.split(sizes)
        weights_t, scales_t = weight.transpose(1, 2).unbind(0), scales.transpose(1, 2).unbind(0)

        def launch(share: list) -> None:
            for e, first, count in share:
                a_s = xs.as_strided((count, groups), (1, count), groups * first)  # [G, count].t()
                torch._scaled_mm(
                    rows[e], weights_t[e], a_s, scales_t[e], out_dtype=out_dtype, out=outs[e]
                )  # fmt: skip

        launch_shares(work, launch, device, launch_threads())
    out[used:].zero_()
    return out


def _direct(xq: Tensor, xs: Tensor, weight: Tensor, scales: Tensor, out_dtype) -> bool:
    """Whether `_cublas_products` calls cuBLASLt itself: enabled, checked on this device, and the
    operands laid out as the addresses it computes assume (rows, weights and scales of each expert
    dense behind one base address each; xq's and the weights' bytes are e4m3), bf16 out as
    `cublaslt.available` checked it."""
    n, k = weight.shape[1:]
    return (
        out_dtype == torch.bfloat16
        and xq.is_contiguous()
        and xs.is_contiguous()
        and weight.stride()[1:] == (k, 1)
        and scales.dtype == torch.float32
        and cublaslt.in_use(xq.device)
    )


def _triton_products(
    xq: Tensor, xs: Tensor, weight: Tensor, scale_inv: Tensor, layout: ExpertRows, block, dtype
) -> Tensor:
    groups = xs.numel() // layout.rows
    quantized = (xq, xs.view(groups, layout.rows))
    return fp8_gemm._launch(
        xq, weight, scale_inv, block, layout.ends, out_dtype=dtype, quantized=quantized
    )


def _use_cublas(rows: int, hidden: Tensor, gate_up: Tensor, down: Tensor, block) -> bool:
    """cuBLAS for both products: at least `CUBLAS_MIN_ROWS` rows per expert on average where the
    calls go straight to cuBLASLt, `CUBLAS_MIN_ROWS_SCALED_MM` where they go through
    `torch._scaled_mm` (fewer, a short chunk or a decode step, stay on one Triton launch each,
    without a host read), and each weight's product as `fp8_gemm._use_cublas` takes a 2-d one,
    with K a multiple of 128 (a K / 128 that is not a multiple of 4 takes
    `cublas_weight_scales`)."""
    if os.environ.get("RBS_BENCH_FP8_CUBLAS_GROUPED", "1") == "0" or not hidden.is_cuda:
        return False
    per_expert = CUBLAS_MIN_ROWS if cublaslt.in_use(hidden.device) else CUBLAS_MIN_ROWS_SCALED_MM
    return rows >= per_expert * gate_up.shape[0] and all(
        fp8_gemm._use_cublas(hidden, w[0], block, None, hidden.dtype, CUBLAS_BLOCK[1])
        for w in (gate_up, down)
    )


def cublas_scales(rows: int, hidden, gate_up, gate_up_scale_inv, down, down_scale_inv, block):
    """[gate_up's, down's] weight scales as cuBLAS reads them where both products run on
    cuBLAS (`_use_cublas`, and a layout for each, `cublas_weight_scales`), else None (Triton)."""
    if not _use_cublas(rows, hidden, gate_up, down, block):
        return None
    scales = [cublas_weight_scales(gate_up_scale_inv), cublas_weight_scales(down_scale_inv)]
    return None if any(s is None for s in scales) else scales


def expert_spans(layout: ExpertRows) -> list[tuple[int, int]]:
    """(first row, row count) of each expert's block of rows: the one host read of a call whose
    products run on cuBLAS (`_cublas_products`)."""
    return _spans(layout.ends.tolist())


def _spans(ends: list[int]) -> list[tuple[int, int]]:
    return [(first, end - first) for first, end in zip([0, *ends[:-1]], ends)]


def expert_spans_later(layout: ExpertRows) -> Callable[[], list[tuple[int, int]]]:
    """`expert_spans` read without a wait now: on CUDA the ends are copied into pinned host memory
    behind the work queued so far, and the returned call waits for that copy alone. Work queued
    between the two (pass 1) keeps the GPU busy while the host waits and then launches the
    products, where `expert_spans` would leave it idle from the read to the first launch."""
    if not layout.ends.is_cuda:
        return lambda: expert_spans(layout)
    ends = torch.empty(layout.ends.shape, dtype=layout.ends.dtype, pin_memory=True)
    ends.copy_(layout.ends, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def spans() -> list[tuple[int, int]]:
        copied.synchronize()
        return _spans(ends.tolist())

    return spans


def _experts(hidden, top_k_index, top_k_weights, gate_up, gu_s, down, d_s, block) -> Tensor:
    dtype = hidden.dtype
    layout = expert_rows(top_k_index, gate_up.shape[0])
    scales = cublas_scales(top_k_index.numel(), hidden, gate_up, gu_s, down, d_s, block)
    if scales is not None:
        spans_of = expert_spans_later(layout)
        xq, xs = scatter_quant(hidden, layout, blocked=True)
        spans = spans_of()
        h = _cublas_products(xq, xs, gate_up, scales[0], spans, dtype)
        del xq, xs  # each buffer is freed as soon as it is read (a 128K-token call holds ~6 GiB)
        aq, a_s = gated_quant(h, layout, blocked=True)
        del h
        y = _cublas_products(aq, a_s, down, scales[1], spans, dtype)
    else:
        xq, xs = scatter_quant(hidden, layout, blocked=False)
        h = _triton_products(xq, xs, gate_up, gu_s, layout, block, dtype)
        del xq, xs
        aq, a_s = gated_quant(h, layout, blocked=False)
        del h
        y = _triton_products(aq, a_s, down, d_s, layout, block, dtype)
    return _combine(y, layout.pos, top_k_weights.to(dtype))


@torch.library.custom_op("rbs_bench::fp8_moe_experts", mutates_args=())
def _fp8_moe_experts_op(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    gate_up_scale_inv: Tensor,
    down: Tensor,
    down_scale_inv: Tensor,
    block_n: int,
    block_k: int,
) -> Tensor:
    args = (hidden, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv)
    block = (block_n, block_k)
    if hidden.is_cuda:
        with torch.cuda.device(hidden.device):
            return _experts(*args, block)
    if INTERPRET:
        return _experts(*args, block)
    return fp8_moe_experts_ref(*args, block)


@_fp8_moe_experts_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv,
      block_n, block_k):  # fmt: skip
    return hidden.new_empty(hidden.shape)


def _check(hidden, top_k_index, top_k_weights, gate_up, down, block_size) -> None:
    n, h = hidden.shape
    e, two_i, h2 = gate_up.shape
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != n:
        raise ValueError(
            f"fp8_moe_experts: top_k_index and top_k_weights must be [N, k] for hidden [N, H]; "
            f"got {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}, {tuple(hidden.shape)}"
        )
    if h2 != h or two_i % 2 or down.shape != (e, h, two_i // 2):
        raise ValueError(
            f"fp8_moe_experts: gate_up must be [E, 2I, H] and down [E, H, I] for H = {h}; got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    if gate_up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE:
        raise ValueError(
            f"fp8_moe_experts takes e4m3 weights; got {gate_up.dtype} and {down.dtype}"
        )
    if block_size is None or tuple(int(b) for b in block_size)[1] != CUBLAS_BLOCK[1]:
        raise ValueError(
            f"fp8_moe_experts takes weight blocks of [bn, 128]; got block_size {block_size}"
        )


def fp8_moe_experts(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    gate_up_scale_inv: Tensor,
    down: Tensor,
    down_scale_inv: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """The experts of a block-FP8 MoE with transformers' default SiLU gate (see the module
    docstring): hidden [N, H], top_k_index / top_k_weights [N, k] (ids in [0, E)), gate_up
    [E, 2I, H] ([gate; up] concatenated), down [E, H, I] -> [N, H] in hidden's dtype. Triton
    and cuBLAS on a GPU (and Triton under TRITON_INTERPRET=1), `fp8_moe_experts_ref` on a CPU."""
    _check(hidden, top_k_index, top_k_weights, gate_up, down, block_size)
    return torch.ops.rbs_bench.fp8_moe_experts(
        hidden, top_k_index, top_k_weights, gate_up, gate_up_scale_inv.float(),
        down, down_scale_inv.float(), int(block_size[0]), int(block_size[1]),
    )  # fmt: skip
