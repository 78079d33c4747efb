"""The last step of a mixture-of-experts block: each token's weighted sum of its experts' outputs.

A grouped-GEMM MoE sorts the N x top-k (token, expert) rows by expert, runs the experts over the
sorted rows, and must bring each token's k rows back together:

    out[t] = sum_j  w[t, j] * y[pos[t, j]]

y [S, H] holds the experts' outputs in sorted order (S = N x k, or more where each expert's rows
are padded, `fp8_moe`), pos [N, k] the row of (t, j) in y (the inverse of the sort's permutation)
and w [N, k] the router's weights. Written with
tensor ops this is a gather of S rows into a new [S, H] buffer, a multiply and a reduction over k:
at 128K tokens of Qwen3-30B-A3B (k = 8, H = 2048) about 12 GiB of traffic and, compiled by
inductor, 10 ms per layer on an H100. `moe_combine` is one pass: each program reads the k rows of
a tile of tokens straight from y and accumulates in fp32, so y is read once and only the [N, H]
output is written (4.5 GiB, about 2 ms). `moe_combine_ref` is its PyTorch reference.

Both are exposed as the custom op `rbs_bench::moe_combine`, opaque to `torch.compile`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_util import check_triton_launch, jit, tl, triton

# One program sums COMBINE_TOKENS tokens x COMBINE_WIDTH hidden columns in COMBINE_WARPS warps.
# `bench.moe_passes` times other settings against these: on an H200 at 128K tokens of
# Qwen3-30B-A3B these ran fastest, 0.91x the time of 16 x 512 in 4 warps, and every 8-token
# setting 0.91-0.97x (results/speed/moe_passes_nvidia_h200.csv).
COMBINE_TOKENS = 8
COMBINE_WIDTH = 1024
COMBINE_WARPS = 8


def _check(y: Tensor, pos: Tensor, w: Tensor) -> None:
    if y.dim() != 2 or pos.dim() != 2 or w.shape != pos.shape:
        raise ValueError(
            f"moe_combine: y must be [S, H], pos and w [N, k]; got {tuple(y.shape)}, "
            f"{tuple(pos.shape)}, {tuple(w.shape)}"
        )
    if pos.numel() > y.shape[0]:
        raise ValueError(f"moe_combine: pos has {pos.numel()} entries for {y.shape[0]} rows of y")


def moe_combine_ref(y: Tensor, pos: Tensor, w: Tensor) -> Tensor:
    """[N, H] in y's dtype: out[t] = sum_j w[t, j] * y[pos[t, j]], accumulated in fp32 (fp64
    for fp64 inputs)."""
    _check(y, pos, w)
    n, k = pos.shape
    acc = torch.promote_types(y.dtype, torch.float32)
    rows = y.index_select(0, pos.reshape(-1)).to(acc).view(n, k, -1)
    return (rows * w.to(acc).unsqueeze(-1)).sum(1).to(y.dtype)


@jit
def _moe_combine_kernel(
    Y,
    Pos,
    W,
    Out,
    n_tokens,
    hidden,
    stride_y,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < n_tokens
    h_ok = h < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(Pos + t * TOP_K + j, mask=t_ok, other=0).to(tl.int64)
        weight = tl.load(W + t * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)
        vals = tl.load(
            Y + row[:, None] * stride_y + h[None, :],
            mask=t_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        acc += weight[:, None] * vals.to(tl.float32)
    out = Out + t.to(tl.int64)[:, None] * stride_out + h[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=t_ok[:, None] & h_ok[None, :])


def _launch(y: Tensor, pos: Tensor, w: Tensor) -> Tensor:
    _check(y, pos, w)
    check_triton_launch("moe_combine", y, pos, w)
    n, k = pos.shape
    hidden = y.shape[1]
    y = y if y.stride(1) == 1 else y.contiguous()
    pos, w = pos.contiguous(), w.contiguous()
    out = y.new_empty(n, hidden)
    if n == 0:
        return out
    block_h = min(COMBINE_WIDTH, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(n, COMBINE_TOKENS), triton.cdiv(hidden, block_h))
    _moe_combine_kernel[grid](
        y, pos, w, out, n, hidden, y.stride(0), out.stride(0),
        TOP_K=k, BLOCK_T=COMBINE_TOKENS, BLOCK_H=block_h, num_warps=COMBINE_WARPS,
    )  # fmt: skip
    return out


@torch.library.custom_op("rbs_bench::moe_combine", mutates_args=())
def moe_combine(y: Tensor, pos: Tensor, w: Tensor) -> Tensor:
    """[N, H]: out[t] = sum_j w[t, j] * y[pos[t, j]] (fp32 accumulation), one pass over y.

    y [S, H] expert outputs in sorted order, pos [N, k] int (the sorted row of each (token,
    expert) pair), w [N, k] router weights. Triton on CUDA (and under TRITON_INTERPRET=1), the
    PyTorch reference elsewhere."""
    if y.is_cuda or (y.device.type == "cpu" and _interpreting()):
        return _launch(y, pos, w)
    return moe_combine_ref(y, pos, w)


@moe_combine.register_fake
def _(y: Tensor, pos: Tensor, w: Tensor) -> Tensor:
    return y.new_empty(pos.shape[0], y.shape[1])


def _interpreting() -> bool:
    from .triton_util import INTERPRET

    return INTERPRET
