"""FlexPrefill's block selection (the rule is stated in baselines/flexprefill.py): PyTorch reference
and Triton path, with the same result up to entries within rounding of a threshold.

Steps, per (batch, query head), block size B, M = ceil(N / B):
  estimate   the last B queries' column and diagonal mass (`vertical_slash_estimate[_ref]`),
             token budgets = the fewest tokens covering gamma (`coverage_count` / the radix
             `coverage_select`), pooled to blocks; the query-aware test (sqrt JSD of the pooled
             estimate against the pooled column mass, below tau). These last steps are [B, H, M]
             sized and run in PyTorch on both paths.
  lines      the top n_v column blocks and n_s offset blocks (block 0 of each forced);
  pooled     for query-aware heads: P = row-softmax(mean-pooled q . mean-pooled k) over the causal
             block pairs, and the fewest pairs of P covering gamma * M over the whole matrix;
  compose    (i, j) kept when j is a kept column block, i - j a kept offset block, or (i, j) a
             kept pooled pair; j <= i; the kept ids compacted in ascending order.

Triton path (`flexprefill_select`): the estimate kernels of kernels/vertical_slash_attn.py (no
[B, N] probability tensor), the radix `coverage_select` for the token budgets and the pooled
pairs (no sort, no index tensor), `_head_block_means_kernel` (pooled queries of the query-aware
heads only), `_pooled_probs_kernel` (their P, a few heads at a time within a scratch budget: 4 MiB
per head at 128K) and `_compose_kernel` (one program per (b, h, query block): the three sources,
causality and compaction; no [B, H, M, M] mask). One host sync: the number of query-aware heads.
`flexprefill_select_ref` is the PyTorch reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .shapes import check_qk
from .triton_util import check_triton_launch, jit, tl, triton
from .vertical_slash_attn import (
    _estimate,
    coverage_count,
    coverage_select,
    estimate_supported,
    top_mask,
    vertical_slash_estimate_ref,
)

MAX_BLOCKS = 1 << 16  # query blocks the compose kernel holds in one row
_SCRATCH_BYTES = 1 << 26  # pooled probabilities of the query-aware heads held at once


@dataclass(frozen=True)
class FlexPrefillEstimate:
    """What FlexPrefill decides per (batch, query head) before building the block mask."""

    vertical: Tensor  # fp32 [B, H, M]  pooled column mass of the last B queries (sums to 1)
    slash: Tensor  # fp32 [B, H, M]  pooled diagonal mass, offset block o // B (sums to 1)
    n_vertical: Tensor  # int64 [B, H]  vertical blocks to keep
    n_slash: Tensor  # int64 [B, H]  slash blocks to keep
    distance: Tensor  # fp32 [B, H]  sqrt(JSD(pooled estimate, vertical))
    query_aware: Tensor  # bool [B, H]  distance < tau


# ------------------------------------------------------------------------ shared PyTorch steps


def block_means(x: Tensor, block: int) -> Tensor:
    """fp32 [B, H, M, D]: mean of each block of tokens (a partial last block over its real tokens).

    Sums accumulate in fp32 without an fp32 copy of x.
    """
    n = x.shape[2]
    full, tail = divmod(n, block)
    parts = []
    if full:
        body = x[:, :, : full * block].unflatten(2, (full, block))
        parts.append(body.sum(3, dtype=torch.float32) / block)
    if tail:
        parts.append(x[:, :, full * block :].sum(2, keepdim=True, dtype=torch.float32) / tail)
    return torch.cat(parts, 2)


def block_sums(x: Tensor, block: int) -> Tensor:
    """[..., M]: sums over consecutive blocks of the last dim (the last block may be partial)."""
    n = x.shape[-1]
    m = math.ceil(n / block)
    return torch.nn.functional.pad(x, (0, m * block - n)).unflatten(-1, (-1, block)).sum(-1)


def sqrt_jsd(p: Tensor, q: Tensor) -> Tensor:
    """sqrt of the Jensen-Shannon divergence (natural log) over the last dim; 0 log 0 = 0."""
    m = (p + q) / 2
    kl_p = (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1)
    kl_q = (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(-1)
    return (0.5 * (kl_p + kl_q)).clamp(min=0).sqrt()


def budget_range(n: int, block_size: int, min_budget: int, max_budget: int | None):
    """(lo, hi) blocks: the token budgets as blocks, hi capped at M."""
    m = math.ceil(n / block_size)
    lo = math.ceil(min_budget / block_size)
    hi = m if max_budget is None else min(m, math.ceil(max_budget / block_size))
    return lo, hi


def _finish_estimate(q, k, tokens, counts, tau, lo, hi, block_size, scale) -> FlexPrefillEstimate:
    """From the token line mass fp32 [2, B, H, N] (each line sums to 1) and the coverage token
    counts [2, B, H]: pooled lines, block budgets, the query-aware test."""
    b, hq, n, d = q.shape
    hkv, bs = k.shape[1], block_size
    m = math.ceil(n / bs)
    n_v, n_s = (counts.long() // bs + 1).clamp(lo, hi)
    vertical, slash = block_sums(tokens[0], bs), block_sums(tokens[1], bs)  # [B, Hq, M]
    k_bar = block_means(k, bs)  # [B, Hkv, M, D]
    q_last = q[:, :, n - bs :].mean(2, dtype=torch.float32).view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bkgd,bkmd->bkgm", q_last, k_bar).reshape(b, hq, m) * scale
    dist = sqrt_jsd(torch.softmax(logits, dim=-1), vertical)
    query_aware = dist < tau
    floor = torch.full_like(n_v, min(lo, hi))
    n_v, n_s = torch.where(query_aware, floor, n_v), torch.where(query_aware, floor, n_s)
    return FlexPrefillEstimate(vertical, slash, n_v, n_s, dist, query_aware)


def line_blocks(est: FlexPrefillEstimate) -> tuple[Tensor, Tensor]:
    """bool [B, H, M] each: kept column blocks j and offset blocks s (block 0 of each forced, at
    least one of each kept; ties: lower id)."""
    vertical, slash = est.vertical.clone(), est.slash.clone()
    vertical[..., 0] = slash[..., 0] = float("inf")
    keep_v = top_mask(vertical, est.n_vertical.clamp(min=1))
    keep_s = top_mask(slash, est.n_slash.clamp(min=1))
    return keep_v, keep_s


# -------------------------------------------------------------------------- PyTorch reference


def flexprefill_estimate_ref(
    q: Tensor,
    k: Tensor,
    gamma: float,
    tau: float,
    min_budget: int,
    max_budget: int | None,
    block_size: int,
    scale: float | None = None,
) -> FlexPrefillEstimate:
    """The estimate steps in PyTorch (fp64 coverage); needs N > block_size."""
    check_qk(q, k)
    n, d = q.shape[2], q.shape[3]
    bs = block_size
    if n <= bs:
        raise ValueError(f"the estimate needs N > block_size ({bs}), got N={n}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    vertical, slash = vertical_slash_estimate_ref(q, k, bs, scale)  # fp32 [B, Hq, N], sums to B
    tokens = torch.stack([vertical, slash]) / bs
    counts = coverage_count(tokens, gamma)
    lo, hi = budget_range(n, bs, min_budget, max_budget)
    return _finish_estimate(q, k, tokens, counts, tau, lo, hi, bs, scale)


def query_aware_blocks_ref(
    q: Tensor, k: Tensor, heads, gamma: float, block_size: int, scale: float | None = None
) -> Tensor:
    """bool [R, M, M] for the R query-aware (batch, head) pairs `heads`: the fewest causal block
    pairs of the pooled row-softmax whose sum reaches gamma * M (ties: lower flat id)."""
    bi, hi = heads
    d = q.shape[-1]
    bs, m = block_size, math.ceil(q.shape[2] / block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    q_bar = block_means(q, bs)[bi, hi]  # [R, M, D]
    k_bar = block_means(k, bs)[bi, hi // group]
    logits = torch.einsum("rid,rjd->rij", q_bar, k_bar) * scale
    causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).flatten(1)
    count = coverage_count(p, gamma * m)
    return top_mask(p, count).view(-1, m, m) & causal


def flexprefill_select_ref(
    q: Tensor,
    k: Tensor,
    gamma: float,
    tau: float,
    min_budget: int,
    max_budget: int | None,
    block_size: int,
    scale: float | None = None,
) -> tuple[Tensor, FlexPrefillEstimate]:
    """(kept bool [B, H, M, M], the estimate); needs N > block_size."""
    est = flexprefill_estimate_ref(q, k, gamma, tau, min_budget, max_budget, block_size, scale)
    m = est.vertical.shape[-1]
    keep_v, keep_s = line_blocks(est)
    i = torch.arange(m, device=q.device)
    diff = i[:, None] - i[None, :]  # [M, M] = i - j
    keep = keep_v[:, :, None, :] | (keep_s[..., diff.clamp(min=0)] & (diff >= 0))
    qa = est.query_aware.nonzero(as_tuple=True)  # (batch ids, head ids)
    if qa[0].numel():
        keep[qa] |= query_aware_blocks_ref(q, k, qa, gamma, block_size, scale)
    return keep, est


# ---------------------------------------------------------------------------- Triton kernels


@jit
def _pooled_probs_kernel(
    Qbar,
    Kbar,
    P,
    stride_qr,
    stride_qm,
    stride_qd,
    stride_kr,
    stride_km,
    stride_kd,
    stride_pr,
    stride_pi,
    stride_pj,
    m_blocks,
    d_head,
    qk_scale,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # rows of P = causal row-softmax(q_bar . k_bar * scale); entries above the diagonal stay 0
    it = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    rows = it * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows < m_blocks
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < d_head
    q_ptrs = Qbar + r * stride_qr + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
    qb = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
    k_head = Kbar + r * stride_kr + offs_d[None, :] * stride_kd
    j_end = tl.minimum((it + 1) * BLOCK_I, m_blocks)
    m_i = tl.full([BLOCK_I], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_I], dtype=tl.float32)
    for j0 in range(0, j_end, BLOCK_J):
        cols = j0 + tl.arange(0, BLOCK_J)
        kb = tl.load(
            k_head + cols[:, None] * stride_km, mask=(cols < m_blocks)[:, None] & d_ok, other=0.0
        )
        s = tl.dot(qb, tl.trans(kb), input_precision="ieee") * qk_scale
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: column 0 is in the first tile
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    lse = m_i + tl.log2(l_i)
    p_row = P + r * stride_pr + rows[:, None] * stride_pi
    for j0 in range(0, j_end, BLOCK_J):
        cols = j0 + tl.arange(0, BLOCK_J)
        kb = tl.load(
            k_head + cols[:, None] * stride_km, mask=(cols < m_blocks)[:, None] & d_ok, other=0.0
        )
        s = tl.dot(qb, tl.trans(kb), input_precision="ieee") * qk_scale
        causal = cols[None, :] <= rows[:, None]
        p = tl.where(causal, tl.exp2(s - lse[:, None]), 0.0)
        ok = row_ok[:, None] & (cols[None, :] < m_blocks)
        tl.store(p_row + cols[None, :] * stride_pj, p, mask=ok)


@jit
def _head_block_means_kernel(
    X,
    HeadB,
    HeadH,
    Out,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    stride_or,
    stride_om,
    n_ctx,
    block,
    d_head,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fp32 mean of block i's real tokens for head (HeadB[r], HeadH[r]): only the listed heads
    i = tl.program_id(0)
    r = tl.program_id(1)
    b = tl.load(HeadB + r).to(tl.int64)
    h = tl.load(HeadH + r).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < d_head
    t0 = i * block
    t1 = tl.minimum(t0 + block, n_ctx)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    x_head = X + b * stride_xb + h * stride_xh + offs_d[None, :] * stride_xd
    for t in range(t0, t1, BLOCK_T):
        tok = t + tl.arange(0, BLOCK_T)
        x = tl.load(x_head + tok[:, None].to(tl.int64) * stride_xn, mask=(tok < t1)[:, None] & d_ok)
        acc += x.to(tl.float32)
    mean = tl.sum(acc, 0) / (t1 - t0).to(tl.float32)
    tl.store(Out + r.to(tl.int64) * stride_or + i * stride_om + offs_d, mean, mask=offs_d < d_head)


@jit
def _compose_kernel(
    KeepV,
    KeepS,
    QaRow,
    QaMask,
    Count,
    Index,
    stride_vb,
    stride_vh,
    stride_rb,
    stride_rh,
    stride_mr,
    stride_mi,
    stride_nb,
    stride_nh,
    stride_ib,
    stride_ih,
    stride_im,
    m_blocks,
    heads,
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(0)
    i = m_blocks - 1 - tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    causal = j <= i
    lines = b * stride_vb + h * stride_vh
    kv = tl.load(KeepV + lines + j, mask=causal, other=0)  # column block j kept
    ks = tl.load(KeepS + lines + (i - j), mask=causal, other=0)  # offset block i - j kept
    r = tl.load(QaRow + b * stride_rb + h * stride_rh)  # -1: not a query-aware head
    qa_ok = causal & ((j * 0 + r) >= 0)
    qa_row = QaMask + tl.maximum(r, 0).to(tl.int64) * stride_mr + i.to(tl.int64) * stride_mi
    qa = tl.load(qa_row + j, mask=qa_ok, other=0)
    keep = causal & ((kv != 0) | (ks != 0) | (qa != 0))
    k32 = keep.to(tl.int32)
    pos = tl.cumsum(k32, 0) - k32
    count = tl.sum(k32, 0)
    out = Index + b * stride_ib + h * stride_ih + i.to(tl.int64) * stride_im
    tl.store(out + pos, j, mask=keep)
    tl.store(out + j, tl.zeros_like(j), mask=(j >= count) & (j < m_blocks))
    tl.store(Count + b * stride_nb + h * stride_nh + i, count)


# ------------------------------------------------------------------------------- launchers


def supported(block_size: int, n: int, head_dim: int) -> bool:
    """Whether the Triton path takes this geometry (else use the reference)."""
    return estimate_supported(block_size, head_dim) and math.ceil(n / block_size) <= MAX_BLOCKS


def flexprefill_estimate(
    q: Tensor,
    k: Tensor,
    gamma: float,
    tau: float,
    min_budget: int,
    max_budget: int | None,
    block_size: int,
    scale: float | None = None,
) -> FlexPrefillEstimate:
    """Triton `flexprefill_estimate_ref`: the line mass from the estimate kernels, the token
    budgets from the radix coverage; the [B, H, M]-sized rest as the reference."""
    check_triton_launch("flexprefill_estimate", q, k)
    check_qk(q, k)
    b, hq, n, d = q.shape
    bs = block_size
    if n <= bs:
        raise ValueError(f"the estimate needs N > block_size ({bs}), got N={n}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tokens = _estimate(q, k, bs, scale)  # fp32 [2, B, Hq, N], each line sums to B
    tokens /= bs
    counts, _ = coverage_select(tokens.view(2 * b * hq, n), gamma)
    lo, hi = budget_range(n, bs, min_budget, max_budget)
    counts = counts.view(2, b, hq)
    return _finish_estimate(q, k, tokens, counts, tau, lo, hi, bs, scale)


def query_aware_blocks(
    q: Tensor,
    k: Tensor,
    heads,
    gamma: float,
    block_size: int,
    scale: float | None = None,
    scratch_bytes: int = _SCRATCH_BYTES,
) -> Tensor:
    """Triton `query_aware_blocks_ref`: bool [R, M, M]. The block means of the listed query heads
    only (fp32), then the pooled probabilities of as many heads as fit in `scratch_bytes` (at
    least one) built and covered at a time."""
    check_triton_launch("query_aware_blocks", q, k)
    bi, hi = heads
    b, hq, n, d = q.shape
    bs, m = block_size, math.ceil(n / block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    group = hq // k.shape[1]
    r = bi.numel()
    block_d = max(16, triton.next_power_of_2(d))
    q_bar = torch.empty(r, m, d, device=q.device)  # [R, M, D] fp32, the listed heads only
    _head_block_means_kernel[(m, r)](
        q, bi.to(torch.int32), hi.to(torch.int32), q_bar, *q.stride(), *q_bar.stride()[:2], n,
        bs, d, BLOCK_T=32, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    k_bar = block_means(k, bs)[bi, hi // group].contiguous()
    out = torch.empty(r, m, m, dtype=torch.bool, device=q.device)
    step = max(1, scratch_bytes // (m * m * 4))
    block_i, block_j = 16, 16  # fp32 (ieee) dots: larger tiles spill on sm_90
    for r0 in range(0, r, step):
        r1 = min(r, r0 + step)
        qc, kc = q_bar[r0:r1], k_bar[r0:r1]
        p = torch.zeros(r1 - r0, m, m, device=q.device)
        _pooled_probs_kernel[(math.ceil(m / block_i), r1 - r0)](
            qc, kc, p, *qc.stride(), *kc.stride(), *p.stride(), m, d,
            scale * math.log2(math.e), BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip
        _, mask = coverage_select(p.view(r1 - r0, m * m), gamma * m, want_mask=True)
        out[r0:r1] = mask.view(r1 - r0, m, m)
    return out


def compose_blocks(
    keep_v: Tensor, keep_s: Tensor, qa_row: Tensor, qa_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(kv_count int32 [B, H, M], kv_indices int32 [B, H, M, M]; ids ascending, zeros past the
    count) of keep_v[j] | keep_s[i - j] | qa_mask[qa_row, i, j] over j <= i.

    keep_v / keep_s bool [B, H, M]; qa_row int32 [B, H] (-1: no pooled pairs); qa_mask bool
    [R, M, M].
    """
    check_triton_launch("compose_blocks", keep_v, keep_s, qa_row, qa_mask)
    b, h, m = keep_v.shape
    if m > MAX_BLOCKS:
        raise ValueError(f"at most {MAX_BLOCKS} blocks per row; got {m}")
    keep_v = keep_v.to(torch.uint8).contiguous()
    keep_s = keep_s.to(torch.uint8).contiguous()
    qa_row = qa_row.to(torch.int32).contiguous()
    if qa_mask.numel() == 0:
        qa_mask = torch.zeros(1, 1, 1, dtype=torch.bool, device=keep_v.device)
    qa_mask = qa_mask.contiguous().view(torch.uint8)
    count = torch.empty(b, h, m, dtype=torch.int32, device=keep_v.device)
    index = torch.empty(b, h, m, m, dtype=torch.int32, device=keep_v.device)
    block_m = max(16, triton.next_power_of_2(m))
    _compose_kernel[(b * h, m)](
        keep_v, keep_s, qa_row, qa_mask, count, index, *keep_v.stride()[:2], *qa_row.stride(),
        *qa_mask.stride()[:2], *count.stride()[:2], *index.stride()[:3], m, h,
        BLOCK_M=block_m, num_warps=4 if block_m <= 2048 else 8,
    )  # fmt: skip
    return count, index


def flexprefill_select(
    q: Tensor,
    k: Tensor,
    gamma: float,
    tau: float,
    min_budget: int,
    max_budget: int | None,
    block_size: int,
    scale: float | None = None,
    scratch_bytes: int = _SCRATCH_BYTES,
) -> tuple[Tensor, Tensor, FlexPrefillEstimate]:
    """Kept key blocks per query head: (kv_count int32 [B, Hq, M], kv_indices int32
    [B, Hq, M, M], the estimate); the lists as `flexprefill_select_ref`'s mask compacted (ids
    ascending, zeros past the count). q [B, Hq, N, D], k [B, Hkv, N, D] with N > block_size,
    block_size <= 128; CUDA, or the CPU under TRITON_INTERPRET=1."""
    if not supported(block_size, q.shape[2], q.shape[-1]):
        raise ValueError(
            f"the Triton FlexPrefill path needs block_size <= 128, head dim <= 256 and at most "
            f"{MAX_BLOCKS} blocks; got block_size={block_size}, head dim {q.shape[-1]}, "
            f"N={q.shape[2]}"
        )
    est = flexprefill_estimate(q, k, gamma, tau, min_budget, max_budget, block_size, scale)
    keep_v, keep_s = line_blocks(est)
    b, hq = est.query_aware.shape
    qa = est.query_aware.nonzero(as_tuple=True)  # one host sync: how many query-aware heads
    qa_row = torch.full((b, hq), -1, dtype=torch.int32, device=q.device)
    qa_row[qa] = torch.arange(qa[0].numel(), dtype=torch.int32, device=q.device)
    if qa[0].numel():
        qa_mask = query_aware_blocks(q, k, qa, gamma, block_size, scale, scratch_bytes)
    else:
        qa_mask = torch.zeros(0, 0, 0, dtype=torch.bool, device=q.device)
    count, index = compose_blocks(keep_v, keep_s, qa_row, qa_mask)
    return count, index, est


def main() -> None:
    """Print one selection from the reference (and from the kernels, where Triton can run)."""
    from .triton_util import INTERPRET

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 2, 2048, 64, device=device)
    k = torch.randn(1, 1, 2048, 64, device=device)
    k[:, :, 300:310] += 2.0 * q[:, :1, 1800:1810]  # keys late queries look for
    rule = (0.9, 0.1, 256, None, 128)  # gamma, tau, min_budget, max_budget, block_size
    keep, est = flexprefill_select_ref(q, k, *rule)
    print("query-aware heads:", est.query_aware[0].tolist())
    print("reference kept per query block (head 0):", keep[0, 0].tril().sum(-1).tolist())
    if triton is not None and (device == "cuda" or INTERPRET):
        count, _, _ = flexprefill_select(q, k, *rule)
        print("kernel    kept per query block (head 0):", count[0, 0].tolist())


if __name__ == "__main__":
    main()
