"""Fused RBS block selection: dual-branch scoring, relative thresholds, forced blocks, compaction.

For query head h, query block i and key block b < i (design.md §4), with token logits
    z(t, b) = (q_t . c_b + ||q_t||_2 * u_b) * scale     (u = 0: base branch; u = uplift: rescue)
the branch score is L[i, b] = logsumexp over the real tokens t of block i of z(t, b), and b is kept
when L[i, b] >= log(alpha) + max over b' < i of L[i, b'], or when it is forced (sink blocks, the
local window ending at the diagonal, the last query rows); only b <= i is ever kept.

`rbs_select` is the Triton kernel: one program per (batch, query head, query block i) keeps the
128-token query tile on chip, scores the key tiles b < i with one `tl.dot` against a tile of
centroids, holds the row's scores in registers until the row maxima are known, then thresholds and
writes the kept ids compacted with a prefix sum. Neither the N x M token logits nor the M x M
scores reach device memory, and nothing syncs with the host. `rbs_select_ref` is its PyTorch
reference (the scores from `block_scores_ref`, the mask rule below).

The scores are computed in log2 units (scale * log2 e folded into the logits); the comparison is the
same as in natural-log units. The centroids are centred per KV head, c_b = c_mean + (c_b - c_mean):
q_t . c_mean is one fp32 number per token, added to every logit of the token, and the tensor-core
dot reads only the residuals. For fp16/bf16 queries that dot runs in fp16 (residuals rounded to
fp16, q exact unless |q| > 65504, where it is clamped); fp32 queries use an fp32 dot. Centring
keeps the rounding error relative to the residuals, small where every key shares a large direction
(attention sinks). `centred_centroids` gives what the kernel reads, for error estimates.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_scores import block_scores_ref
from .block_sparse_attn import block_lists_from_mask
from .block_stats import check_triton_launch, jit, tl, triton

BRANCHES = ("both", "base", "rescue")


# ---------------------------------------------------------------- the mask rule (pure PyTorch)


def candidate_mask(m: int, device=None) -> Tensor:
    """bool [M, M]: the scored candidates of query block i are the key blocks strictly before it."""
    idx = torch.arange(m, device=device)
    return idx[None, :] < idx[:, None]


def forced_mask(
    m: int, sink_blocks: int, window_blocks: int, last_q_blocks: int, device=None
) -> Tensor:
    """bool [M, M]: sink blocks, the local window ending at the diagonal, and the last query rows.

    Restricted to the causal triangle b <= i (query and key blocks of the same size).
    """
    i = torch.arange(m, device=device)[:, None]
    b = torch.arange(m, device=device)[None, :]
    forced = (b < sink_blocks) | (b > i - window_blocks) | (i >= m - last_q_blocks)
    return forced & (b <= i)


def relative_threshold(scores: Tensor, candidates: Tensor, alpha: float) -> Tensor:
    """Keep b iff L[i, b] >= log(alpha) + max over candidates of L[i, b'] (scores in log space).

    scores fp32 [..., Mq, Mk]; candidates bool broadcastable to it. Rows without candidates keep
    nothing.
    """
    masked = scores.masked_fill(~candidates, -math.inf)
    row_max = masked.amax(-1, keepdim=True)
    log_alpha = math.log(alpha) if alpha > 0 else -math.inf
    return (masked >= row_max + log_alpha) & candidates


def compact_mask(keep: Tensor) -> tuple[Tensor, Tensor]:
    """(count int32 [..., M], ids int32 [..., M, M]): kept ids ascending, zeros past the count."""
    count, ids = block_lists_from_mask(keep)
    live = torch.arange(keep.shape[-1], device=keep.device) < count[..., None]
    return count, torch.where(live, ids, torch.zeros_like(ids))


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


# ---------------------------------------------------------------------------- the Triton kernel


@jit
def _rbs_select_kernel(
    Q,
    C,
    Cmean,
    U,
    Count,
    Index,
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
    stride_nb,
    stride_nh,
    stride_nm,
    stride_ib,
    stride_ih,
    stride_im,
    stride_ik,
    n_ctx,
    m_blocks,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(0)
    i = m_blocks - 1 - tl.program_id(1)  # the longest rows are launched first
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    offs_t = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    tok = i * block_size + offs_t
    real = (offs_t < block_size) & (tok < n_ctx)  # [BLOCK_Q] real tokens of query block i
    d_ok = offs_d < d_head
    q_ptrs = Q + b * stride_qb + h * stride_qh + tok[:, None] * stride_qn
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=real[:, None] & d_ok[None, :], other=0.0)
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
    all_forced = last_rows | (i < scored_from)
    n_tiles = (i + BLOCK_K - 1) // BLOCK_K * (1 - all_forced.to(tl.int32))

    # The row's scores, [tile, column in tile]; -inf where not scored.
    tiles = tl.arange(0, BLOCK_M // BLOCK_K)
    row_b = tl.full([BLOCK_M // BLOCK_K, BLOCK_K], float("-inf"), tl.float32)
    row_r = tl.full([BLOCK_M // BLOCK_K, BLOCK_K], float("-inf"), tl.float32)
    max_b = tl.full([BLOCK_K], float("-inf"), tl.float32)
    max_r = tl.full([BLOCK_K], float("-inf"), tl.float32)
    c_head = C + b * stride_cb + hk * stride_ch
    u_head = U + b * stride_ub + hk * stride_uh
    for t in range(0, n_tiles):
        kb = t * BLOCK_K + offs_k
        cand = kb < i
        c_ptrs = c_head + kb[:, None] * stride_cm + offs_d[None, :] * stride_cd
        c = tl.load(c_ptrs, mask=cand[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        if DOT_F32:
            s = tl.dot(c, q_t, input_precision="ieee")
        else:
            s = tl.dot(c, q_t)  # [BLOCK_K, BLOCK_Q] fp32
        z = s * qk_scale + tok_bias[None, :]
        if BASE:
            mz = tl.max(z, 1)
            lse = mz + tl.log2(tl.sum(tl.exp2(z - mz[:, None]), 1))
            lse = tl.where(cand, lse, float("-inf"))
            max_b = tl.maximum(max_b, lse)
            row_b = tl.where(tiles[:, None] == t, lse[None, :], row_b)
        if RESCUE:
            u = tl.load(u_head + kb * stride_um, mask=cand, other=0.0)
            zr = z + u[:, None] * q_norm[None, :]
            mz = tl.max(zr, 1)
            lse = mz + tl.log2(tl.sum(tl.exp2(zr - mz[:, None]), 1))
            lse = tl.where(cand, lse, float("-inf"))
            max_r = tl.maximum(max_r, lse)
            row_r = tl.where(tiles[:, None] == t, lse[None, :], row_r)

    cols = tiles[:, None] * BLOCK_K + offs_k[None, :]  # [BLOCK_M // BLOCK_K, BLOCK_K]
    window_lo = tl.where(last_rows, -1, i - window_blocks)  # the last rows keep every b <= i
    keep = (cols < sink_blocks) | (cols > window_lo)
    cand = cols < i
    if BASE:
        keep = keep | (cand & (row_b >= tl.max(max_b, 0) + log2_alpha_base))
    if RESCUE:
        keep = keep | (cand & (row_r >= tl.max(max_r, 0) + log2_alpha_rescue))
    keep = keep & (cols <= i)

    # Compaction: position = kept ids before this one (in-tile prefix sum + earlier tiles).
    k32 = keep.to(tl.int32)
    per_tile = tl.sum(k32, 1)
    pos = tl.cumsum(k32, 1) - k32 + (tl.cumsum(per_tile, 0) - per_tile)[:, None]
    count = tl.sum(per_tile, 0)
    out = Index + b * stride_ib + h * stride_ih + i * stride_im
    tl.store(out + pos * stride_ik, cols, mask=keep)
    tl.store(out + cols * stride_ik, tl.zeros_like(cols), mask=(cols >= count) & (cols < m_blocks))
    tl.store(Count + b * stride_nb + h * stride_nh + i * stride_nm, count)


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
    maxnreg: int | None = None,
):
    """`rbs_select` with the launch configuration open (for tests and tuning)."""
    base, rescue = _branches(branches)
    check_triton_launch("rbs_select", q, centroid, uplift_rescue if rescue else None)
    _check_inputs(q, centroid, uplift_rescue, block_size, rescue)
    b, hq, n, d = q.shape
    hkv, m = centroid.shape[1], centroid.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dot_f32 = q.dtype == torch.float32
    c_mean, c = centred_centroids(centroid, torch.float32 if dot_f32 else torch.float16)
    u = uplift_rescue.float() if rescue else centroid.new_zeros(1, 1, 1)
    count = torch.empty(b, hq, m, device=q.device, dtype=torch.int32)
    index = torch.empty(b, hq, m, m, device=q.device, dtype=torch.int32)

    def log2a(alpha: float) -> float:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        return math.log2(alpha) if alpha > 0 else -math.inf

    block_k = min(block_k, max(16, triton.next_power_of_2(m)))
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    _rbs_select_kernel[(b * hq, m)](
        q,
        c,
        c_mean,
        u,
        count,
        index,
        *q.stride(),
        *c.stride(),
        *c_mean.stride(),
        *u.stride(),
        *count.stride(),
        *index.stride(),
        n,
        m,
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
        BLOCK_Q=max(16, triton.next_power_of_2(block_size)),
        BLOCK_K=block_k,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=max(block_k, triton.next_power_of_2(m)),
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
    from .block_stats import INTERPRET, block_stats_ref, rescue_beta_ref

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
