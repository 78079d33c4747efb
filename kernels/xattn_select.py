"""XAttention's block selection: the antidiagonal mass estimate and the cumulative-tau rule.

Per query head h (KV head h // (Hq / Hkv)), stride S, block size B, R = B / S reshaped rows per
block, the reshaped row r of the queries against the reshaped column c of the keys has the logit

    z[r, c] = sum_t q[r S + S - 1 - t] . k[c S + t] * scale / S      (the antidiagonal of tile r, c)

(zero for padded tokens), A = the row softmax of z over c <= r, and mass[i, j] the sum of A over
the R x R cells of block pair (i, j), zero for rows without a real token. Per query block i the
rule keeps block 0 and the diagonal, then the other blocks j < i in descending mass (ties: lower
id first), each while the mass kept before it is < tau * (row total).

Triton path, three launches and no host sync:
  `_xattn_partial_kernel`  one program per (row tile, b, h) runs once over its causal columns:
                           per column tile the S products q_t k_t^T (`tl.dot`; q_t = the queries
                           r S + S - 1 - t, k_t = the keys c S + t, read in place: nothing is
                           reshaped in memory), the online row max / sum, and the row's mass in
                           each key block of the tile relative to the running max. Writes those
                           partial sums (fp32 [rows, M] per head), the running max of each tile and
                           the row's log2-sum-exp2;
  `_xattn_fold_kernel`     one program per (b, h, i): rescales each row's partial sums by
                           2^(tile max - lse) and sums the R rows of block i -> mass[i, :];
  `_xattn_keep_kernel`     one program per (b, h, i): the cumulative rule by bisection on the mass
                           bits, ties resolved in id order with a prefix sum, then the kept ids
                           compacted in ascending order.
The (N / S)^2 reshaped logits never reach memory and the products are computed once; the partial
sums are N / S x M floats per head, so heads go a KV group at a time within a scratch budget
(256 MiB; about 1 GiB for all 32 heads at 128K). `antidiagonal_mass_ref` and `cumulative_keep` are
the PyTorch references (fp32 mass, fp64 rule); `xattn_select_ref` composes them with the same
output as `xattn_select`.

Precision: fp16/bf16 inputs feed `tl.dot` as they are (exact products, fp32 accumulation), fp32
inputs use an fp32 dot; the mass is fp32 and the rule sums it in fp32 (the reference in fp64), so
a block whose cumulative mass sits within rounding of tau may go either way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_masks import compact_mask
from .shapes import check_qk
from .triton_util import check_triton_launch, jit, tl, triton

# Elements of the [B, Hq, rows, cols] reshaped-logit tile the reference builds at once.
_TILE_ELEMS = 1 << 24
MAX_BLOCKS = 1 << 16  # key blocks per row the fast path takes (a row is held in registers)
# Device memory for the per-row partial sums of one launch (heads are processed in groups).
_SCRATCH_BYTES = 1 << 28


# ------------------------------------------------------------------------ PyTorch references


def antidiagonal_mass_ref(
    q: Tensor, k: Tensor, block_size: int, stride: int, scale: float | None = None
) -> Tensor:
    """fp32 [B, Hq, M, M]: the softmax mass of the antidiagonal estimate in each block pair.

    q [B, Hq, N, D], k [B, Hkv, N, D]; entries above the diagonal are 0. Query blocks are processed
    a chunk at a time, each against the reshaped keys up to the chunk's end.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    m = math.ceil(n / block_size)
    rb = block_size // stride  # reshaped positions per block
    real = math.ceil(n / stride)  # reshaped positions holding at least one real token
    pad = m * block_size - n
    qr = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(b, hkv, group, m * rb, stride, d)
    kr = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(b, hkv, m * rb, stride * d)
    mass = torch.zeros(b, hq, m, m, device=q.device)
    step = max(1, _TILE_ELEMS // max(1, b * hq * rb * m * rb))  # query blocks per chunk
    for i0 in range(0, m, step):
        i1 = min(m, i0 + step)
        r0, r1 = i0 * rb, i1 * rb
        # Qr rows of the chunk: reverse the S queries of each reshaped row, then flatten them.
        rows = qr[:, :, :, r0:r1].flip(-2).reshape(b, hkv, group, r1 - r0, stride * d).float()
        logits = torch.einsum("bkgrx,bkcx->bkgrc", rows, kr[:, :, :r1].float())
        logits = logits.reshape(b, hq, r1 - r0, r1) * (scale / stride)
        r = torch.arange(r0, r1, device=q.device)[:, None]
        c = torch.arange(r1, device=q.device)[None, :]
        probs = logits.masked_fill(c > r, -math.inf).softmax(-1)  # padded cols are > real rows
        probs = probs.masked_fill(r >= real, 0.0)  # rows without a real token add nothing
        mass[:, :, i0:i1, :i1] = probs.view(b, hq, i1 - i0, rb, i1, rb).sum((3, 5))
    return mass


def cumulative_keep(mass: Tensor, tau: float) -> Tensor:
    """bool [..., M, M]: XAttention's per-row cumulative rule on block masses (block-causal).

    Block 0 and the diagonal are kept and counted first; the other blocks j < i follow in
    descending mass (ties: lower id first), each kept while the mass before it is < tau * total.
    """
    m = mass.shape[-1]
    i = torch.arange(m, device=mass.device)[:, None]
    j = torch.arange(m, device=mass.device)[None, :]
    forced = ((j == 0) | (j == i)) & (j <= i)
    other = (j > 0) & (j < i)
    v = mass.double().masked_fill(j > i, 0.0)
    required = tau * v.sum(-1, keepdim=True)
    before = v.masked_fill(~forced, 0.0).sum(-1, keepdim=True)  # the forced mass comes first
    ranked, order = v.masked_fill(~other, -1.0).sort(dim=-1, descending=True, stable=True)
    gain = ranked.clamp_min(0.0)
    before = before + torch.nn.functional.pad(gain.cumsum(-1)[..., :-1], (1, 0))
    keep_ranked = (before < required) & (ranked >= 0)  # non-candidates were ranked at -1
    return torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked) | forced


def xattn_select_ref(
    q: Tensor, k: Tensor, block_size: int, stride: int, tau: float, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of `xattn_select`: the same (kv_count, kv_indices), zeros past count."""
    mass = antidiagonal_mass_ref(q, k, block_size, stride, scale)
    return compact_mask(cumulative_keep(mass, tau))


# ---------------------------------------------------------------------------- Triton kernels


@jit
def _antidiagonal_tile(
    q_head,
    k_head,
    rows,
    cols,
    n_ctx,
    d_ok,
    offs_d,
    stride_qn,
    stride_qd,
    stride_kn,
    stride_kd,
    STRIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """fp32 [BLOCK_R, BLOCK_C]: sum over t of q[r S + S - 1 - t] . k[c S + t] (padding reads 0)."""
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for t in range(STRIDE):
        q_tok = rows * STRIDE + (STRIDE - 1 - t)
        k_tok = cols * STRIDE + t
        q_ptrs = q_head + q_tok[:, None] * stride_qn + offs_d[None, :] * stride_qd
        k_ptrs = k_head + k_tok[:, None] * stride_kn + offs_d[None, :] * stride_kd
        qt = tl.load(q_ptrs, mask=(q_tok < n_ctx)[:, None] & d_ok[None, :], other=0.0)
        kt = tl.load(k_ptrs, mask=(k_tok < n_ctx)[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(qt, tl.trans(kt), acc, input_precision="ieee")
        else:
            acc = tl.dot(qt, tl.trans(kt), acc)
    return acc


@jit
def _xattn_partial_kernel(
    Q,
    K,
    Part,
    Tmax,
    Lse,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_pb,
    stride_ph,
    stride_pr,
    stride_pj,
    stride_tb,
    stride_th,
    stride_tr,
    stride_tc,
    stride_lb,
    stride_lh,
    stride_lr,
    n_ctx,
    real_rows,  # ceil(N / S): reshaped rows (and columns) holding a real token
    heads,
    group,
    d_head,
    qk_scale,  # scale / S * log2(e): logits in log2 units
    STRIDE: tl.constexpr,
    RB: tl.constexpr,  # reshaped rows per block, B / S
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    rt = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    rows = rt * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_C // RB)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d_head
    q_head = Q + b * stride_qb + h * stride_qh
    k_head = K + b * stride_kb + hk * stride_kh
    part = Part + b * stride_pb + h * stride_ph + rows[:, None] * stride_pr
    tmax = Tmax + b * stride_tb + h * stride_th + rows * stride_tr
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    c_end = tl.minimum((rt + 1) * BLOCK_R, real_rows)  # columns a real row of the tile sees
    for c0 in range(0, c_end, BLOCK_C):
        cols = c0 + offs_c
        z = _antidiagonal_tile(
            q_head, k_head, rows, cols, n_ctx, d_ok, offs_d,
            stride_qn, stride_qd, stride_kn, stride_kd,
            STRIDE, BLOCK_R, BLOCK_C, DOT_F32,
        )  # fmt: skip
        z = tl.where(cols[None, :] <= rows[:, None], z * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))  # finite: column 0 is in the first tile
        p = tl.exp2(z - m_new[:, None])
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p, 1)
        m_i = m_new
        # the row's mass per key block of the tile, relative to the running max m_i
        p = tl.sum(tl.reshape(p, [BLOCK_R, BLOCK_C // RB, RB]), 2)
        tl.store(part + (c0 // RB + offs_j)[None, :] * stride_pj, p)
        tl.store(tmax + (c0 // BLOCK_C) * stride_tc, m_i)
    tl.store(Lse + b * stride_lb + h * stride_lh + rows * stride_lr, m_i + tl.log2(l_i))


@jit
def _xattn_fold_kernel(
    Part,
    Tmax,
    Lse,
    Mass,
    stride_pb,
    stride_ph,
    stride_pr,
    stride_pj,
    stride_tb,
    stride_th,
    stride_tr,
    stride_tc,
    stride_lb,
    stride_lh,
    stride_lr,
    stride_mb,
    stride_mh,
    stride_mi,
    stride_mj,
    real_rows,
    m_blocks,
    heads,
    RB: tl.constexpr,
    TILE_J: tl.constexpr,  # key blocks per column tile of the partial kernel, BLOCK_C / RB
    BLOCK_M: tl.constexpr,
):
    # mass[i, j] = sum over the rows r of block i of part[r, j] * 2^(tmax[r, tile of j] - lse[r])
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    part_head = Part + b * stride_pb + h * stride_ph + j * stride_pj
    tmax_head = Tmax + b * stride_tb + h * stride_th + (j // TILE_J) * stride_tc
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for rr in range(RB):
        r = i * RB + rr
        last = i - (r >= real_rows).to(tl.int32) * (i + 1)  # rows without a real token: none
        ok = j <= last
        part = tl.load(part_head + r * stride_pr, mask=ok)
        t = tl.load(tmax_head + r * stride_tr, mask=ok)
        lse = tl.load(Lse + b * stride_lb + h * stride_lh + r * stride_lr)
        acc += tl.where(ok, part * tl.exp2(t - lse), 0.0)
    out = Mass + b * stride_mb + h * stride_mh + i * stride_mi
    tl.store(out + j * stride_mj, acc, mask=j < m_blocks)


@jit
def _xattn_keep_kernel(
    Mass,
    Count,
    Index,
    stride_mb,
    stride_mh,
    stride_mi,
    stride_mj,
    stride_nb,
    stride_nh,
    stride_nm,
    stride_ib,
    stride_ih,
    stride_im,
    stride_ik,
    m_blocks,
    heads,
    tau,
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(0)
    i = m_blocks - 1 - tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    row = Mass + b * stride_mb + h * stride_mh + i * stride_mi
    v = tl.load(row + j * stride_mj, mask=j <= i, other=0.0)  # [BLOCK_M] fp32, >= 0
    required = tau * tl.sum(v, 0)
    forced = (j == 0) | (j == i)
    v_forced = tl.sum(tl.where(forced, v, 0.0), 0)
    cand = (j > 0) & (j < i)
    # The reference ranks candidates by mass (ties: lower id first) and keeps each while the mass
    # before it is < required. u = the mass bits, ordered as the masses (v >= 0). With G(theta) =
    # forced + sum of v over u > theta (non-increasing: fp32 rounding is monotone), bisection finds
    # the smallest theta with G(theta) < required; candidates with u > theta are kept, u < theta
    # are not, and the ties at u = theta are kept in id order while G(theta) + the tied mass
    # before them stays < required. If the forced mass alone reaches `required`, hi never moves
    # from 2^31 - 1 (a NaN pattern): no candidate is kept; if every candidate fits, hi ends at 0.
    u = tl.where(cand, v.to(tl.int32, bitcast=True), -1)
    lo = tl.full([], -1, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(31):
        mid = (lo + (hi - lo) // 2).to(tl.int32)
        below = v_forced + tl.sum(tl.where(u > mid, v, 0.0), 0) < required
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    theta = hi.to(tl.int32)
    tied = tl.where(u == theta, v, 0.0)
    g = v_forced + tl.sum(tl.where(u > theta, v, 0.0), 0)
    keep_tied = (u == theta) & (g + tl.cumsum(tied, 0) - tied < required)
    keep = (forced & (j <= i)) | (u > theta) | keep_tied
    k32 = keep.to(tl.int32)
    pos = tl.cumsum(k32, 0) - k32
    count = tl.sum(k32, 0)
    out = Index + b * stride_ib + h * stride_ih + i * stride_im
    tl.store(out + pos * stride_ik, j, mask=keep)
    tl.store(out + j * stride_ik, tl.zeros_like(j), mask=(j >= count) & (j < m_blocks))
    tl.store(Count + b * stride_nb + h * stride_nh + i * stride_nm, count)


# ------------------------------------------------------------------------------- launchers


def _check_inputs(q: Tensor, k: Tensor, block_size: int, stride: int) -> None:
    check_qk(q, k)
    if not supported(block_size, stride, q.shape[2]):
        raise ValueError(
            f"xattn_select needs block_size / stride a power of two <= 128 and at most "
            f"{MAX_BLOCKS} blocks; got block_size={block_size}, stride={stride}, N={q.shape[2]}"
        )


def supported(block_size: int, stride: int, n: int) -> bool:
    """Whether the Triton path takes this geometry (else use the reference)."""
    rb = block_size // stride if stride > 0 and block_size % stride == 0 else 0
    return 1 <= rb <= 128 and rb & (rb - 1) == 0 and math.ceil(n / block_size) <= MAX_BLOCKS


def _dot_inputs(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, bool]:
    """fp16/bf16 pairs go to the tensor cores as they are; anything else in fp32."""
    if q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16):
        return q, k, False
    return q.float(), k.float(), True


def _launch_mass(
    q: Tensor,
    k: Tensor,
    block_size: int,
    stride: int,
    scale: float | None,
    block_r: int = 128,
    block_c: int = 128,  # H100, 128K: 21 ms against 32 ms with 64 (8 warps, 3 stages)
    num_warps: int = 8,
    num_stages: int = 2,
    scratch_bytes: int = _SCRATCH_BYTES,
) -> Tensor:
    check_triton_launch("xattn_select", q, k)
    _check_inputs(q, k, block_size, stride)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    rb = block_size // stride
    q, k, dot_f32 = _dot_inputs(q, k)
    if dot_f32 and q.device.type == "cuda":  # fp32 tiles: fewer, to stay in registers
        block_c, num_stages = 32, 1
    block_r, block_c = max(block_r, rb, 16), max(block_c, rb, 16)
    m = math.ceil(n / block_size)
    real = math.ceil(n / stride)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qk_scale = scale / stride * math.log2(math.e)
    row_tiles = math.ceil(m * rb / block_r)
    rows = row_tiles * block_r
    col_tiles = math.ceil(real / block_c)
    # The per-row partial sums are [rows, M] fp32 per head: heads go a KV group at a time, as many
    # groups as fit in scratch_bytes (at least one).
    per_group = group * rows * col_tiles * (block_c // rb + 1) * 4
    groups = max(1, min(hkv, scratch_bytes // max(1, b * per_group)))
    heads = groups * group
    part = torch.empty(b, heads, rows, col_tiles * (block_c // rb), device=q.device)
    tmax = torch.empty(b, heads, rows, col_tiles, device=q.device)
    lse = torch.empty(b, heads, rows, device=q.device)
    mass = torch.empty(b, hq, m, m, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, triton.next_power_of_2(m))
    for g0 in range(0, hkv, groups):
        g1 = min(hkv, g0 + groups)
        qc, kc = q[:, g0 * group : g1 * group], k[:, g0:g1]
        mc = mass[:, g0 * group : g1 * group]
        nh = (g1 - g0) * group
        _xattn_partial_kernel[(row_tiles, b * nh)](
            qc, kc, part, tmax, lse, *qc.stride(), *kc.stride(), *part.stride(), *tmax.stride(),
            *lse.stride(), n, real, nh, group, d, qk_scale,
            STRIDE=stride, RB=rb, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_D=block_d,
            DOT_F32=dot_f32, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        _xattn_fold_kernel[(m, b * nh)](
            part, tmax, lse, mc, *part.stride(), *tmax.stride(), *lse.stride(), *mc.stride(),
            real, m, nh, RB=rb, TILE_J=block_c // rb, BLOCK_M=block_m,
            num_warps=4 if block_m <= 2048 else 8,
        )  # fmt: skip
    return mass


def antidiagonal_mass(
    q: Tensor, k: Tensor, block_size: int, stride: int, scale: float | None = None
) -> Tensor:
    """Triton `antidiagonal_mass_ref`: fp32 [B, Hq, M, M], zeros above the diagonal.

    q [B, Hq, N, D], k [B, Hkv, N, D]; block_size / stride must be a power of two <= 128.
    """
    return _launch_mass(q, k, block_size, stride, scale)


def cumulative_select(mass: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """Triton `cumulative_keep` + compaction: (kv_count int32 [B, H, M], kv_indices int32
    [B, H, M, M], kept ids ascending, zeros past the count) from fp32 mass [B, H, M, M]."""
    check_triton_launch("cumulative_select", mass)
    if mass.dim() != 4 or mass.shape[-1] != mass.shape[-2] or mass.shape[-1] > MAX_BLOCKS:
        raise ValueError(f"mass must be [B, H, M, M] with M <= {MAX_BLOCKS}; got {mass.shape}")
    b, h, m, _ = mass.shape
    mass = mass.float()
    count = torch.empty(b, h, m, device=mass.device, dtype=torch.int32)
    index = torch.empty(b, h, m, m, device=mass.device, dtype=torch.int32)
    block_m = max(16, triton.next_power_of_2(m))
    _xattn_keep_kernel[(b * h, m)](
        mass, count, index, *mass.stride(), *count.stride(), *index.stride(),
        m, h, float(tau), BLOCK_M=block_m, num_warps=4 if block_m <= 2048 else 8,
    )  # fmt: skip
    return count, index


def xattn_select(
    q: Tensor, k: Tensor, block_size: int, stride: int, tau: float, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Kept key blocks per query head: (kv_count int32 [B, Hq, M], kv_indices int32 [B, Hq, M, M]).

    q [B, Hq, N, D], k [B, Hkv, N, D] (query head h reads KV head h // (Hq // Hkv)); scale
    defaults to 1/sqrt(D). kv_indices holds the kept ids ascending and zeros past kv_count.
    """
    return cumulative_select(antidiagonal_mass(q, k, block_size, stride, scale), tau)


def main() -> None:
    """Print one selection from the reference (and from the kernels, where Triton can run)."""
    from .triton_util import INTERPRET

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 2, 2048, 64, device=device)
    k = torch.randn(1, 1, 2048, 64, device=device)
    k[:, :, 300:310] += 2.0 * q[:, :1, 1800:1810]  # keys late queries look for
    count, _ = xattn_select_ref(q, k, 128, 16, 0.9)
    print("reference kept per query block (head 0):", count[0, 0].tolist())
    if triton is not None and (device == "cuda" or INTERPRET):
        count, _ = xattn_select(q, k, 128, 16, 0.9)
        print("kernel    kept per query block (head 0):", count[0, 0].tolist())


if __name__ == "__main__":
    main()
