"""True attention mass of every causal (query block, key block) pair, without keeping N x N.

For query head h (KV head h // (Hq / Hkv)), query block i and key block j of size B,

    mass[i, j] = sum over the real queries t of block i of  sum over keys s of block j, s <= t,
                 of softmax_t(s),      softmax_t(s) = exp(z_ts) / sum_{s' <= t} exp(z_ts'),
                 z_ts = scale * q_t . k_s  (scale 1/sqrt(d) unless given)

so row i sums to the number of real queries in block i, and mass[i, j] = 0 for j > i. This is the
dense reference every block selector is judged against (rbs_bench.observations).

`block_mass` is the Triton kernel: one program per (query block, batch x query head) keeps the
query tile on chip, makes one pass over key blocks 0..i for the row max and normaliser (online
softmax) and a second pass that reduces the normalised probabilities of each key block to one
number. Only the diagonal block i takes the causal and padding masks: the blocks before it hold
real keys that every query of block i sees. `block_mass_ref` is its PyTorch reference: fp32
probabilities of a few query blocks at a time, reduced to block sums at once, so memory stays
O(rows x N) per head. `causal_softmax_chunks` yields the fp32 probabilities themselves one chunk of
query rows at a time (the token-level masses of rbs_bench.observations and MInference).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .shapes import check_qk
from .triton_util import check_triton_launch, jit, tl, triton

CHUNK = 1024  # query rows per chunk of `causal_softmax_chunks`


def _check_qk(q: Tensor, k: Tensor, block_size: int) -> None:
    check_qk(q, k)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def causal_softmax_chunks(
    q: Tensor, k: Tensor, scale: float | None = None, chunk: int = CHUNK, trim: bool = False
) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (t0, t1, p): fp32 causal softmax rows t0..t1-1, p [B, Hq, t1 - t0, N].

    q [B, Hq, N, D], k [B, Hkv, N, D]; query head h reads KV head h // (Hq // Hkv). With `trim`,
    p holds only the keys 0..t1-1 ([B, Hq, t1 - t0, t1]): the later ones are masked for every row
    of the chunk, so they are neither scored nor stored.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = k.float()
    pos = torch.arange(n, device=q.device)
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        width = t1 if trim else n
        rows = t1 - t0
        # the query heads of one KV head as one matrix, so the KV head's keys are not repeated
        qr = q[:, :, t0:t1].float().reshape(b, hkv, -1, d)  # [B, Hkv, G * T, D]
        z = torch.matmul(qr, kf[:, :, :width].transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*T, W]
        z = z.view(b, hq, rows, width)
        # keys before t0 precede every row: only the chunk's own keys and later ones are masked
        z[..., t0:].masked_fill_(pos[t0:width] > pos[t0:t1, None], -math.inf)
        yield t0, t1, z.softmax(-1)


def block_mass_ref(
    q: Tensor,
    k: Tensor,
    block_size: int,
    scale: float | None = None,
    chunk: int | None = None,
    chunk_elements: int = 1 << 19,
) -> Tensor:
    """fp32 [B, Hq, M, M]: the causal softmax mass of each (query block, key block) pair.

    q [B, Hq, N, D], k [B, Hkv, N, D]; M = ceil(N / block_size), the last block may be partial.
    Runs of whole query blocks are processed at a time, each against the keys up to its last row
    only (the later ones are masked for all its rows), and only the square of the run's own keys
    takes the causal mask: as many blocks as keep the run's fp32 logits within `chunk_elements`
    (2^19, 2 MiB, by default: a CPU core's cache; at least one block), or `chunk` query rows
    rounded up to whole blocks when given.
    """
    _check_qk(q, k, block_size)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    m = math.ceil(n / block_size)
    pad = m * block_size - n
    qf = F.pad(q.float(), (0, 0, 0, pad))  # [B, Hq, N', D], N' = M * block_size
    kf = F.pad(k.float(), (0, 0, 0, pad))  # [B, Hkv, N', D]
    upper = torch.ones(0, 0, dtype=torch.bool, device=q.device)  # grown to a run's rows
    out = torch.zeros(b, hq, m, m, device=q.device)
    per_block = b * hq * block_size * block_size  # logits per (query block, key block)
    i0 = 0
    while i0 < m:
        if chunk is not None:
            i1 = min(m, i0 + max(1, math.ceil(chunk / block_size)))
        else:
            i1 = i0 + 1
            while i1 < m and per_block * (i1 + 1 - i0) * (i1 + 1) <= chunk_elements:
                i1 += 1
        t0, t1 = i0 * block_size, i1 * block_size  # rows of the run; keys 0..t1-1
        rows = t1 - t0
        # the query heads of one KV head as one matrix, so the KV head's keys are not repeated
        qr = qf[:, :, t0:t1].reshape(b, hkv, -1, d)  # [B, Hkv, G * T, D]
        z = torch.matmul(qr, kf[:, :, :t1].transpose(-1, -2)).mul_(scale)  # [B, Hkv, G * T, t1]
        z = z.view(b, hq, rows, t1)
        if upper.shape[0] < rows:
            upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1)
        # keys before t0 precede every row of the run: only the square of its own keys is masked
        z[..., t0:].masked_fill_(upper[:rows, :rows], -math.inf)
        p = torch.softmax(z, -1)
        if t1 > n:
            p[:, :, n - t0 :] = 0  # padded query rows carry no mass
        # the keys of each block first (contiguous), then the rows: 5x faster than both at once
        per_key_block = p.view(b, hq, i1 - i0, block_size, i1, block_size).sum(5)
        out[:, :, i0:i1, :i1] = per_key_block.sum(3)
        i0 = i1
    return out


@jit
def _qk_tile(q, k_base, stride_kn, j, offs, key_ok, d_ok, block_size, IEEE: tl.constexpr):
    """Logits q . k of key block j (keys outside `key_ok` read as zeros)."""
    cols = j * block_size + offs
    k = tl.load(k_base + cols[:, None] * stride_kn, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@jit
def _query_tile(
    Q,
    K,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kd,
    n_ctx,
    heads,
    group,
    block_size,
    d_head,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """This program's query block: (i, batch b, head h, offsets, rows, in-block and real-row
    masks, head-dim mask, the query tile [BLOCK, BLOCK_D], the base pointer of its KV head's keys
    at column 0), from program ids (query block, batch x query head)."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    rows = i * block_size + offs
    in_block = offs < block_size
    row_ok = in_block & (rows < n_ctx)
    d_ok = offs_d < d_head
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0)
    k_base = K + b * stride_kb + (h // group) * stride_kh + offs_d[None, :] * stride_kd
    return i, b, h, offs, rows, in_block, row_ok, d_ok, q, k_base


@jit
def _row_stats(
    q,
    k_base,
    stride_kn,
    i,
    offs,
    rows,
    row_ok,
    in_block,
    d_ok,
    n_ctx,
    block_size,
    scale_log2,
    diag,
    BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """(row max m, 1 / normaliser) of the causal softmax of query block i, base 2; 1 / normaliser
    is 0 for padded rows. Key blocks j < diag take no causal or padding mask (they hold real keys
    that every query of block i sees), blocks diag..i take both."""
    m_i = tl.full([BLOCK], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    for j in range(0, diag):
        s = _qk_tile(q, k_base, stride_kn, j, offs, in_block, d_ok, block_size, IEEE) * scale_log2
        if not EVEN:
            s = tl.where(in_block[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: block j has a real key
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    for j in range(diag, i + 1):
        cols = j * block_size + offs
        col_ok = in_block & (cols < n_ctx)
        s = _qk_tile(q, k_base, stride_kn, j, offs, col_ok, d_ok, block_size, IEEE)
        ok = col_ok[None, :] & (cols[None, :] <= rows[:, None]) & row_ok[:, None]
        s = tl.where(ok, s * scale_log2, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # padded rows see nothing
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    m_safe = tl.where(m_i == -float("inf"), 0.0, m_i)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    return m_safe, inv_l


@jit
def _tile_mass(
    q,
    k_base,
    stride_kn,
    j,
    offs,
    rows,
    row_ok,
    in_block,
    d_ok,
    n_ctx,
    block_size,
    scale_log2,
    m_safe,
    inv_l,
    MASK: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The normalised probability mass of key block j summed over query block i's tile; MASK: the
    causal and padding masks (the diagonal block, or any block when unsure)."""
    if MASK:
        cols = j * block_size + offs
        col_ok = in_block & (cols < n_ctx)
        s = _qk_tile(q, k_base, stride_kn, j, offs, col_ok, d_ok, block_size, IEEE)
        ok = col_ok[None, :] & (cols[None, :] <= rows[:, None]) & row_ok[:, None]
        p = tl.where(ok, tl.exp2(s * scale_log2 - m_safe[:, None]) * inv_l[:, None], 0.0)
    else:
        s = _qk_tile(q, k_base, stride_kn, j, offs, in_block, d_ok, block_size, IEEE) * scale_log2
        if not EVEN:
            s = tl.where(in_block[None, :], s, -float("inf"))
        p = tl.exp2(s - m_safe[:, None]) * inv_l[:, None]  # padded rows: inv_l = 0
    return tl.sum(tl.sum(p, 1), 0)


@jit
def _block_mass_kernel(
    Q,
    K,
    Mass,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_mb,
    stride_mh,
    stride_mi,
    stride_mj,
    n_ctx,
    heads,
    group,
    block_size,
    d_head,
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: a full-precision dot (no TF32)
    EVEN: tl.constexpr,  # block_size == BLOCK: a key block before the diagonal is all real keys
    SPLIT: tl.constexpr,  # key blocks before the diagonal skip the causal and padding masks
):
    # one program: query block i of (batch, query head); the query tile stays on chip
    i, b, h, offs, rows, in_block, row_ok, d_ok, q, k_base = _query_tile(
        Q, K, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kd,
        n_ctx, heads, group, block_size, d_head, BLOCK, BLOCK_D,
    )  # fmt: skip
    diag = i if SPLIT else 0  # without SPLIT every key block takes the masks (the first version)

    # pass 1: row max and normaliser over key blocks 0..i (every real row sees its own key)
    m_safe, inv_l = _row_stats(
        q, k_base, stride_kn, i, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
        scale_log2, diag, BLOCK, IEEE, EVEN,
    )  # fmt: skip
    # pass 2: the normalised probabilities of each key block, summed over the tile
    out = Mass + b * stride_mb + h * stride_mh + i * stride_mi
    for j in range(0, diag):
        mass = _tile_mass(
            q, k_base, stride_kn, j, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
            scale_log2, m_safe, inv_l, False, IEEE, EVEN,
        )  # fmt: skip
        tl.store(out + j * stride_mj, mass)
    for j in range(diag, i + 1):
        mass = _tile_mass(
            q, k_base, stride_kn, j, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
            scale_log2, m_safe, inv_l, True, IEEE, EVEN,
        )  # fmt: skip
        tl.store(out + j * stride_mj, mass)


@jit
def _kept_mass_kernel(
    Q,
    K,
    Count,
    Index,
    Out,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_cb,
    stride_ch,
    stride_ci,
    stride_ib,
    stride_ih,
    stride_ii,
    stride_it,
    stride_ob,
    stride_oh,
    stride_oi,
    n_ctx,
    heads,
    group,
    block_size,
    d_head,
    scale_log2,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN: tl.constexpr,
):
    # one program: query block i of (batch, query head): the row statistics over every causal key
    # block, then the mass of the kept blocks only (the selection's list of row i)
    i, b, h, offs, rows, in_block, row_ok, d_ok, q, k_base = _query_tile(
        Q, K, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kd,
        n_ctx, heads, group, block_size, d_head, BLOCK, BLOCK_D,
    )  # fmt: skip
    m_safe, inv_l = _row_stats(
        q, k_base, stride_kn, i, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
        scale_log2, i, BLOCK, IEEE, EVEN,
    )  # fmt: skip
    count = tl.load(Count + b * stride_cb + h * stride_ch + i * stride_ci)
    index = Index + b * stride_ib + h * stride_ih + i * stride_ii
    kept = tl.full([], 0.0, tl.float32)
    for t in range(0, count):
        j = tl.load(index + t * stride_it)
        # every kept block takes the masks: a few blocks a row, and ids past the diagonal get 0
        kept += _tile_mass(
            q, k_base, stride_kn, j, offs, rows, row_ok, in_block, d_ok, n_ctx, block_size,
            scale_log2, m_safe, inv_l, True, IEEE, EVEN,
        )  # fmt: skip
    tl.store(Out + b * stride_ob + h * stride_oh + i * stride_oi, kept)


def _launch_args(q: Tensor, k: Tensor, block_size: int, scale: float | None) -> tuple:
    """(grid, scalar arguments, constexpr keywords) shared by the two kernels."""
    check_triton_launch("block_mass", q, k)
    _check_qk(q, k, block_size)
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    b, hq, n, d = q.shape
    m = math.ceil(n / block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    block = max(16, triton.next_power_of_2(block_size))
    block_d = max(16, triton.next_power_of_2(d))
    scalars = (n, hq, hq // k.shape[1], block_size, d, scale * math.log2(math.e))
    meta = dict(
        BLOCK=block,
        BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        EVEN=block == block_size,
        num_warps=8 if block * block_d >= 128 * 128 else 4,
    )
    return (m, b * hq), scalars, meta


def block_mass(
    q: Tensor, k: Tensor, block_size: int, scale: float | None = None, split: bool = True
) -> Tensor:
    """Triton `block_mass_ref`: fp32 [B, Hq, M, M] causal softmax mass per block pair.

    q [B, Hq, N, D], k [B, Hkv, N, D] in fp32, fp16 or bf16 (fp16/bf16 products are exact in the
    dot, accumulation is fp32). Costs two causal QK^T passes; nothing of size N x N is stored.
    `split=False` masks every key block as the diagonal one (the first version; for timing).
    """
    grid, scalars, meta = _launch_args(q, k, block_size, scale)
    m = grid[0]
    mass = torch.zeros(q.shape[0], q.shape[1], m, m, device=q.device, dtype=torch.float32)
    _block_mass_kernel[grid](
        q, k, mass, *q.stride(), *k.stride(), *mass.stride(), *scalars, SPLIT=split, **meta
    )
    return mass


def kept_block_mass_ref(
    q: Tensor, k: Tensor, kv_count: Tensor, kv_indices: Tensor, block_size: int, scale=None
) -> Tensor:
    """fp32 [B, Hq, M]: per query block, the causal softmax mass on its kept key blocks (the
    (count, indices) lists of a `BlockSelection`, per query head or one list for all heads)."""
    from .block_sparse_attn import block_mask_from_lists

    mass = block_mass_ref(q, k, block_size, scale)
    return (mass * block_mask_from_lists(kv_count, kv_indices)).sum(-1)


def kept_block_mass(
    q: Tensor, k: Tensor, kv_count: Tensor, kv_indices: Tensor, block_size: int, scale=None
) -> Tensor:
    """Triton `kept_block_mass_ref`: one pass over the causal key blocks for each row's softmax
    statistics and one over the kept blocks only, so about half of `block_mass` at low density.

    kv_count int [B, H, M], kv_indices int [B, H, M, >= max count] with H = Hq or 1; ids must be
    causal (<= the row); entries past a row's count are not read."""
    grid, scalars, meta = _launch_args(q, k, block_size, scale)
    b, hq, m = q.shape[0], q.shape[1], grid[0]
    if kv_count.dim() != 3 or kv_count.shape[0] != b or kv_count.shape[2] != m:
        raise ValueError(f"kv_count must be [{b}, H, {m}], got {tuple(kv_count.shape)}")
    if kv_count.shape[1] not in (1, hq) or kv_indices.shape[:3] != kv_count.shape:
        raise ValueError(
            f"kv_count {tuple(kv_count.shape)} / kv_indices {tuple(kv_indices.shape)} must have "
            f"{hq} or 1 heads and agree"
        )
    count = kv_count.expand(b, hq, m)
    index = kv_indices.expand(b, hq, m, kv_indices.shape[-1])
    out = torch.zeros(b, hq, m, device=q.device, dtype=torch.float32)
    _kept_mass_kernel[grid](
        q, k, count, index, out, *q.stride(), *k.stride(), *count.stride(), *index.stride(),
        *out.stride(), *scalars, **meta,
    )  # fmt: skip
    return out


def main() -> None:
    """Print the block mass of one head of seeded random inputs with one planted needle."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1536, 64, generator=gen)  # 12 blocks of 128, two query heads per KV head
    k = torch.randn(1, 1, 1536, 64, generator=gen)
    k[0, 0, 300] = 4 * q[0, 0, 1400]  # a key in block 2 that query block 10 matches strongly
    mass = block_mass_ref(q, k, 128)
    torch.set_printoptions(precision=1, sci_mode=False, linewidth=120)
    print("block mass, head 0 (rows sum to the query block's token count):")
    print(mass[0, 0])
    print("row sums:", [round(x, 2) for x in mass[0, 0].sum(-1).tolist()])


if __name__ == "__main__":
    main()
