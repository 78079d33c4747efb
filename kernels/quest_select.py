"""Quest-style prefill block selection: min/max key boxes, the box bound, top fraction per row.

Per KV head and key block j, `kmin_j` / `kmax_j` are the elementwise extremes of its real keys. For
query head h (KV head h // (Hq / Hkv)), query block i and key block j,

    score[i, j] = max over the real tokens t of block i of  q_t+ . kmax_j + q_t- . kmin_j

(q+ = max(q, 0), q- = min(q, 0): the largest logit the box allows, unscaled). Query block i keeps
the ceil(ratio * i) best (at least 1; 1e-9 tolerance) of its candidates j < i, ties to the lower
id, plus the forced blocks (sinks, the window ending at the diagonal, the last query rows).

`quest_select` is the Triton path, two launches and no host sync:
  `_box_scores_kernel`    one program per (b, h, i) keeps the query tile on chip and scores key
                          tiles with two `tl.dot`s (q+ against kmax, q- against kmin, one
                          accumulator) and a max over tokens; rows whose candidates are all forced
                          are skipped. The [B, H, N, M] token bounds never reach memory.
  `_top_fraction_kernel`  one program per (b, h, i): the k-th best candidate by bisection on
                          the order-preserving score bits, ties resolved in id order with a
                          prefix sum, the forced blocks, and the kept ids compacted in ascending
                          order.
The ranking runs apart from the scoring so that its serial bisection overlaps across many small
programs instead of idling the tensor cores of the large scoring program.
`box_stats` computes the boxes in the keys' own dtype (min and max are exact in any dtype), one read
of K. The references: `box_stats_ref`, `box_scores_ref`, `top_fraction`, and `quest_select_ref`
composing them with the same output as the kernel.

Precision: fp16/bf16 queries and boxes feed `tl.dot` as they are (q+, q- and the box corners are
exact in that dtype, products are exact, accumulation is fp32); fp32 inputs use an fp32 dot.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_masks import compact_mask, forced_mask
from .triton_util import check_triton_launch, jit, tl, triton

# Elements of the [B, Hq, tokens, M] bound tile built at once (bounds the reference's memory).
_TILE_ELEMS = 1 << 24
MAX_BLOCKS = 1 << 16  # key blocks per row the fast path takes (a row is held in registers)


# ------------------------------------------------------------------------ PyTorch references


def box_stats_ref(k: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Elementwise (kmin, kmax), fp32 [B, Hkv, M, D], over the real keys of each key block."""
    b, h, n, d = k.shape
    m = math.ceil(n / block_size)
    pad = m * block_size - n
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(b, h, m, block_size, d)
    real = (torch.arange(m * block_size, device=k.device) < n).view(1, 1, m, block_size, 1)
    kmin = kf.masked_fill(~real, math.inf).amin(3)
    kmax = kf.masked_fill(~real, -math.inf).amax(3)
    return kmin, kmax


def box_scores_ref(q: Tensor, kmin: Tensor, kmax: Tensor, block_size: int) -> Tensor:
    """fp32 [B, Hq, Mq, Mk]: max over each query block's real tokens of the token box bound.

    q [B, Hq, N, D]; kmin/kmax [B, Hkv, Mk, D]; query head h reads KV head h // (Hq // Hkv).
    Unscaled (the ranking does not depend on a positive softmax scale).
    """
    b, hq, n, d = q.shape
    hkv, mk = kmin.shape[1], kmin.shape[2]
    group = hq // hkv
    mq = math.ceil(n / block_size)
    kmin, kmax = kmin.float(), kmax.float()
    out = torch.empty(b, hq, mq, mk, device=q.device)
    step = max(1, _TILE_ELEMS // max(1, b * hq * block_size * mk))  # query blocks per tile
    for i0 in range(0, mq, step):
        i1 = min(mq, i0 + step)
        t0, t1 = i0 * block_size, min(n, i1 * block_size)
        qt = q[:, :, t0:t1].float().reshape(b, hkv, group, t1 - t0, d)  # [B, Hkv, G, T, D]
        bound = torch.einsum("bkgtd,bkmd->bkgtm", qt.clamp_min(0), kmax)
        bound += torch.einsum("bkgtd,bkmd->bkgtm", qt.clamp_max(0), kmin)  # [B, Hkv, G, T, Mk]
        bound = bound.reshape(b, hq, t1 - t0, mk)
        pad = (i1 - i0) * block_size - (t1 - t0)
        if pad:  # a partial last query block: padded tokens never give the max
            bound = torch.nn.functional.pad(bound, (0, 0, 0, pad), value=-math.inf)
        out[:, :, i0:i1] = bound.view(b, hq, i1 - i0, block_size, mk).amax(3)
    return out


def top_counts(m: int, ratio: float, device=None) -> Tensor:
    """int32 [M]: blocks kept from the i candidates of row i, min(i, max(1, ceil(ratio i)))."""
    cand = torch.arange(m, device=device, dtype=torch.float64)
    count = torch.ceil(ratio * cand - 1e-9).clamp_min(1)  # 1e-9: 0.1 * 30 is 3, not 4
    return torch.minimum(count, cand).to(torch.int32)


def top_fraction(scores: Tensor, candidates: Tensor, ratio: float) -> Tensor:
    """bool [..., M, M]: the ceil(ratio * |C_i|) best candidates of each row (>= 1 if any).

    Ties go to the lower block id (a stable descending sort keeps the ids of equal scores in order).
    """
    m = scores.shape[-1]
    n_cand = candidates.sum(-1).tolist()  # [M]
    count = [min(c, max(1, math.ceil(ratio * c - 1e-9))) for c in n_cand]
    count = torch.tensor(count, device=scores.device)[:, None]  # [M, 1]
    order = scores.masked_fill(~candidates, -math.inf).sort(dim=-1, descending=True, stable=True)[1]
    in_top = (torch.arange(m, device=scores.device) < count).expand_as(order)
    return torch.zeros_like(in_top).scatter(-1, order, in_top) & candidates


def quest_select_ref(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    block_size: int,
    ratio: float,
    sink_blocks: int,
    window_blocks: int,
    last_q_blocks: int,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of `quest_select`: the same (kv_count, kv_indices), zeros past count."""
    scores = box_scores_ref(q, kmin, kmax, block_size)
    m = scores.shape[-1]
    idx = torch.arange(m, device=q.device)
    keep = top_fraction(scores, idx[None, :] < idx[:, None], ratio)
    return compact_mask(keep | forced_mask(m, sink_blocks, window_blocks, last_q_blocks, q.device))


# ---------------------------------------------------------------------------- the fast path


def box_stats(k: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """`box_stats_ref` in k's dtype ([B, Hkv, M, D] each): the same values, one read of K."""
    n = k.shape[2]
    full, tail = divmod(n, block_size)
    lo, hi = [], []
    if full:
        body = k[:, :, : full * block_size].unflatten(2, (full, block_size))
        lo.append(body.amin(3))
        hi.append(body.amax(3))
    if tail:
        lo.append(k[:, :, full * block_size :].amin(2, keepdim=True))
        hi.append(k[:, :, full * block_size :].amax(2, keepdim=True))
    return torch.cat(lo, 2), torch.cat(hi, 2)


@jit
def _box_scores_kernel(
    Q,
    Kmin,
    Kmax,
    Scores,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_km,
    stride_kd,
    stride_sb,
    stride_sh,
    stride_si,
    stride_sj,
    n_ctx,
    m_blocks,
    heads,
    group,
    block_size,
    d_head,
    first_row,  # rows i < first_row or >= last_row are not scored (all their candidates are
    last_row,  # forced), and neither is anything at or above the diagonal
    DOT_F32: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    i = m_blocks - 1 - tl.program_id(1)  # the longest rows first
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
    q_pos = tl.maximum(q, 0.0).to(q.dtype)  # [BLOCK_Q, BLOCK_D], exact in q's dtype
    q_neg = tl.minimum(q, 0.0).to(q.dtype)
    tok_pad = tl.where(real, 0.0, float("-inf"))  # padded tokens never give the max
    scored = (i >= first_row) & (i < last_row)
    n_tiles = (i + BLOCK_K - 1) // BLOCK_K * scored.to(tl.int32)
    lo_head = Kmin + b * stride_kb + hk * stride_kh
    hi_head = Kmax + b * stride_kb + hk * stride_kh
    out = Scores + b * stride_sb + h * stride_sh + i * stride_si
    for t in range(0, n_tiles):
        kb = t * BLOCK_K + offs_k
        cand = kb < i
        offs = kb[:, None] * stride_km + offs_d[None, :] * stride_kd
        ok = cand[:, None] & d_ok[None, :]
        k_hi = tl.load(hi_head + offs, mask=ok, other=0.0)  # [BLOCK_K, BLOCK_D]
        k_lo = tl.load(lo_head + offs, mask=ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q_pos, tl.trans(k_hi), input_precision="ieee")
            s = tl.dot(q_neg, tl.trans(k_lo), s, input_precision="ieee")
        else:
            s = tl.dot(q_pos, tl.trans(k_hi))
            s = tl.dot(q_neg, tl.trans(k_lo), s)  # [BLOCK_Q, BLOCK_K] fp32
        tl.store(out + kb * stride_sj, tl.max(s + tok_pad[:, None], 0), mask=cand)


@jit
def _top_fraction_kernel(
    Scores,
    Top,
    Count,
    Index,
    stride_sb,
    stride_sh,
    stride_si,
    stride_sj,
    stride_nb,
    stride_nh,
    stride_nm,
    stride_ib,
    stride_ih,
    stride_im,
    stride_ik,
    m_blocks,
    heads,
    sink_blocks,
    window_blocks,
    last_q_blocks,
    scored_from,  # sink_blocks + max(window_blocks, 1): rows below it have only forced candidates
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(0)
    i = m_blocks - 1 - tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    last_rows = i >= m_blocks - last_q_blocks
    all_forced = last_rows | (i < scored_from)  # nothing to rank: the scores were not written
    cand = j < i - all_forced.to(tl.int32) * i
    row = tl.load(Scores + b * stride_sb + h * stride_sh + i * stride_si + j * stride_sj, mask=cand)
    # Order-preserving int32 of the scores (negative floats flip their magnitude bits; -0.0 ties
    # with +0.0). The top[i]-th largest: the largest theta with #(o >= theta) >= top[i], by
    # bisection (#(o >= lo) >= top > #(o >= hi)); o > theta are kept, and of the ties o = theta
    # the lowest ids, as many as remain (the reference's stable sort).
    bits = tl.where(row == 0.0, 0.0, row).to(tl.int32, bitcast=True)
    o = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    top = tl.load(Top + i)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((cand & (o >= mid.to(tl.int32))).to(tl.int32), 0) >= top
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    theta = lo.to(tl.int32)
    above = cand & (o > theta)
    tied = (cand & (o == theta)).to(tl.int32)
    room = top - tl.sum(above.to(tl.int32), 0)
    keep_ranked = above | ((tied > 0) & (tl.cumsum(tied, 0) - tied < room))
    window_lo = tl.where(last_rows, -1, i - window_blocks)  # the last rows keep every b <= i
    keep = (j < sink_blocks) | (j > window_lo) | keep_ranked
    keep = keep & (j <= i)
    k32 = keep.to(tl.int32)
    pos = tl.cumsum(k32, 0) - k32
    count = tl.sum(k32, 0)
    out = Index + b * stride_ib + h * stride_ih + i * stride_im
    tl.store(out + pos * stride_ik, j, mask=keep)
    tl.store(out + j * stride_ik, tl.zeros_like(j), mask=(j >= count) & (j < m_blocks))
    tl.store(Count + b * stride_nb + h * stride_nh + i * stride_nm, count)


def _check_boxes(q: Tensor, kmin: Tensor, kmax: Tensor, block_size: int) -> None:
    if q.dim() != 4 or kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise ValueError(
            f"q must be [B, Hq, N, D] and kmin, kmax [B, Hkv, M, D]; got {tuple(q.shape)}, "
            f"{tuple(kmin.shape)}, {tuple(kmax.shape)}"
        )
    b, hq, n, d = q.shape
    hkv, m = kmin.shape[1], math.ceil(n / block_size)
    if kmin.shape[0] != b or kmin.shape[2:] != (m, d) or hq % hkv:
        raise ValueError(
            f"kmin/kmax must be [B, Hkv, M, D] = [{b}, Hkv, {m}, {d}] for N={n}, block_size="
            f"{block_size}, Hkv dividing {hq}; got {tuple(kmin.shape)}"
        )
    if m > MAX_BLOCKS:
        raise ValueError(f"quest_select takes at most {MAX_BLOCKS} blocks, got {m}")


def _launch_scores(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    block_size: int,
    scores: Tensor,
    first_row: int,
    last_row: int,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 1,  # H100, 128K: 3.2 ms against 4.0 ms with 2 (q+ and q- fill the smem)
) -> Tensor:
    """Write scores[b, h, i, j] for j < i and first_row <= i < last_row (nothing else)."""
    check_triton_launch("quest_select", q, kmin, kmax)
    _check_boxes(q, kmin, kmax, block_size)
    b, hq, n, d = q.shape
    hkv, m = kmin.shape[1], kmin.shape[2]
    if kmin.stride() != kmax.stride():
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    same = q.dtype == kmin.dtype == kmax.dtype and q.dtype in (torch.float16, torch.bfloat16)
    if not same:  # fp32 (or mixed) inputs: an fp32 dot, in smaller tiles on the GPU
        q, kmin, kmax = q.float(), kmin.float(), kmax.float()
        if q.device.type == "cuda":
            block_k, num_warps, num_stages = min(block_k, 32), 8, 1
    block_k = min(block_k, max(16, triton.next_power_of_2(m)))
    _box_scores_kernel[(b * hq, m)](
        q, kmin, kmax, scores, *q.stride(), *kmin.stride(), *scores.stride(),
        n, m, hq, hq // hkv, block_size, d, first_row, last_row,
        DOT_F32=not same,
        BLOCK_Q=max(16, triton.next_power_of_2(block_size)),
        BLOCK_K=block_k,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return scores


def box_scores(q: Tensor, kmin: Tensor, kmax: Tensor, block_size: int) -> Tensor:
    """Triton `box_scores_ref` below the diagonal: fp32 [B, Hq, M, M], -inf for j >= i."""
    b, hq, n, _ = q.shape
    m = kmin.shape[2]
    scores = torch.full((b, hq, m, m), -math.inf, device=q.device)
    return _launch_scores(q, kmin, kmax, block_size, scores, 1, m)


def top_fraction_select(
    scores: Tensor,
    ratio: float,
    sink_blocks: int,
    window_blocks: int,
    last_q_blocks: int,
) -> tuple[Tensor, Tensor]:
    """Triton `top_fraction` | forced blocks, compacted: (kv_count int32 [B, H, M], kv_indices
    int32 [B, H, M, M], ids ascending, zeros past the count). Reads scores fp32 [B, H, M, M] only
    at j < i of the rows that have a candidate that is not forced."""
    check_triton_launch("top_fraction_select", scores)
    b, h, m, _ = scores.shape
    if m > MAX_BLOCKS:
        raise ValueError(f"top_fraction_select takes at most {MAX_BLOCKS} blocks, got {m}")
    top = top_counts(m, ratio, scores.device)
    count = torch.empty(b, h, m, device=scores.device, dtype=torch.int32)
    index = torch.empty(b, h, m, m, device=scores.device, dtype=torch.int32)
    block_m = max(16, triton.next_power_of_2(m))
    _top_fraction_kernel[(b * h, m)](
        scores, top, count, index, *scores.stride(), *count.stride(), *index.stride(),
        m, h, sink_blocks, window_blocks, last_q_blocks, sink_blocks + max(window_blocks, 1),
        BLOCK_M=block_m, num_warps=4 if block_m <= 2048 else 8,
    )  # fmt: skip
    return count, index


def quest_select(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    block_size: int,
    ratio: float,
    sink_blocks: int,
    window_blocks: int,
    last_q_blocks: int,
) -> tuple[Tensor, Tensor]:
    """Kept key blocks per query head: (kv_count int32 [B, Hq, M], kv_indices int32 [B, Hq, M, M]).

    q [B, Hq, N, D]; kmin/kmax [B, Hkv, M, D] (from `box_stats`); query head h reads KV head
    h // (Hq // Hkv). Only the rows with a candidate that is not forced are scored. kv_indices
    holds the kept ids ascending and zeros past kv_count.
    """
    b, hq, _, _ = q.shape
    m = kmin.shape[2]
    scores = torch.empty(b, hq, m, m, device=q.device)
    first, last = sink_blocks + max(window_blocks, 1), m - last_q_blocks
    _launch_scores(q, kmin, kmax, block_size, scores, first, last)
    return top_fraction_select(scores, ratio, sink_blocks, window_blocks, last_q_blocks)


def main() -> None:
    """Print one selection from the reference (and from the kernel, where Triton can run)."""
    from .triton_util import INTERPRET

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 2, 4096, 64, device=device)
    k = torch.randn(1, 1, 4096, 64, device=device)
    k[:, :, 700] += 0.5 * q[:, :1, 3000:3200].sum(2)  # block 5 holds one key late queries look for
    args = (q, *box_stats_ref(k, 128), 128, 0.1, 2, 4, 2)
    count, idx = quest_select_ref(*args)
    print("reference kept, query block 24 (head 0):", idx[0, 0, 24, : count[0, 0, 24]].tolist())
    if triton is not None and (device == "cuda" or INTERPRET):
        count, idx = quest_select(*args)
        print("kernel    kept, query block 24 (head 0):", idx[0, 0, 24, : count[0, 0, 24]].tolist())


if __name__ == "__main__":
    main()
