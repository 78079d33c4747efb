"""Block-sparse causal prefill attention: the PyTorch reference and the block-geometry helpers.

A selection is given per (batch, query head, query block) as `kv_count` int32 [B, Hq, Mq] and
`kv_indices` int32 [B, Hq, Mq, Mk] (kept key-block ids, ascending, padded past the count), the
layout of FlexAttention's `BlockMask.from_kv_blocks`. Query block i covers the tokens
[i * block_q, min((i + 1) * block_q, N)), key block j likewise with block_k; the last block of
either kind may be partial, and block_q may differ from block_k.
Inside the kept blocks attention is causal (key position <= query position).

`block_sparse_attention` is the Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1);
`block_sparse_attention_ref` and `block_sparse_attention_varlen_ref` are its PyTorch references.
The module imports without triton: only the kernel then refuses to run.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_util import autotune, autotune_space, kernel_arch

try:
    import triton
    import triton.language as tl
except ImportError:  # laptops and CI without triton: the references still work
    triton = None

HAS_TRITON = triton is not None
QUANT_GROUP = 128  # the activation group of block-FP8 checkpoints: one head's row when D = 128


def check_block_sparse_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
) -> None:
    """Raise ValueError with a one-line message when the shapes or dtypes do not fit together."""
    _check_qkv(q, k, v, block_q, block_k)
    b, hq, n = q.shape[:3]
    _check_lists(kv_count, kv_indices, (b, hq), n, block_q, block_k, f"N={n}")
    devices = {t.device for t in (q, k, v, kv_count, kv_indices)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, block_q: int, block_k: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, H, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    b, hq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(
            f"k and v must be [B, Hkv, N, D] = [{b}, Hkv, {n}, {d}] to match q; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive; got block_q={block_q}, block_k={block_k}")


def _check_lists(
    kv_count: Tensor,
    kv_indices: Tensor,
    lead: tuple[int, int],
    n: int,
    block_q: int,
    block_k: int,
    what: str,
) -> None:
    """Selection lists [*lead, Mq] / [*lead, Mq, Mk] for sequences of (at most) n tokens."""
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    b, hq = lead
    if tuple(kv_count.shape) != (b, hq, mq):
        raise ValueError(
            f"kv_count must be [B, Hq, Mq] = [{b}, {hq}, {mq}] for {what}, "
            f"block_q={block_q}; got {tuple(kv_count.shape)}"
        )
    if tuple(kv_indices.shape) != (b, hq, mq, mk):
        raise ValueError(
            f"kv_indices must be [B, Hq, Mq, Mk] = [{b}, {hq}, {mq}, {mk}] for {what}, "
            f"block_q={block_q}, block_k={block_k}; got {tuple(kv_indices.shape)}"
        )
    if kv_count.dtype != torch.int32 or kv_indices.dtype != torch.int32:
        raise ValueError(
            f"kv_count and kv_indices must be int32; got {kv_count.dtype}, {kv_indices.dtype}"
        )


def check_varlen_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    cu_seqlens: Tensor,
) -> list[int]:
    """Like `check_block_sparse_inputs` for packed sequences; returns the S sequence lengths.

    q [1, Hq, total, D], k/v [1, Hkv, total, D], cu_seqlens int32 [S + 1] (0, ..., total),
    kv_count [S, Hq, Mq_max], kv_indices [S, Hq, Mq_max, Mk_max] for the longest sequence.
    """
    _check_qkv(q, k, v, block_q, block_k)
    if q.shape[0] != 1:
        raise ValueError(f"packed (cu_seqlens) inputs must have batch 1; got {q.shape[0]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be int32 [S + 1] with S >= 1; got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.tolist()  # one host sync
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != q.shape[2] or min(lengths) < 0:
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {q.shape[2]}; got {bounds}"
        )
    longest = max(lengths)
    what = f"the longest sequence ({longest} tokens)"
    _check_lists(kv_count, kv_indices, (len(lengths), q.shape[1]), longest, block_q, block_k, what)
    devices = {t.device for t in (q, k, v, kv_count, kv_indices, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    return lengths


def block_geometry(seq_len: int, block_q: int, block_k: int, device=None) -> tuple[Tensor, Tensor]:
    """bool [Mq, Mk] pair (causal, full) of block-level causality.

    causal: key block j holds a key <= some query of block i (the pair is worth computing).
    full:   every key of j is <= every query of i (the causal mask does not bite inside the pair).
    A causal pair that is not full is a diagonal pair: it needs the element-wise causal mask.
    """
    mq, mk = math.ceil(seq_len / block_q), math.ceil(seq_len / block_k)
    first_q = torch.arange(mq, device=device) * block_q  # [Mq]
    last_q = torch.clamp(first_q + block_q, max=seq_len) - 1
    first_k = torch.arange(mk, device=device) * block_k  # [Mk]
    last_k = torch.clamp(first_k + block_k, max=seq_len) - 1
    causal = first_k[None, :] <= last_q[:, None]
    full = last_k[None, :] <= first_q[:, None]
    return causal, full


def block_mask_from_lists(kv_count: Tensor, kv_indices: Tensor) -> Tensor:
    """bool [B, H, Mq, Mk] from the (count, indices) lists; padded slots are ignored."""
    mk = kv_indices.shape[-1]
    valid = torch.arange(mk, device=kv_count.device) < kv_count[..., None]  # [B, H, Mq, Mk]
    # Padded slots write to a spare column mk, which is cut off; ids there may be anything.
    cols = torch.where(valid, kv_indices.long(), mk)
    out = torch.zeros(*kv_indices.shape[:-1], mk + 1, dtype=torch.bool, device=kv_count.device)
    return out.scatter_(-1, cols, True)[..., :mk]


def block_lists_from_mask(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(count int32 [..., Mq], indices int32 [..., Mq, Mk]) from a bool block mask.

    Kept ids come first in ascending order; the padding is the remaining ids (all in range).
    """
    count = mask.sum(-1, dtype=torch.int32)
    # A stable sort of "not kept" puts the kept ids first, each group in ascending order.
    indices = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, indices


def expand_block_mask(mask_blocks: Tensor, block_q: int, block_k: int, seq_len: int) -> Tensor:
    """bool [B, H, N, N]: a block mask [B, H, Mq, Mk] expanded to tokens, AND the causal tril.

    For tests and small inputs: the token mask to give dense SDPA as the ground truth.
    """
    pos = torch.arange(seq_len, device=mask_blocks.device)
    tokens = mask_blocks[:, :, pos // block_q][:, :, :, pos // block_k]  # [B, H, N, N]
    return tokens & (pos[None, :] <= pos[:, None])


def block_sparse_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    scale: float | None = None,
    return_lse: bool = False,
    chunk_elements: int = 1 << 19,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse causal prefill attention in PyTorch, many query blocks per batched product.

    q [B, Hq, N, D], k/v [B, Hkv, N, D] (query head h reads kv head h // (Hq // Hkv)),
    kv_count int32 [B, Hq, Mq], kv_indices int32 [B, Hq, Mq, Mk]. Only the kept key blocks are
    gathered, so the cost scales with density. The (batch, head, query block) rows are ordered
    by their kept count and taken in runs: a run gathers each row's kept key blocks, padded to the
    run's largest count C, as [rows, C * block_k, D] and scores them as one batched product, so
    rows of similar counts share a run and little is padded. A run holds as many rows as keep its
    fp32 scores within `chunk_elements` (at least one row; 2^19, 2 MiB, by default: a CPU core's
    cache). Kept ids past the last key block are ignored. The softmax runs in fp32; a query row
    that sees no key gets output 0 and lse -inf.

    Returns out [B, Hq, N, D] in q's dtype, and with `return_lse` also the natural-log
    logsumexp of the scaled scores, fp32 [B, Hq, N].
    """
    check_block_sparse_inputs(q, k, v, kv_count, kv_indices, block_q, block_k)
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = q.device
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    # whole blocks of fp32 rows, zero-padded: queries [B * Hq * Mq, Bq, D], keys [B, Hkv, Mk, Bk, D]
    qb = F.pad(q.float(), (0, 0, 0, mq * block_q - n)).reshape(b * hq * mq, block_q, d)
    kb = F.pad(k.float(), (0, 0, 0, mk * block_k - n)).reshape(b, -1, mk, block_k, d)
    vb = F.pad(v.float(), (0, 0, 0, mk * block_k - n)).reshape(b, -1, mk, block_k, d)
    out = torch.zeros(b * hq * mq, block_q, d, dtype=q.dtype, device=dev)
    lse = torch.full((b * hq * mq, block_q), -math.inf, device=dev) if return_lse else None

    counts = kv_count.reshape(-1)  # per row (b, h, i), flat
    order = torch.argsort(counts, stable=True)
    widths = counts[order].tolist()  # one host sync for all rows
    lists = kv_indices.reshape(-1, mk)
    key_offsets = torch.arange(block_k, device=dev)
    q_offsets = torch.arange(block_q, device=dev)
    no_key = torch.iinfo(torch.int64).max  # the position of a padded slot: after every query
    per_slot = block_q * block_k  # score elements per row and kept slot

    # rows that keep nothing come first and stay 0 / -inf
    r0 = next((r for r, w in enumerate(widths) if w > 0), len(widths))
    while r0 < len(widths):
        r1 = r0 + 1
        while r1 < len(widths) and (r1 + 1 - r0) * per_slot * widths[r1] <= chunk_elements:
            r1 += 1
        width = widths[r1 - 1]  # the run's largest count (rows are sorted by count)
        rows = order[r0:r1]
        bi, hi, qi = rows // (hq * mq), rows // mq % hq, rows % mq
        ids = lists[rows, :width].long()  # [R, C]
        slot_ok = (torch.arange(width, device=dev) < counts[rows, None]) & (ids >= 0) & (ids < mk)
        ids = torch.where(slot_ok, ids, 0)
        key_pos = ids[..., None] * block_k + key_offsets  # [R, C, Bk]
        key_pos = torch.where(slot_ok[..., None] & (key_pos < n), key_pos, no_key).flatten(1)
        where = (bi[:, None], (hi // group)[:, None], ids)  # [R, C]: batch, kv head, key block
        ks, vs = kb[where].flatten(1, 2), vb[where].flatten(1, 2)  # [R, L, D], L = C * Bk
        s = torch.bmm(qb[rows], ks.transpose(1, 2)).mul_(scale)  # [R, Bq, L]
        q_pos = qi[:, None] * block_q + q_offsets  # [R, Bq]
        s.masked_fill_(key_pos[:, None, :] > q_pos[:, :, None], -math.inf)
        seen = key_pos.amin(-1, keepdim=True) <= q_pos  # [R, Bq]: the row sees a key
        if return_lse:
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m).exp_()  # exactly 0 where masked
            denom = p.sum(-1, keepdim=True)
            acc = torch.bmm(p, vs) / denom.clamp_min(1e-30)
            row_lse = (m + torch.log(denom.clamp_min(1e-30))).squeeze(-1)
            lse[rows] = torch.where(seen, row_lse, -math.inf)
        else:
            acc = torch.bmm(torch.softmax(s, -1), vs)  # NaN on rows that see no key
        out[rows] = torch.where(seen[..., None], acc, 0.0).to(q.dtype)
        r0 = r1

    out = out.view(b, hq, mq * block_q, d)[:, :, :n].contiguous()
    if return_lse:
        return out, lse.view(b, hq, mq * block_q)[:, :, :n].contiguous()
    return out


def block_sparse_attention_varlen_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    cu_seqlens: Tensor,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """`block_sparse_attention_ref` over packed sequences, one sequence at a time.

    q [1, Hq, total, D], k/v [1, Hkv, total, D] hold S sequences at the offsets cu_seqlens
    int32 [S + 1]; kv_count [S, Hq, Mq_max] / kv_indices [S, Hq, Mq_max, Mk_max] hold each
    sequence's selection with block ids local to it (ids past a shorter sequence's last block
    are ignored). No attention crosses a sequence boundary.
    """
    lengths = check_varlen_inputs(q, k, v, kv_count, kv_indices, block_q, block_k, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    start = 0
    for s, n in enumerate(lengths):
        if n > 0:
            mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
            rows = slice(start, start + n)
            # Kept ids past this sequence's own last block attend to nothing: drop them.
            kept = block_mask_from_lists(kv_count[s : s + 1], kv_indices[s : s + 1])
            count, indices = block_lists_from_mask(kept[:, :, :mq, :mk])
            o = block_sparse_attention_ref(
                q[:, :, rows],
                k[:, :, rows],
                v[:, :, rows],
                count,
                indices,
                block_q,
                block_k,
                scale=scale,
                return_lse=return_lse,
            )
            if return_lse:
                o, lse[:, :, rows] = o
            out[:, :, rows] = o
        start += n
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Triton kernel: one program per (query tile of BLOCK_M <= 128 rows, query head, batch or
# sequence); a query block of more rows than BLOCK_M runs as several tiles.
# It walks the tile's kept key blocks in ascending order with an online softmax (exp2, the
# scale folded into log2(e) and applied to the fp32 scores, never to bf16 operands). The kept
# ids split into three runs, counted up front: blocks that lie wholly before the tile's first
# query (no mask at all: the hot loop), blocks that cross the diagonal or the end of the
# sequence (causal mask), and blocks after the tile's last query (skipped). K/V are read through
# kv head h // GROUP, never repeated: with TMA through 4-d tensor descriptors over the tensors'
# own strides (rows past the tensor's end read as zeros), else through pointers.
# docs/kernels.md records the configurations timed and why the tuning space holds these.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .fp8_gemm import _dynamic_scales, _rounded, _to_e4m3

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        bat,
        kv_h,
        row,
        start_n,
        offs_m,
        offs_n,
        offs_d,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        seq_len,
        qk_scale,
        diag,
        MASKED: tl.constexpr,
        MERGED: tl.constexpr,
        TMA: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        # MASKED: causal mask on this tile; MERGED: mask only where the runtime flag diag says.
        # k_src/v_src: tensor descriptors (TMA) or the (batch, kv head) base pointers; row is
        # the tile's first key row in the tensor (sequence offset + start_n).
        cols = start_n + offs_n  # [BLOCK_N] key positions in the sequence
        if TMA:
            k = k_src.load([bat, kv_h, row, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k_ptrs = k_src + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
            if MASKED or MERGED:
                k = tl.load(k_ptrs, mask=cols[:, None] < seq_len, other=0.0)  # [BLOCK_N, D]
            else:
                k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] raw scores, fp32
        if MERGED:
            if diag:
                s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        elif MASKED:
            # keys past the end of the sequence are later than every real query too
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
        p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_src.load([bat, kv_h, row, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            v_ptrs = v_src + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if MASKED or MERGED:
                v = tl.load(v_ptrs, mask=cols[:, None] < seq_len, other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _block_sparse_fwd_kernel(
        Q,
        K,
        V,
        KDesc,
        VDesc,
        Out,
        Lse,
        OutScales,
        KvCount,
        KvIndices,
        CuSeqlens,
        stride_qb,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_on,
        stride_od,
        stride_lb,
        stride_lh,
        stride_ln,
        stride_sh,
        stride_sm,
        stride_cb,
        stride_ch,
        stride_cm,
        stride_ib,
        stride_ih,
        stride_im,
        stride_ik,
        seq_len,
        max_len,
        num_heads,
        num_k_blocks,
        qk_scale,
        len_bucket,  # only the autotuner's key (`_len_bucket`)
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCAN: tl.constexpr,
        VARLEN: tl.constexpr,
        STORE_LSE: tl.constexpr,
        MERGE_DIAG: tl.constexpr,
        TMA: tl.constexpr,
        ORDER: tl.constexpr,
        QUANT: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # Program order; late (heavy) tiles first in every order.
        # 0: grid (tiles, Hq, B): the tiles of one query head side by side.
        # 1: grid (tiles * Hq, B): per kv head, the GROUP query heads of one tile side by side
        #    (they share that kv head's window, sink and often scored blocks in L2).
        # 2: grid (tiles * Hq, B): every query head of one tile side by side.
        pid = tl.program_id(0)
        num_q_tiles = tl.cdiv(max_len, BLOCK_M)  # of the longest sequence
        if ORDER == 0:
            tile = num_q_tiles - 1 - pid
            h = tl.program_id(1)
        elif ORDER == 1:
            per_kv = num_q_tiles * GROUP
            r = pid % per_kv
            tile = num_q_tiles - 1 - r // GROUP
            h = (pid // per_kv) * GROUP + r % GROUP
        else:
            tile = num_q_tiles - 1 - pid // num_heads
            h = pid % num_heads
        b = tl.program_id(2) if ORDER == 0 else tl.program_id(1)  # batch, or sequence (VARLEN)
        if VARLEN:
            row32 = tl.load(CuSeqlens + b)
            row0 = row32.to(tl.int64)
            seq_len = (tl.load(CuSeqlens + b + 1) - row32).to(tl.int32)
            bat32 = 0
            bat = 0
        else:
            row32 = 0
            row0 = 0
            bat32 = b
            bat = b.to(tl.int64)
        q_start = tile * BLOCK_M
        if q_start >= seq_len:
            return
        kv_h = (h // GROUP).to(tl.int64)
        h64 = h.to(tl.int64)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len

        q_ptrs = Q + bat * stride_qb + h64 * stride_qh + row0 * stride_qn
        q_ptrs += offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        if TMA:
            k_src = KDesc
            v_src = VDesc
        else:
            k_src = K + bat * stride_kb + kv_h * stride_kh + row0 * stride_kn
            v_src = V + bat * stride_vb + kv_h * stride_vh + row0 * stride_vn
        kvh32 = h // GROUP

        # This tile's selection row; b is the batch or the sequence index.
        q_block = q_start // BLOCK_Q
        b64 = b.to(tl.int64)
        count = tl.load(KvCount + b64 * stride_cb + h64 * stride_ch + q_block * stride_cm)
        ids_row = KvIndices + b64 * stride_ib + h64 * stride_ih + q_block * stride_im
        q_last = tl.minimum(q_start + BLOCK_M, seq_len) - 1
        full_end = (q_start + 1) // BLOCK_K  # blocks < full_end end before the first query
        vis_end = q_last // BLOCK_K + 1  # blocks >= vis_end start after the last query
        # The first SCAN ids load alongside the count (not after it): one latency less.
        offs_scan = tl.arange(0, SCAN)
        ids = tl.load(ids_row + offs_scan * stride_ik, mask=offs_scan < num_k_blocks, other=0)
        kept = offs_scan < count
        n_full = tl.sum(((ids < full_end) & kept).to(tl.int32), 0)
        n_vis = tl.sum(((ids < vis_end) & kept).to(tl.int32), 0)
        for c0 in range(SCAN, count, SCAN):  # long lists (dense selections)
            slot = c0 + offs_scan
            ids = tl.load(ids_row + slot * stride_ik, mask=slot < count, other=vis_end)
            n_full += tl.sum((ids < full_end).to(tl.int32), 0)
            n_vis += tl.sum((ids < vis_end).to(tl.int32), 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Flattened (kept block, key tile) loop: BLOCK_K // BLOCK_N tiles per key block.
        TILES: tl.constexpr = BLOCK_K // BLOCK_N
        n_full_tiles = n_full * TILES
        # MERGE_DIAG: one pipelined loop with the mask behind a branch (one pipeline fill less:
        # pays when a tile keeps few blocks); else a mask-free loop, then the masked one.
        if MERGE_DIAG:
            for t in range(0, n_vis * TILES):
                j = tl.load(ids_row + (t // TILES) * stride_ik)
                start_n = j * BLOCK_K + (t % TILES) * BLOCK_N
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_src, v_src, bat32, kvh32, row32 + start_n, start_n,
                    offs_m, offs_n, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                    seq_len, qk_scale, t >= n_full_tiles, MASKED=False, MERGED=True, TMA=TMA,
                    BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                )  # fmt: skip
        else:
            for t in range(0, n_full_tiles):
                j = tl.load(ids_row + (t // TILES) * stride_ik)
                start_n = j * BLOCK_K + (t % TILES) * BLOCK_N
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_src, v_src, bat32, kvh32, row32 + start_n, start_n,
                    offs_m, offs_n, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                    seq_len, qk_scale, False, MASKED=False, MERGED=False, TMA=TMA,
                    BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                )  # fmt: skip
            for t in range(n_full_tiles, n_vis * TILES):
                j = tl.load(ids_row + (t // TILES) * stride_ik)
                start_n = j * BLOCK_K + (t % TILES) * BLOCK_N
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_src, v_src, bat32, kvh32, row32 + start_n, start_n,
                    offs_m, offs_n, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                    seq_len, qk_scale, True, MASKED=True, MERGED=False, TMA=TMA,
                    BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                )  # fmt: skip

        seen = l_i > 0.0  # a row that saw no key gets 0 and lse -inf
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_ptrs = Out + bat * stride_ob + h64 * stride_oh + row0 * stride_on
        o_ptrs += offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
        if QUANT:  # the o product's e4m3 input: a row of this head is one group of 128
            y = _rounded(out, Q.dtype.element_ty, ROUND)  # the values the unquantised path writes
            s = _dynamic_scales(y)
            tl.store(o_ptrs, _to_e4m3(y, s, ROUND), mask=row_ok[:, None])
            s_rows = (bat * seq_len + row0 + offs_m) * stride_sm
            tl.store(OutScales + h64 * stride_sh + s_rows, s, mask=row_ok)
        else:
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            lse = (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453  # log2 -> ln
            lse = tl.where(seen, lse, float("-inf"))
            l_ptrs = Lse + bat * stride_lb + h64 * stride_lh + (row0 + offs_m) * stride_ln
            tl.store(l_ptrs, lse, mask=row_ok)

    def _set_desc_blocks(nargs) -> None:
        """Autotuner pre-hook: the descriptors' block shape follows the config's BLOCK_N."""
        for name in ("KDesc", "VDesc"):
            desc = nargs[name]
            if isinstance(desc, TensorDescriptor):
                desc.block_shape = [1, 1, nargs["BLOCK_N"], nargs["HEAD_DIM"]]


try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no triton, or one without them: the pointer path only
    TensorDescriptor = None

# The tuning spaces: (BLOCK_N, num_warps, num_stages, maxnreg, MERGE_DIAG, TMA, ORDER, BLOCK_M);
# BLOCK_N is capped at block_k, BLOCK_M at min(block_q, 128). `tuning_space` picks one by the
# GPU's architecture (`triton_util.kernel_arch`; RBS_KERNEL_ARCH=sm80 forces the Ampere one).
# Read with docs/kernels.md, which has the timings behind each entry.
#
# Hopper (capability 9.0+): TMA (tensor-descriptor) loads and register caps tuned on an H100.
# With num_stages=2 the loads of tile t + 1 are issued after tile t's last MMA, so within one
# program nothing hides them; with 3 stages one tile's compute hides the next tile's loads.
# Two programs of 8 warps share an SM only at <= 128 registers, where a 64-key tile makes ptxas
# serialise the wgmma instructions (no register room for an asynchronous accumulator); a 32-key
# tile fits asynchronously in 128 registers with 3-4 stages in 80-96 KB of shared memory. None
# wins everywhere on an H100: the 32-key tile with every head of a tile side by side is 20%
# faster at 32K-64K and 5% slower at 128K than the 64-key one, so the tuner picks per length.
HOPPER_SPACE = (
    (64, 8, 2, 128, False, False, 0, 128),  # the previous default: pointers, 2 programs per SM
    (64, 8, 2, 128, False, False, 2, 128),
    (64, 8, 2, 128, False, True, 1, 128),
    (64, 8, 2, 128, False, True, 2, 128),
    (32, 8, 4, 128, False, True, 2, 128),  # fastest at 32K-64K (H100): 2 programs, async wgmma
    (128, 8, 3, None, False, False, 0, 128),  # one program per SM, asynchronous wgmma
    (128, 8, 2, None, False, True, 0, 128),
    (128, 8, 2, None, False, True, 2, 128),
    (64, 4, 2, None, False, True, 2, 64),
)
TUNING_SPACE = HOPPER_SPACE  # the name the variants bench and the tests have used
# Ampere and Ada (capability 8.x: A100 with 108 SMs, 164 KB of shared memory and 64K registers
# per SM; mma.sync fed by cp.async pipelines, no TMA): pointer loads and no register caps. ptxas
# for sm_80 (triton 3.9) puts the Hopper space's 128-register 64-key tile at 296 bytes of spills;
# without caps, at head dim 128: 128 x 64 tiles in 8 warps take 206-211 registers (one program
# per SM, 64 KB at 2 stages, 96 KB at 3), 128 x 32 in 8 warps 198, 64 x 32 in 4 warps 168 (three
# programs per SM by registers and shared memory, 52 KB each at 3 stages), 64 x 64 in 4 warps
# 255 (two per SM); none spills. Orders 1 and 2 keep a kv head's query heads side by side for
# L2 reuse of K/V as on the H100 (A100's L2: 40 MB). Not yet timed on an A100.
SM80_SPACE = (
    (64, 8, 2, None, False, False, 1, 128),
    (64, 8, 3, None, False, False, 1, 128),
    (64, 8, 2, None, False, False, 2, 128),
    (32, 8, 3, None, False, False, 2, 128),
    (32, 4, 3, None, False, False, 1, 64),
    (32, 4, 3, None, False, False, 2, 64),
    (64, 4, 2, None, False, False, 1, 64),
    (32, 4, 4, None, False, False, 0, 64),
)
POINTER_SPACE = tuple(c for c in TUNING_SPACE if not c[5]) or (
    (64, 8, 2, 128, False, False, 0, 128),
)


def tuning_space(device=None) -> tuple:
    """The autotuner's configurations for the device's architecture: `HOPPER_SPACE` at
    capability 9.0 and up (its TMA entries dropped where k/v cannot take descriptors),
    `SM80_SPACE` below (pointer loads only)."""
    return HOPPER_SPACE if kernel_arch(device) >= 90 else SM80_SPACE


if HAS_TRITON:

    def _config(bn, warps, stages, maxnreg, merge, tma, order, bm) -> triton.Config:
        kwargs = {"BLOCK_N": bn, "MERGE_DIAG": merge, "TMA": tma, "ORDER": order, "BLOCK_M": bm}
        return triton.Config(
            kwargs,
            num_warps=warps,
            num_stages=stages,
            maxnreg=maxnreg,
            pre_hook=_set_desc_blocks if tma else None,
        )

    @functools.cache
    def _tuned_kernel(block_q: int, block_k: int, space: tuple):
        bm_max = min(block_q, 128)
        capped = dict.fromkeys((min(c[0], block_k), *c[1:7], min(c[7], bm_max)) for c in space)
        key = ["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "GROUP", "VARLEN", "STORE_LSE", "len_bucket"]
        return autotune([_config(*c) for c in capped], key)(_block_sparse_fwd_kernel)


def _len_bucket(n: int) -> int:
    """Sequence lengths that share one tuning result: the power of two at or above n (at least
    1024). Keyed on the exact length, every prompt of a new length (each LongBench or Video-MME
    sample) would re-run the tuner inside its timed prefill."""
    return max(1024, 1 << (n - 1).bit_length())


def _interpreted() -> bool:
    """True when the kernel was built by triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return HAS_TRITON and type(_block_sparse_fwd_kernel).__name__ == "InterpretedFunction"


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _tma_ok(*tensors: Tensor) -> bool:
    """Tensor descriptors can read these: fp16/bf16, last dim contiguous, 16-byte aligned."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        size = t.element_size()
        if t.dtype not in (torch.float16, torch.bfloat16) or t.stride(-1) != 1:
            return False
        if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: Tensor, block_n: int):
    """A 4-d descriptor over [B, H, N, D] with t's own strides; rows past N read as zeros."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, t.shape[-1]])


def _check_out(out: Tensor, q: Tensor, dtype: torch.dtype | None = None) -> None:
    """out [B, Hq, N, D] like q, in `dtype` (q's by default), on q's device, not overlapping."""
    dtype = dtype or q.dtype
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        raise ValueError(
            f"out must be [B, Hq, N, D] = {tuple(q.shape)} {dtype} on {q.device}; got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if any(s < 0 for s in out.stride()) or _overlapping(out):
        raise ValueError(f"out must not overlap itself; got strides {out.stride()}")


def _check_quantised_out(out: Tensor | None, out_scales: Tensor, q: Tensor) -> None:
    """The FP8 output of `block_sparse_attention(out_scales=...)`: out e4m3 [B, Hq, N, 128]
    (any non-overlapping strides), out_scales fp32 [Hq, B * N]."""
    b, hq, n, d = q.shape
    if out is None or out.dtype != torch.float8_e4m3fn or d != QUANT_GROUP:
        raise ValueError(
            f"a quantised output needs out float8_e4m3fn [B, Hq, N, D] and D = {QUANT_GROUP}; "
            f"got {None if out is None else out.dtype} and D = {d}"
        )
    _check_out(out, q, torch.float8_e4m3fn)
    want = (hq, b * n)
    if (
        tuple(out_scales.shape) != want
        or out_scales.dtype != torch.float32
        or out_scales.device != q.device
    ):
        raise ValueError(
            f"out_scales must be float32 {list(want)} on {q.device}; got {out_scales.dtype} "
            f"{list(out_scales.shape)} on {out_scales.device}"
        )


def _overlapping(t: Tensor) -> bool:
    """True when two indices of t share memory (a broadcast or expanded view)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * size
    return False


def _launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    scale: float | None,
    return_lse: bool,
    cu_seqlens: Tensor | None,
    config: dict | None = None,
    out: Tensor | None = None,
    space: tuple | None = None,
    out_scales: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Check, allocate and launch.

    `config` (BLOCK_N, MERGE_DIAG, TMA, ORDER, BLOCK_M, num_warps, num_stages, maxnreg) skips
    autotuning; `space` replaces the autotuner's `tuning_space(q.device)` (tuning runs, tests).
    """
    if not HAS_TRITON:
        raise RuntimeError(
            "block_sparse_attention needs triton (pip install triton); "
            "use block_sparse_attention_ref or the flex executor without it"
        )
    if cu_seqlens is None:
        check_block_sparse_inputs(q, k, v, kv_count, kv_indices, block_q, block_k)
        lengths = None
    else:
        lengths = check_varlen_inputs(q, k, v, kv_count, kv_indices, block_q, block_k, cu_seqlens)
    d = q.shape[-1]
    if not (_is_pow2(d) and 16 <= d <= 128):
        raise ValueError(f"head dim must be a power of two in [16, 128]; got {d}")
    if not (_is_pow2(block_q) and _is_pow2(block_k) and min(block_q, block_k) >= 16):
        raise ValueError(
            f"block sizes must be powers of two >= 16; got block_q={block_q}, block_k={block_k}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        q.dtype == k.dtype == v.dtype
    ):
        raise ValueError(
            f"q, k, v must share one of float16/bfloat16/float32; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"scale must be positive; got {scale}")
    if out_scales is not None:
        _check_quantised_out(out, out_scales, q)
    elif out is not None:
        _check_out(out, q)
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(
            "the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported); use block_sparse_attention_ref on the CPU"
        )
    if out is None:
        out = torch.empty_like(q)

    b, hq, n, _ = q.shape
    if return_lse:
        lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)  # never written
    longest = n if lengths is None else max(lengths)
    if longest == 0:
        return (out, lse) if return_lse else out
    seqs = b if lengths is None else len(lengths)

    # TMA descriptors on Hopper and newer (and in the interpreter, which emulates them)
    tma = _tma_ok(k, v) and (_interpreted() or kernel_arch(q.device) >= 90)
    if config is None and _interpreted():  # no timing under the interpreter
        config = {"BLOCK_N": min(block_k, 64), "num_warps": 4}
    if config is not None:
        config = {"MERGE_DIAG": False, "TMA": False, "ORDER": 0, "BLOCK_M": 128, **config}
        config["BLOCK_M"] = min(config["BLOCK_M"], block_q)  # a larger block runs as tiles
        if config["TMA"] and not tma:
            raise ValueError(
                "TMA=True needs a GPU of capability 9.0 or newer (and RBS_KERNEL_ARCH unset) "
                "and fp16/bf16 k/v with 16-byte aligned strides"
            )
    block_n = min(block_k, 64) if config is None else config["BLOCK_N"]
    descs = (_descriptor(k, block_n), _descriptor(v, block_n)) if tma else (k, v)

    args = (
        q, k, v, *descs, out, lse, lse if out_scales is None else out_scales, kv_count,
        kv_indices, kv_count if cu_seqlens is None else cu_seqlens,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        *((0, 0) if out_scales is None else out_scales.stride()),
        *kv_count.stride(), *kv_indices.stride(),
        n, longest, hq, kv_indices.shape[-1], scale * 1.4426950408889634, _len_bucket(longest),
    )  # fmt: skip
    meta = dict(
        GROUP=hq // k.shape[1],
        HEAD_DIM=d,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        SCAN=8 if _interpreted() else 128,  # small lists in CPU tests still take two chunks
        VARLEN=cu_seqlens is not None,
        STORE_LSE=return_lse,
        QUANT=out_scales is not None,
        ROUND=_interpreted(),
    )

    def grid(meta):
        tiles = math.ceil(longest / meta["BLOCK_M"])
        if meta["ORDER"] == 0:
            return (tiles, hq, seqs)
        return (tiles * hq, seqs)

    if config is None:
        space = space or tuning_space(q.device)
        space = tuple(c for c in space if tma or not c[5]) or POINTER_SPACE
        _tuned_kernel(block_q, block_k, autotune_space(space))[grid](*args, **meta)
    else:
        _block_sparse_fwd_kernel[grid(config)](*args, **meta, **config)
    return (out, lse) if return_lse else out


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
    out_scales: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse causal prefill attention, Triton forward kernel (CUDA; CPU when interpreted).

    Same semantics as `block_sparse_attention_ref`: q [B, Hq, N, D], k/v [B, Hkv, N, D] (query
    head h reads kv head h // (Hq // Hkv)), kv_count int32 [B, Hq, Mq], kv_indices int32
    [B, Hq, Mq, Mk] (kept ids ascending, padding ignored). Kept blocks after a query block's
    last query are skipped; the causal mask is applied only where a key block crosses the
    diagonal. fp32 accumulation; a row that sees no key gets 0 and lse -inf.

    With `cu_seqlens` int32 [S + 1], q/k/v are packed [1, H, total, D] and the lists are
    [S, Hq, Mq_max] / [S, Hq, Mq_max, Mk_max] with block ids local to each sequence
    (see `block_sparse_attention_varlen_ref`); sequences never attend to each other.

    q/k/v may be any strided views (e.g. a model's [B, N, H, D] projections seen through
    `.transpose(1, 2)`). `out`, if given, receives the result instead of a new tensor: [B, Hq,
    N, D] like q, any non-overlapping strides, so `torch.empty(B, N, Hq, D).transpose(1, 2)`
    makes the kernel write a model's [B, N, Hq, D] layout directly.

    Needs block_q, block_k powers of two >= 16, head dim a power of two <= 128, and
    float16/bfloat16 (float32 runs with tf32 dots on the GPU). Returns out in q's dtype, and
    with `return_lse` also the natural-log logsumexp fp32 [B, Hq, N].

    `out_scales` fp32 [Hq, B * N] (with an e4m3 `out`, head dim 128) writes the output quantised
    for a block-FP8 output projection instead: each row of each head is one activation group,
    its values rounded to q's dtype (what the output would hold) and quantised as
    `fp8_gemm.fp8_act_quant` quantises them, its scale at [head, b * N + row] (the group-major
    layout `fp8_gemm.fp8_linear_quantised` reads, the projection's input being [B * N, Hq * D]).
    The same bytes as quantising the kernel's own output afterwards, without that pass.
    """
    return _launch(
        q, k, v, kv_count, kv_indices, block_q, block_k, scale, return_lse, cu_seqlens, out=out,
        out_scales=out_scales,
    )  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    b, hq, hkv, n, d, block = 1, 4, 2, 1000, 64, 128
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hkv, hkv))
    mq = math.ceil(n / block)
    causal, _ = block_geometry(n, block, block)
    mask = (torch.rand(b, hq, mq, mq) < 0.4) & causal
    mask |= torch.eye(mq, dtype=torch.bool)  # keep the diagonal so every row sees a key
    kv_count, kv_indices = block_lists_from_mask(mask)

    out = block_sparse_attention_ref(q, k, v, kv_count, kv_indices, block, block)
    token_mask = expand_block_mask(mask, block, block, n)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask, enable_gqa=True)
    density = kv_count.sum().item() / (b * hq * causal.sum().item())
    print(
        f"N={n} D={d} heads {hq}/{hkv} block {block}: density {density:.3f}, "
        f"max |ref - dense masked SDPA| = {(out - dense).abs().max().item():.2e}"
    )
    if HAS_TRITON and (torch.cuda.is_available() or _interpreted()):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        lists = (kv_count.to(dev), kv_indices.to(dev), block, block)
        kernel = block_sparse_attention(q.to(dev), k.to(dev), v.to(dev), *lists).cpu()
        print(f"max |triton kernel - ref| = {(kernel - out).abs().max().item():.2e} ({dev})")


if __name__ == "__main__":
    main()
