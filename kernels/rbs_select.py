"""Fused RBS block selection: dual-branch scoring, relative thresholds, forced blocks, compaction.

For query head h, query block i and key block b < i (design.md §4), with token logits
    z(t, b) = (q_t . c_b + ||q_t||_2 * u_b) * scale     (u = 0: base branch; u = uplift: rescue)
the branch score is L[i, b] = logsumexp over the real tokens t of block i of z(t, b), and b is kept
when L[i, b] >= log(alpha) + max over b' < i of L[i, b'], or when it is forced (sink blocks, the
local window ending at the diagonal, the last query rows); only b <= i is ever kept.

`rbs_select` is the Triton path; `rbs_select_ref` its PyTorch reference (the scores from
`block_scores_ref`, the mask rule below). Two launches, no host sync:

- `_rbs_prep_kernel` centres the centroids per KV head (c_b = c_mean + r_b; what the tensor-core
  dot reads is r_b, in fp16 for fp16/bf16 queries, fp32 for fp32 ones; `centred_centroids` gives
  the same values) and stores them in a scoring order: key blocks whose uplift is exactly 0 (beta
  = 0, every block at or below the median radius for rbs) first, the others from the end. A
  zero-uplift block's rescue score equals its base score, so its tiles are scored once for both
  branches: about a quarter fewer exponentials for rbs.
- `_rbs_select_kernel` is persistent: each program takes (query block, head) rows, longest first,
  keeps the 128-token query tile on chip, scores the key tiles with one `tl.dot` against a tile
  of centroids, writes the row's scores to its own scratch row (by key-block id), then
  thresholds them and writes the kept ids compacted with a prefix sum. Scores are in log2 units
  (scale * log2 e folded into the logits) and exact: each key block's largest token logit is
  subtracted before its exponentials, so their time does not depend on the logits' range (the
  earlier one-offset-per-row path, `fast`, redid rows near fp32's overflow: 1.7x slower on the
  `needles` inputs of `rbs_bench.synthetic`). Neither the N x M token logits nor the M x M scores
  reach device memory. `_launch` keeps the other scoring paths (fast; two_pass, bounds first;
  rescue_bound, rescue tiles skipped where bounded) as options; docs/kernels.md has their
  timings.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_masks import candidate_mask, compact_mask, forced_mask, relative_threshold
from .block_scores import block_scores_ref
from .triton_util import INTERPRET, check_triton_launch, jit, tl, triton

try:  # the special-function unit's log2 (fast_log); triton >= 3.0 has it here
    from triton.language.extra import libdevice
except ImportError:  # no triton: the references only
    libdevice = None
_INTERPRETED = tl.constexpr(INTERPRET) if tl is not None else INTERPRET

# a real call: the callee's loop invariants are not hoisted into the caller's loop
_jit_call = triton.jit(noinline=True) if triton is not None else jit

BRANCHES = ("both", "base", "rescue")
# log2 units a tile's rescue bounds must lie below the running threshold for its rescue
# exponentials to be skipped (`_score_row`, BOUND): far above the fp32 rounding of the scores
# (about 1e-5 at logits of 100), so a skipped block's exact score could not have reached it
BOUND_SLACK = tl.constexpr(1e-3) if tl is not None else 1e-3


# ---------------------------------------------------------------- the mask rule (pure PyTorch)


def centred_centroids(centroid: Tensor, dot_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(mean fp32 [B, Hkv, D], residuals [B, Hkv, M, D] in the dot's dtype) of the centroids."""
    mean = centroid.float().mean(2)
    return mean, (centroid.float() - mean[:, :, None]).to(dot_dtype)


def _branches(branches: str) -> tuple[bool, bool]:
    if branches not in BRANCHES:
        raise ValueError(f"branches must be one of {', '.join(BRANCHES)}; got {branches!r}")
    return branches != "rescue", branches != "base"


def _check_inputs(q, centroid, uplift_rescue, block_size, rescue) -> None:
    if q.dim() != 4 or centroid.dim() != 4:
        raise ValueError(
            f"q must be [B, Hq, N, D] and centroid [B, Hkv, M, D]; got {tuple(q.shape)}, "
            f"{tuple(centroid.shape)}"
        )
    b, hq, n, d = q.shape
    hkv, m = centroid.shape[1], math.ceil(n / block_size)
    if centroid.shape[0] != b or centroid.shape[2:] != (m, d):
        raise ValueError(
            f"centroid must be [B, Hkv, M, D] = [{b}, Hkv, {m}, {d}] for N={n}, "
            f"block_size={block_size}; got {tuple(centroid.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if rescue and (uplift_rescue is None or tuple(uplift_rescue.shape) != (b, hkv, m)):
        got = None if uplift_rescue is None else tuple(uplift_rescue.shape)
        raise ValueError(
            f"the rescue branch needs uplift_rescue [B, Hkv, M] = {(b, hkv, m)}; got {got}"
        )


def rbs_select_ref(
    q: Tensor,
    centroid: Tensor,
    uplift_rescue: Tensor | None,
    block_size: int,
    alpha_base: float,
    alpha_rescue: float,
    sink_blocks: int,
    window_blocks: int,
    last_q_blocks: int,
    scale: float | None = None,
    branches: str = "both",
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of `rbs_select`: the same (kv_count, kv_indices), zeros past the count."""
    base, rescue = _branches(branches)
    _check_inputs(q, centroid, uplift_rescue, block_size, rescue)
    uplifts = ([None] if base else []) + ([uplift_rescue] if rescue else [])
    alphas = ([alpha_base] if base else []) + ([alpha_rescue] if rescue else [])
    scores = block_scores_ref(q, centroid, uplifts, block_size, scale)
    m = centroid.shape[2]
    keep = forced_mask(m, sink_blocks, window_blocks, last_q_blocks, q.device)
    keep = keep.expand(*q.shape[:2], m, m)
    cand = candidate_mask(m, q.device)
    for s, alpha in zip(scores, alphas):
        keep = keep | relative_threshold(s, cand, alpha)
    return compact_mask(keep)


# ---------------------------------------------------------------------------- the Triton kernels


@jit
def _rbs_prep_kernel(
    C,
    Cmean,
    U,
    Res,
    Uperm,
    Inv,
    Zc,
    stride_cb,
    stride_ch,
    stride_cm,
    stride_cd,
    stride_mb,
    stride_mh,
    stride_md,
    stride_ub,
    stride_uh,
    stride_um,
    stride_rb,
    stride_rh,
    stride_rm,
    stride_rd,
    stride_pb,
    stride_ph,
    stride_pm,
    stride_vb,
    stride_vh,
    stride_vm,
    stride_zb,
    stride_zh,
    stride_zm,
    m_blocks,
    heads,
    d_head,
    ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Centred centroids in the scoring order, with the order's bookkeeping (one chunk/program).

    Blocks with uplift exactly 0 (beta = 0: every block at or below the median radius) go first,
    ascending; the others fill the buffer from its end down, ascending ids at descending
    positions. For query block i the candidates b < i are then the first Zc[i] positions and the
    last i - Zc[i]: two ranges that never share a position, each scored by whole key tiles, and
    the zero-uplift tiles need no rescue score (it equals the base score). The positions no block
    takes hold zeros, so the scoring loads need no row masks.
    """
    bh = tl.program_id(0)
    j = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    rows = j * BLOCK_C + tl.arange(0, BLOCK_C)  # ids; those past M fill the unused positions
    rok = rows < m_blocks
    pad = rows - m_blocks
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d_head
    u_row = U + b * stride_ub + h * stride_uh
    if ORDER == 1:  # zero-uplift blocks first
        offs = tl.arange(0, BLOCK_M)
        zero_all = (tl.load(u_row + offs * stride_um, mask=offs < m_blocks, other=1.0) == 0.0).to(
            tl.int32
        )
        before = tl.sum(tl.where(offs < j * BLOCK_C, zero_all, 0), 0)
        u = tl.load(u_row + rows * stride_um, mask=rok, other=0.0)
        zero = ((u == 0.0) & rok).to(tl.int32)
        zc = before + tl.cumsum(zero, 0) - zero  # zero-uplift blocks before this one
        pos = tl.where(zero != 0, zc, BLOCK_M - 1 - (rows - zc))
        pos = tl.where(rok, pos, tl.sum(zero_all, 0) + pad)
    elif ORDER == 2:  # every block uplifted (no sharing)
        u = tl.load(u_row + rows * stride_um, mask=rok, other=0.0)
        zc = rows * 0
        pos = tl.where(rok, BLOCK_M - 1 - rows, pad)
    else:  # base branch only: key-block order
        zc = rows
        pos = rows
    if ORDER != 0:
        tl.store(Uperm + b * stride_pb + h * stride_ph + pos * stride_pm, u)
    inv_head = Inv + b * stride_vb + h * stride_vh
    tl.store(inv_head + rows * stride_vm, pos, mask=rok)  # Inv[:M]: id -> position
    tl.store(inv_head + (BLOCK_M + pos) * stride_vm, rows)  # Inv[BLOCK_M:]: position -> id
    tl.store(Zc + b * stride_zb + h * stride_zh + rows * stride_zm, zc, mask=rok)
    c_ptrs = C + b * stride_cb + h * stride_ch + rows[:, None] * stride_cm
    c = tl.load(c_ptrs + offs_d[None, :] * stride_cd, mask=rok[:, None] & d_ok[None, :], other=0.0)
    mean = tl.load(Cmean + b * stride_mb + h * stride_mh + offs_d * stride_md, mask=d_ok)
    res = tl.where(rok[:, None], c - mean[None, :], 0.0).to(Res.dtype.element_ty)
    r_ptrs = Res + b * stride_rb + h * stride_rh + pos[:, None] * stride_rm
    tl.store(r_ptrs + offs_d[None, :] * stride_rd, res, mask=d_ok[None, :])


@jit
def _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32: tl.constexpr):
    c_ptrs = c_head + pos[:, None] * stride_cm + offs_d[None, :] * stride_cd
    c = tl.load(c_ptrs, mask=d_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
    if DOT_F32:
        return tl.dot(c, q_t, input_precision="ieee")
    return tl.dot(c, q_t)  # [BLOCK_K, BLOCK_Q] fp32


@jit
def _lse(x, off, EXACT: tl.constexpr):
    """off + log2 sum_t 2^x[:, t]; EXACT (1 or 2) subtracts each row's maximum first, and 2
    takes the logarithm of the sum (in [1, BLOCK_Q]) with the special-function unit's
    approximate log2 (`lg2.approx`, relative error about 2^-22) instead of the libdevice one
    (about 30 instructions each); the interpreter has no such instruction and keeps log2."""
    if EXACT:
        mx = tl.max(x, 1)
        total = tl.sum(tl.exp2(x - mx[:, None]), 1)
        if EXACT == 2 and not _INTERPRETED:
            return off + mx + libdevice.fast_log2f(total)
        return off + mx + tl.log2(total)
    return off + tl.log2(tl.sum(tl.exp2(x), 1))


@jit
def _rescue_scores(x, u, q_norm, cand, off, top_r, EXACT: tl.constexpr):
    """An uplifted tile's exact rescue scores (-inf off the candidates) and the row's rescue
    maximum with them: the logits x plus each block's uplift times each token's norm."""
    lse_r = tl.where(cand, _lse(x + u[:, None] * q_norm[None, :], off, EXACT), float("-inf"))
    return lse_r, tl.maximum(top_r, tl.max(lse_r, 0))


@jit
def _score_row(
    c_head,
    u_head,
    perm_head,
    S0,
    S1,
    stride_cm,
    stride_cd,
    stride_um,
    stride_pm,
    offs_d,
    d_ok,
    q_t,
    qk_scale,
    bias,
    q_norm,
    qn_max,
    qn_min,
    log2_alpha_rescue,
    off,
    cz,
    cp,
    BASE: tl.constexpr,
    RESCUE: tl.constexpr,
    DOT_F32: tl.constexpr,
    EXACT: tl.constexpr,
    BOUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Scores of one query block against its candidates, stored by key-block id (one pass).

    S0[b] gets the base score, S1[b] the rescue score. The zero-uplift key blocks (positions
    [0, cz)) get one score for both branches; the uplifted ones (positions [BLOCK_M - cp,
    BLOCK_M), whole tiles from the end) both. Returns the row's top scores of the branches and
    the count of candidates whose rescue score is a bound (BOUND, below).

    EXACT subtracts each key block's own token maximum before exponentiating (no logit range
    can overflow or underflow). Otherwise one offset `off` serves the whole row: off =
    max_t z(t, 0), block 0 being a candidate of every scored row, so every block whose score
    can reach a threshold (L >= max L + log2 alpha >= off + log2 alpha) sums terms far above
    fp32's underflow; the caller checks that no score came near overflow (L > off + 100) and
    otherwise redoes the row exactly.

    BOUND (with BASE): an uplifted tile's rescue scores lie between bounds from its base scores,
    L_b + u_b * qn_min <= L_r <= L_b + u_b * qn_max (qn_min, qn_max: the least and largest
    ||q_t|| * scale of the query block's tokens). The lower bounds and the exact rescue scores
    so far give a lower bound of the row's rescue maximum; when every upper bound of the tile
    lies `BOUND_SLACK` below it plus log2 alpha_rescue (never above the final threshold), no
    block of the tile can be kept by the rescue branch or hold its maximum, so the upper bounds
    are stored in place of the scores and the tile's second set of exponentials is skipped: the
    kept blocks are the same. The uplifted tiles then start with the one nearest the diagonal.
    """
    offs_k = tl.arange(0, BLOCK_K)
    top_b = float("-inf")
    top_r = float("-inf")
    n_bound = 0  # candidates whose rescue score is their bound (BOUND)
    for t in range(0, tl.cdiv(cz, BLOCK_K)):
        pos = t * BLOCK_K + offs_k
        cand = pos < cz
        ids = tl.load(perm_head + pos * stride_pm)
        s = _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32)
        lse = tl.where(cand, _lse(s * qk_scale + bias[None, :], off, EXACT), float("-inf"))
        if BASE:
            tl.store(S0 + ids, lse, mask=cand)
            top_b = tl.maximum(top_b, tl.max(lse, 0))
        if RESCUE:
            tl.store(S1 + ids, lse, mask=cand)
            top_r = tl.maximum(top_r, tl.max(lse, 0))
    n_up = tl.cdiv(cp, BLOCK_K)
    lb_r = float("-inf")  # BOUND: a lower bound of the row's rescue maximum, from base scores
    for step in range(0, n_up):
        t = step
        if BOUND:  # the tile nearest the diagonal first: its blocks tend to score highest
            t = (step + n_up - 1) % n_up
        pos = BLOCK_M - (t + 1) * BLOCK_K + offs_k
        cand = pos >= BLOCK_M - cp
        ids = tl.load(perm_head + pos * stride_pm)
        u = tl.load(u_head + pos * stride_um)
        s = _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32)
        x = s * qk_scale + bias[None, :]
        if BASE:
            lse_b = tl.where(cand, _lse(x, off, EXACT), float("-inf"))
            tl.store(S0 + ids, lse_b, mask=cand)
            top_b = tl.maximum(top_b, tl.max(lse_b, 0))
        if BOUND:
            ub = tl.where(cand, lse_b + u * qn_max, float("-inf"))
            lb_r = tl.maximum(lb_r, tl.max(tl.where(cand, lse_b + u * qn_min, float("-inf")), 0))
            if tl.max(ub, 0) < tl.maximum(top_r, lb_r) + log2_alpha_rescue - BOUND_SLACK:
                lse_r = ub  # below the final threshold and maximum: top_r stays exact
                n_bound += tl.sum(cand.to(tl.int32), 0)
            else:
                lse_r, top_r = _rescue_scores(x, u, q_norm, cand, off, top_r, EXACT)
        else:
            lse_r, top_r = _rescue_scores(x, u, q_norm, cand, off, top_r, EXACT)
        tl.store(S1 + ids, lse_r, mask=cand)
    return top_b, top_r, n_bound


@jit
def _bound_row(
    c_head,
    u_head,
    perm_head,
    S0,
    S1,
    S2,
    S3,
    stride_cm,
    stride_cd,
    stride_um,
    stride_pm,
    offs_d,
    d_ok,
    q_t,
    qk_scale,
    bias,
    mean_bias,
    inv_real,
    qn_max,
    qn_mean,
    cz,
    cp,
    DOT_F32: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Pass one of the two-pass scoring: bounds of every candidate's scores, no exponentials.

    With x(t, b) the token logits relative to the row's offset and n real tokens, a block's
    score L - off = log2 sum_t 2^x lies in [mean_t x + log2 n, max_t x + log2 n] (Jensen's
    inequality and the largest term). Stored by key-block id: S0 max_t x and S2 mean_t x of
    the base branch, S1 / S3 the same of the rescue branch, whose logits add u_b ||q_t||:
    bounded by max_t x + u_b max_t ||q_t|| and equal in mean to mean_t x + u_b mean_t ||q_t||.
    The mean comes from the raw dot products (padded tokens' rows of q are 0) plus the
    tokens' mean bias, so each element costs one FMA, one max and one add.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for t in range(0, tl.cdiv(cz, BLOCK_K)):
        pos = t * BLOCK_K + offs_k
        cand = pos < cz
        ids = tl.load(perm_head + pos * stride_pm)
        s = _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32)
        mx = tl.max(s * qk_scale + bias[None, :], 1)
        mean = tl.sum(s, 1) * (qk_scale * inv_real) + mean_bias
        tl.store(S0 + ids, mx, mask=cand)
        tl.store(S2 + ids, mean, mask=cand)
        tl.store(S1 + ids, mx, mask=cand)  # zero uplift: the rescue logits are the base ones
        tl.store(S3 + ids, mean, mask=cand)
    for t in range(0, tl.cdiv(cp, BLOCK_K)):
        pos = BLOCK_M - (t + 1) * BLOCK_K + offs_k
        cand = pos >= BLOCK_M - cp
        ids = tl.load(perm_head + pos * stride_pm)
        u = tl.load(u_head + pos * stride_um)
        s = _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32)
        mx = tl.max(s * qk_scale + bias[None, :], 1)
        mean = tl.sum(s, 1) * (qk_scale * inv_real) + mean_bias
        tl.store(S0 + ids, mx, mask=cand)
        tl.store(S2 + ids, mean, mask=cand)
        tl.store(S1 + ids, mx + u * qn_max, mask=cand)
        tl.store(S3 + ids, mean + u * qn_mean, mask=cand)


@jit
def _rescore_live(
    c_head,
    u_head,
    inv_head,
    Live,
    S0,
    S1,
    n_live,
    stride_cm,
    stride_cd,
    stride_um,
    stride_vm,
    offs_d,
    d_ok,
    q_t,
    qk_scale,
    bias,
    q_norm,
    off,
    BASE: tl.constexpr,
    RESCUE: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pass two: exact scores (per-block maxima subtracted) of the n_live ids listed in Live,
    gathered in tiles of BLOCK_K; S0 / S1 get the base / rescue scores by id."""
    offs_k = tl.arange(0, BLOCK_K)
    for t in range(0, tl.cdiv(n_live, BLOCK_K)):
        slot = t * BLOCK_K + offs_k
        ok = slot < n_live
        ids = tl.load(Live + slot, mask=ok, other=0)
        pos = tl.load(inv_head + ids * stride_vm)  # Inv[:M]: id -> position
        s = _tile_dot(c_head, pos, offs_d, d_ok, stride_cm, stride_cd, q_t, DOT_F32)
        x = s * qk_scale + bias[None, :]
        if BASE:
            tl.store(S0 + ids, _lse(x, off, True), mask=ok)
        if RESCUE:
            u = tl.load(u_head + pos * stride_um)
            tl.store(S1 + ids, _lse(x + u[:, None] * q_norm[None, :], off, True), mask=ok)


@_jit_call
def _select_row(
    w,
    Q,
    C,
    Cmean,
    U,
    Inv,
    Zc,
    S0,
    S1,
    S2,
    S3,
    Live,
    Count,
    Index,
    Stats,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_cb,
    stride_ch,
    stride_cm,
    stride_cd,
    stride_mb,
    stride_mh,
    stride_md,
    stride_ub,
    stride_uh,
    stride_um,
    stride_vb,
    stride_vh,
    stride_vm,
    stride_zb,
    stride_zh,
    stride_zm,
    stride_nb,
    stride_nh,
    stride_nm,
    stride_ib,
    stride_ih,
    stride_im,
    stride_ik,
    n_ctx,
    m_blocks,
    batch_heads,
    heads,
    group,
    block_size,
    d_head,
    qk_scale,  # scale * log2(e): scores in log2 units
    log2_alpha_base,
    log2_alpha_rescue,
    sink_blocks,
    window_blocks,
    last_q_blocks,
    scored_from,  # sink_blocks + max(window_blocks, 1): rows below it have only forced candidates
    BASE: tl.constexpr,
    RESCUE: tl.constexpr,
    DOT_F32: tl.constexpr,
    FAST: tl.constexpr,
    TWO_PASS: tl.constexpr,
    STATS: tl.constexpr,
    OFF_MEAN: tl.constexpr,
    BOUND: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One query block of one (batch, query head): row w of the longest-first row list."""
    offs_t = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d_head
    cols = tl.arange(0, BLOCK_M)
    i = m_blocks - 1 - w // batch_heads
    bh = w % batch_heads
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    tok = i * block_size + offs_t
    real = (offs_t < block_size) & (tok < n_ctx)  # [BLOCK_Q] real tokens of query block i
    q_ptrs = Q + b * stride_qb + h * stride_qh + tok[:, None] * stride_qn
    q_ptrs = q_ptrs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=real[:, None] & d_ok[None, :], other=0.0)
    qf = q.to(tl.float32)
    q_norm = tl.sqrt(tl.sum(qf * qf, 1)) * qk_scale  # [BLOCK_Q]
    c_mean = tl.load(Cmean + b * stride_mb + hk * stride_mh + offs_d * stride_md, mask=d_ok)
    q_mean = tl.sum(qf * c_mean[None, :], 1) * qk_scale  # [BLOCK_Q] q_t . c_mean, fp32
    tok_bias = tl.where(real, q_mean, float("-inf"))  # padded tokens add nothing to the sums
    if DOT_F32:
        q_t = tl.trans(qf)  # [BLOCK_D, BLOCK_Q]
    else:
        q_t = tl.trans(tl.minimum(tl.maximum(qf, -65504.0), 65504.0).to(tl.float16))

    # Rows whose candidates are all forced need no scores.
    last_rows = i >= m_blocks - last_q_blocks
    scoring = (i < m_blocks - last_q_blocks) & (i >= scored_from)
    c_head = C + b * stride_cb + hk * stride_ch
    u_head = U + b * stride_ub + hk * stride_uh
    inv_head = Inv + b * stride_vb + hk * stride_vh
    cz = tl.load(Zc + b * stride_zb + hk * stride_zh + i * stride_zm, mask=scoring, other=0)
    cz = tl.where(scoring, cz, 0)
    cp = tl.where(scoring, i - cz, 0)
    if OFF_MEAN:  # the row's offset: the largest token logit against the mean centroid
        off = tl.max(tok_bias, 0)
    else:  # the largest token logit against key block 0
        r0 = tl.load(c_head + tl.load(inv_head) * stride_cm + offs_d * stride_cd, mask=d_ok)
        off = tl.max(tl.sum(qf * r0.to(tl.float32)[None, :], 1) * qk_scale + tok_bias, 0)
    bias = tok_bias - off  # padded tokens: -inf

    tl.debug_barrier()  # the previous row's reads of the scratch are done
    perm_head = inv_head + BLOCK_M * stride_vm
    inrow = cols < tl.where(scoring, i, 0)  # scored candidates, key-block order
    if TWO_PASS:
        # Pass one: bounds of every candidate's scores. A block is live when its upper bound
        # reaches the threshold that the best lower bound already implies (both relative to
        # off; log2 n cancels). 0.05 (log2 units) of slack covers the rounding between the
        # passes' arithmetic: it only makes more blocks live.
        n_real = tl.sum(real.to(tl.float32), 0)
        mean_bias = tl.sum(tl.where(real, bias, 0.0), 0) / n_real
        qn_max = tl.max(tl.where(real, q_norm, 0.0), 0)
        qn_mean = tl.sum(tl.where(real, q_norm, 0.0), 0) / n_real
        _bound_row(
            c_head, u_head, perm_head, S0, S1, S2, S3, stride_cm, stride_cd, stride_um,
            stride_vm, offs_d, d_ok, q_t, qk_scale, bias, mean_bias, 1.0 / n_real, qn_max,
            qn_mean, cz, cp, DOT_F32, BLOCK_K, BLOCK_M,
        )  # fmt: skip
        tl.debug_barrier()  # every bound of the row is in the scratch
        live = cols < 0
        if BASE:
            hi = tl.load(S0 + cols, mask=inrow, other=float("-inf"))
            lo = tl.load(S2 + cols, mask=inrow, other=float("-inf"))
            live = live | (hi >= tl.max(lo, 0) + log2_alpha_base - 0.05)
        if RESCUE:
            hi = tl.load(S1 + cols, mask=inrow, other=float("-inf"))
            lo = tl.load(S3 + cols, mask=inrow, other=float("-inf"))
            live = live | (hi >= tl.max(lo, 0) + log2_alpha_rescue - 0.05)
        live = live & inrow
        l32 = live.to(tl.int32)
        n_live = tl.sum(l32, 0)
        tl.store(Live + tl.cumsum(l32, 0) - l32, cols, mask=live)
        tl.debug_barrier()  # the live list is written and the bounds are read
        # Pass two: exact scores of the live blocks; the others stay below every threshold.
        _rescore_live(
            c_head, u_head, inv_head, Live, S0, S1, n_live, stride_cm, stride_cd, stride_um,
            stride_vm, offs_d, d_ok, q_t, qk_scale, bias, q_norm, off, BASE, RESCUE, DOT_F32,
            BLOCK_K,
        )  # fmt: skip
        scored = live
        n_bound = 0
    else:
        qn_max = tl.max(q_norm, 0)  # padded tokens: 0
        qn_min = tl.min(tl.where(real, q_norm, float("inf")), 0)
        top_b, top_r, n_bound = _score_row(
            c_head, u_head, perm_head, S0, S1, stride_cm, stride_cd, stride_um, stride_vm,
            offs_d, d_ok, q_t, qk_scale, bias, q_norm, qn_max, qn_min, log2_alpha_rescue, off,
            cz, cp, BASE, RESCUE, DOT_F32, (FAST != 1) * (1 + (FAST == 2)), BOUND, BLOCK_K,
            BLOCK_M,
        )  # fmt: skip
        if FAST == 1:
            ok = True
            if BASE:
                ok = (top_b <= off + 100.0) & (top_b >= off - 60.0)
            if RESCUE:
                ok = ok & (top_r <= off + 100.0) & (top_r >= off - 60.0)
            if scoring & (ok == 0):  # a score near fp32's overflow: redo with per-block maxima
                _, _, n_bound = _score_row(
                    c_head, u_head, perm_head, S0, S1, stride_cm, stride_cd, stride_um,
                    stride_vm, offs_d, d_ok, q_t, qk_scale, bias, q_norm, qn_max, qn_min,
                    log2_alpha_rescue, off, cz, cp, BASE, RESCUE, DOT_F32, True, BOUND, BLOCK_K,
                    BLOCK_M,
                )  # fmt: skip
        scored = inrow
    tl.debug_barrier()  # every score of the row is in the scratch

    # Thresholds, read back in key-block order.
    lse_b = tl.load(S0 + cols, mask=scored, other=float("-inf"))
    picked = cols < 0
    if BASE:
        picked = picked | (lse_b >= tl.max(lse_b, 0) + log2_alpha_base)
    if RESCUE:
        lse_r = tl.load(S1 + cols, mask=scored, other=float("-inf"))
        picked = picked | (lse_r >= tl.max(lse_r, 0) + log2_alpha_rescue)
    if STATS:  # candidates, those pass two scored (all in one pass), rescue scores bounded
        tl.atomic_add(Stats, tl.sum(inrow.to(tl.int64), 0))
        tl.atomic_add(Stats + 1, tl.sum(scored.to(tl.int64), 0))
        tl.atomic_add(Stats + 2, n_bound.to(tl.int64))
    window_lo = tl.where(last_rows, -1, i - window_blocks)  # the last rows keep every b <= i
    keep = (cols < sink_blocks) | (cols > window_lo) | (picked & scored)
    keep = keep & (cols <= i)

    # Compaction: position = kept ids before this one.
    k32 = keep.to(tl.int32)
    slot = tl.cumsum(k32, 0) - k32
    count = tl.sum(k32, 0)
    out = Index + b * stride_ib + h * stride_ih + i * stride_im
    tl.store(out + slot * stride_ik, cols, mask=keep)
    zero = tl.zeros_like(cols)
    tl.store(out + cols * stride_ik, zero, mask=(cols >= count) & (cols < m_blocks))
    tl.store(Count + b * stride_nb + h * stride_nh + i * stride_nm, count)


_select_row_inlined = jit(_select_row.fn) if triton is not None else _select_row

# The persistent kernel takes the row's parameters, written once in `_select_row`'s signature:
# the program's scratch (Scratch, LiveScratch) in place of the row's slices of it, and CALL (the
# row as a called function, or inlined into the loop) in place of the row index w.
_ROW_ONLY = ("w", "S0", "S1", "S2", "S3", "Live")
_PERSISTENT = """
def _rbs_select_kernel({params}):
    # Persistent: program p takes rows p, p + P, ... of the (query block, batch x head) list,
    # longest rows first; its scratch holds one row's scores (and with TWO_PASS their bounds
    # and the live list) at a time. The row is a called function so that its loop invariants
    # stay out of this loop's registers.
    pid = tl.program_id(0).to(tl.int64)
    S0 = Scratch + pid * (4 * BLOCK_M)
    S1 = S0 + BLOCK_M
    S2 = S1 + BLOCK_M
    S3 = S2 + BLOCK_M
    Live = LiveScratch + pid * BLOCK_M
    for w in range(tl.program_id(0), m_blocks * batch_heads, tl.num_programs(0)):
        (_select_row if CALL else _select_row_inlined)({args})
"""


def _persistent_kernel(row):
    """`_rbs_select_kernel`, the persistent loop around `row` (`_select_row`), built from the
    row's signature so that its ~60 parameters are written in one place. Triton compiles a
    kernel from its source text, so the text is registered with `linecache` under a name of
    this file, where `inspect` (and through it Triton) finds it."""
    import inspect
    import linecache

    sig = inspect.signature(getattr(row, "fn", row))
    names = list(sig.parameters)
    constexpr = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
    params = []
    for name in names:
        if name == "S0":
            params += ["Scratch", "LiveScratch"]
        elif name not in _ROW_ONLY:
            params.append(f"{name}: tl.constexpr" if name in constexpr else name)
    params.append("CALL: tl.constexpr")
    src = _PERSISTENT.format(params=", ".join(params), args=", ".join(names))
    filename = f"{__file__}:_rbs_select_kernel"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    exec(compile(src, filename, "exec"), globals())  # defines the plain function here
    return jit(globals()["_rbs_select_kernel"])


_rbs_select_kernel = _persistent_kernel(_select_row)


_SM_COUNT: dict = {}


def _programs(device: torch.device, rows: int, per_sm: int) -> int:
    """Persistent grid size: `per_sm` programs per multiprocessor (a few under the interpreter)."""
    if device.type != "cuda":
        return max(1, min(rows, 3))
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, per_sm * _SM_COUNT[device]))


def _launch(
    q,
    centroid,
    uplift_rescue,
    block_size,
    alpha_base,
    alpha_rescue,
    sink_blocks,
    window_blocks,
    last_q_blocks,
    scale,
    branches,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    maxnreg: int | None = 168,
    fast: bool = False,
    share: bool = True,
    per_sm: int = 3,
    call: bool = True,
    offset: str = "block0",
    two_pass: bool = False,
    stats: Tensor | None = None,
    fast_log: bool = False,
    rescue_bound: bool = False,
):
    """`rbs_select` with the launch configuration open (for tests and tuning).

    By default one pass scores every candidate exactly (each key block's token maximum
    subtracted before exponentiating: no logit range needs a second look). fast: one exponent
    offset per row with an exact redo of rows near fp32's overflow (the earlier path; on inputs
    with logits of 40-60 the redo made it 1.7x slower). two_pass: pass one bounds every
    candidate's score from its token logits' maximum and mean (no exponentials), pass two scores
    exactly only the blocks whose upper bound reaches the threshold that the best lower bound
    implies (3-34% of them on the synthetic families); measured slower on an H100 (3.2 ms
    against 2.8 at 128K), the exponentials not being what bounds the kernel (docs/kernels.md).
    share: score zero-uplift key blocks once for both branches; per_sm: persistent programs per
    multiprocessor, to match the occupancy that the registers (maxnreg) and shared memory allow
    (168 registers and 66 KB: 3 programs of 4 warps on a Hopper SM); call: the row as a called
    function (False: inlined into the persistent loop, whose registers then hold the row's loop
    invariants); offset: the row's exponent offset, the largest logit against key block 0
    ("block0": scores that matter cannot underflow) or against the mean centroid ("mean": one
    reduction less; with fast, the redo covers rows where it misses by more than 2^60). stats:
    int64 [3], if given, accumulates the scored candidates, those scored exactly (pass two's
    live blocks; all of them in one pass) and those whose rescue score is a bound
    (rescue_bound). fast_log: the one exact pass with each block's logarithm from the
    special-function unit (`_lse`); ignored with fast or two_pass.
    rescue_bound: with both branches in one pass, skip the rescue exponentials of an uplifted
    tile whose bounds from its base scores lie below the running rescue threshold (`_score_row`,
    BOUND); the kept blocks are the same.
    """
    base, rescue = _branches(branches)
    check_triton_launch("rbs_select", q, centroid, uplift_rescue if rescue else None)
    _check_inputs(q, centroid, uplift_rescue, block_size, rescue)
    b, hq, n, d = q.shape
    hkv, m = centroid.shape[1], centroid.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dot_f32 = q.dtype == torch.float32

    def log2a(alpha: float) -> float:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        return math.log2(alpha) if alpha > 0 else -math.inf

    log2_alphas = [log2a(a) for a, on in ((alpha_base, base), (alpha_rescue, rescue)) if on]
    # the one-offset scores resolve thresholds down to about 2^-60 below the row maximum
    fast = fast and all(a >= -50 or a == -math.inf for a in log2_alphas)
    two_pass = two_pass and not fast  # fast keeps its one offset per row
    block_k = min(block_k, max(16, triton.next_power_of_2(m)))
    block_m = max(block_k, triton.next_power_of_2(m))
    block_d = max(16, triton.next_power_of_2(d))
    order = (1 if share else 2) if rescue else 0

    # centred centroids (as `centred_centroids`) in scoring order, and the order's bookkeeping
    centroid = centroid.float()
    c_mean = centroid.mean(2)
    res_dtype = torch.float32 if dot_f32 else torch.float16
    res = torch.empty(b, hkv, block_m, d, device=q.device, dtype=res_dtype)
    u = uplift_rescue.float() if rescue else centroid.new_zeros(1, 1, 1)
    u_perm = torch.empty(b, hkv, block_m, device=q.device) if rescue else u
    inv = torch.empty(b, hkv, 2 * block_m, device=q.device, dtype=torch.int32)
    zc = torch.empty(b, hkv, m, device=q.device, dtype=torch.int32)
    block_c = min(64, block_m)
    _rbs_prep_kernel[(b * hkv, block_m // block_c)](
        centroid,
        c_mean,
        u,
        res,
        u_perm,
        inv,
        zc,
        *centroid.stride(),
        *c_mean.stride(),
        *u.stride(),
        *res.stride(),
        *u_perm.stride(),
        *inv.stride(),
        *zc.stride(),
        m,
        hkv,
        d,
        ORDER=order,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
        num_warps=4,
    )

    count = torch.empty(b, hq, m, device=q.device, dtype=torch.int32)
    index = torch.empty(b, hq, m, m, device=q.device, dtype=torch.int32)
    extra = {} if maxnreg is None or q.device.type != "cuda" else {"maxnreg": maxnreg}
    programs = _programs(q.device, b * hq * m, per_sm)
    scratch = torch.empty(programs, 4, block_m, device=q.device)
    live = torch.empty(programs, block_m, device=q.device, dtype=torch.int32)
    _rbs_select_kernel[(programs,)](
        q,
        res,
        c_mean,
        u_perm,
        inv,
        zc,
        scratch,
        live,
        count,
        index,
        count if stats is None else stats,
        *q.stride(),
        *res.stride(),
        *c_mean.stride(),
        *u_perm.stride(),
        *inv.stride(),
        *zc.stride(),
        *count.stride(),
        *index.stride(),
        n,
        m,
        b * hq,
        hq,
        hq // hkv,
        block_size,
        d,
        scale * math.log2(math.e),
        log2a(alpha_base),
        log2a(alpha_rescue),
        sink_blocks,
        window_blocks,
        last_q_blocks,
        sink_blocks + max(window_blocks, 1),
        BASE=base,
        RESCUE=rescue,
        DOT_F32=dot_f32,
        FAST=1 if fast else (2 if fast_log else 0),
        TWO_PASS=two_pass,
        STATS=stats is not None,
        CALL=call,
        OFF_MEAN=offset == "mean",
        BOUND=rescue_bound and base and rescue and not two_pass,
        BLOCK_Q=max(16, triton.next_power_of_2(block_size)),
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        num_warps=num_warps,
        num_stages=num_stages,
        **extra,
    )
    return count, index


def rbs_select(
    q: Tensor,
    centroid: Tensor,
    uplift_rescue: Tensor | None,
    block_size: int,
    alpha_base: float,
    alpha_rescue: float,
    sink_blocks: int,
    window_blocks: int,
    last_q_blocks: int,
    scale: float | None = None,
    branches: str = "both",
) -> tuple[Tensor, Tensor]:
    """Kept key blocks per query head: (kv_count int32 [B, Hq, M], kv_indices int32 [B, Hq, M, M]).

    q [B, Hq, N, D] (fp32, fp16 or bf16); centroid fp32 [B, Hkv, M, D] with M = ceil(N /
    block_size); uplift_rescue [B, Hkv, M] is the rescue branch's per-key-block uplift (r * beta
    for rbs, r for the full L2 bound; unused when branches="base"). Query head h reads KV head
    h // (Hq // Hkv). alpha_base / alpha_rescue are the relative thresholds of the branches that
    `branches` ("both", "base", "rescue") turns on. kv_indices holds the kept ids ascending and
    zeros past kv_count, the layout of FlexAttention's `BlockMask.from_kv_blocks`.
    """
    return _launch(
        q,
        centroid,
        uplift_rescue,
        block_size,
        alpha_base,
        alpha_rescue,
        sink_blocks,
        window_blocks,
        last_q_blocks,
        scale,
        branches,
    )


def main() -> None:
    """Print one selection from the reference (and from the kernel, where Triton can run)."""
    from .block_stats import block_stats_ref, rescue_beta_ref
    from .triton_util import INTERPRET

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sink = torch.randn(64, device=device)  # a direction every query leans to, held by 8 keys
    q = torch.randn(1, 4, 2048, 64, device=device) + sink
    k = torch.randn(1, 2, 2048, 64, device=device)
    k[:, :, :8] += 3 * sink
    k[:, :, 640:768] *= 3.0  # one dispersed key block
    centroid, radius = block_stats_ref(k, 128)
    uplift = radius * rescue_beta_ref(radius)
    args = (q, centroid, uplift, 128, 0.22, 0.18, 2, 4, 2)
    count, _ = rbs_select_ref(*args)
    print("reference kept per query block (head 0):", count[0, 0].tolist())
    if triton is not None and (device == "cuda" or INTERPRET):
        count, _ = rbs_select(*args)
        print("kernel    kept per query block (head 0):", count[0, 0].tolist())


if __name__ == "__main__":
    main()
