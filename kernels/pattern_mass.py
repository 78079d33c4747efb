"""Kept attention mass of token patterns (MInference's vertical-slash): the dense causal softmax
mass, summed over the queries, on the (query, key) pairs a pattern keeps, without N x N.

For query head h (KV head h // (Hq / Hkv)) and a pattern given by two membership masks over the
N positions, `on_col` over keys and `on_diag` over offsets (query - key),

    kept = sum over queries t of  sum over keys s <= t with on_col[s] or on_diag[t - s]
           of softmax_t(s),       softmax_t(s) = exp(z_ts) / sum_{s' <= t} exp(z_ts'),
           z_ts = scale * q_t . k_s  (scale 1/sqrt(d) unless given)

so an all-diagonals pattern keeps N (every query's softmax sums to 1) and an empty one 0.

`pattern_kept_mass` is the Triton kernel: one program per (query tile, batch x query head,
pattern) keeps the query tile on chip, makes the row-statistics pass of kernels/block_mass.py
(`_row_stats`) and a second pass over the causal key tiles that sums the normalised probabilities
on the pattern's pairs, reading the column mask by key and the diagonal mask by each pair's offset.
Each program writes its tile's sum; the tiles are summed afterwards (deterministic). Its PyTorch
reference is `pattern_kept_mass_ref` (fp32 probabilities of every pair: small inputs); the chunked
PyTorch pass of baselines/minference.py (`pattern_mass`) is the CPU path and a second reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_mass import _qk_tile, _query_tile, _row_stats
from .shapes import check_qk
from .triton_util import check_triton_launch, jit, tl, triton

TILE = 64  # query rows and keys per tile


def _check_masks(q: Tensor, on_cols: Tensor, on_diags: Tensor) -> None:
    b, hq, n, _ = q.shape
    for name, m in (("on_cols", on_cols), ("on_diags", on_diags)):
        if m.dim() != 4 or tuple(m.shape[1:]) != (b, hq, n):
            raise ValueError(f"{name} must be [P, {b}, {hq}, {n}], got {tuple(m.shape)}")
    if on_cols.shape[0] != on_diags.shape[0]:
        raise ValueError(
            f"on_cols and on_diags must hold as many patterns, got {on_cols.shape[0]} and "
            f"{on_diags.shape[0]}"
        )


def pattern_kept_mass_ref(
    q: Tensor, k: Tensor, on_cols: Tensor, on_diags: Tensor, scale: float | None = None
) -> Tensor:
    """fp32 [P, B, Hq]: the kept mass of each pattern, from the fp32 probabilities of every pair
    (O(N^2) memory per head: tests and small inputs). q [B, Hq, N, D], k [B, Hkv, N, D]; on_cols,
    on_diags bool [P, B, Hq, N] over keys and over offsets."""
    check_qk(q, k)
    _check_masks(q, on_cols, on_diags)
    b, hq, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = k.float().repeat_interleave(hq // k.shape[1], dim=1)
    z = torch.einsum("bhtd,bhsd->bhts", q.float(), kf) * scale
    pos = torch.arange(n, device=q.device)
    off = pos[:, None] - pos[None, :]  # [N, N] query - key
    causal = off >= 0
    p = torch.softmax(z.masked_fill(~causal, float("-inf")), dim=-1)
    out = []
    for cols, diags in zip(on_cols.bool(), on_diags.bool()):
        keep = (cols[:, :, None, :] | diags[:, :, off.clamp(min=0)]) & causal
        out.append((p * keep).sum((-1, -2)))
    return torch.stack(out)


@jit
def _pattern_mass_kernel(
    Q,
    K,
    Cols,
    Diags,
    Part,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_mp,  # the masks [P, B, Hq, N], contiguous over N
    stride_mb,
    stride_mh,
    stride_pp,  # the tiles' sums [P, B, Hq, tiles]
    stride_pb,
    stride_ph,
    stride_pi,
    n_ctx,
    heads,
    group,
    block_size,
    d_head,
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: a full-precision dot (no TF32)
    EVEN: tl.constexpr,
):
    # one program: query tile i of (batch, query head), for pattern program_id(2)
    i, b, h, offs, rows, in_block, row_ok, d_ok, q, k_base = _query_tile(
        Q, K, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kd,
        n_ctx, heads, group, block_size, d_head, BLOCK, BLOCK_D,
    )  # fmt: skip
    # pass 1: row max and normaliser over the causal key tiles 0..i
    m_safe, inv_l = _row_stats(
        q, k_base, stride_kn, i, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
        scale_log2, i, BLOCK, IEEE, EVEN,
    )  # fmt: skip
    pat = tl.program_id(2).to(tl.int64)
    cols_base = Cols + pat * stride_mp + b * stride_mb + h * stride_mh
    diags_base = Diags + pat * stride_mp + b * stride_mb + h * stride_mh
    # pass 2: the normalised probabilities on the pattern's pairs, summed over the tile
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, i + 1):
        cols = j * block_size + offs
        col_ok = in_block & (cols < n_ctx)
        s = _qk_tile(q, k_base, stride_kn, j, offs, col_ok, d_ok, block_size, IEEE)
        ok = col_ok[None, :] & (cols[None, :] <= rows[:, None]) & row_ok[:, None]
        on_col = tl.load(cols_base + cols, mask=col_ok, other=0) != 0
        on_diag = tl.load(diags_base + (rows[:, None] - cols[None, :]), mask=ok, other=0) != 0
        keep = ok & (on_col[None, :] | on_diag)
        p = tl.where(keep, tl.exp2(s * scale_log2 - m_safe[:, None]) * inv_l[:, None], 0.0)
        acc += tl.sum(p, 1)
    tl.store(Part + pat * stride_pp + b * stride_pb + h * stride_ph + i * stride_pi, tl.sum(acc, 0))


def pattern_kept_mass(
    q: Tensor, k: Tensor, on_cols: Tensor, on_diags: Tensor, scale: float | None = None
) -> Tensor:
    """Triton `pattern_kept_mass_ref`: fp32 [P, B, Hq], two causal QK^T passes per pattern and
    nothing of size N x N stored. q [B, Hq, N, D], k [B, Hkv, N, D] in fp32, fp16 or bf16 (one
    dtype); on_cols, on_diags [P, B, Hq, N] bool (or integer, nonzero = on)."""
    check_triton_launch("pattern_kept_mass", q, k)
    check_qk(q, k)
    _check_masks(q, on_cols, on_diags)
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    b, hq, n, d = q.shape
    npat = on_cols.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tiles = math.ceil(n / TILE)
    cols = on_cols.to(device=q.device, dtype=torch.int8).contiguous()
    diags = on_diags.to(device=q.device, dtype=torch.int8).contiguous()
    part = torch.zeros(npat, b, hq, tiles, device=q.device, dtype=torch.float32)
    if npat == 0:
        return part.sum(-1)
    block_d = max(16, triton.next_power_of_2(d))
    _pattern_mass_kernel[(tiles, b * hq, npat)](
        q, k, cols, diags, part, *q.stride(), *k.stride(), *cols.stride()[:3], *part.stride(),
        n, hq, hq // k.shape[1], TILE, d, scale * math.log2(math.e),
        BLOCK=TILE, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, EVEN=True, num_warps=4,
    )  # fmt: skip
    return part.sum(-1)
