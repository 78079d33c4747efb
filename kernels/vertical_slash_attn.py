"""Vertical-slash sparse prefill attention (MInference's pattern): the line estimate, the selection
of the largest lines, and the executors, each as a PyTorch reference beside a Triton kernel.

A pattern is given per (batch, query head):

    columns   int [B, H, Nv]  kept key positions ("vertical" lines), 0 <= c < N
    diagonals int [B, H, Ns]  kept offsets d = query - key ("slash" lines), 0 <= d < N

Entries < 0 are padding; the valid entries of one (b, h) must be unique, in any order. Query p
attends to exactly {c in columns : c <= p} ∪ {p - d : d in diagonals, d <= p}, each key once.

The pattern is token-level, so it is not a `BlockSelection`; `vertical_slash_block_mask` gives the
block pairs it touches (what density counts).

Estimate (what MInference and FlexPrefill both start from): the causal softmax rows of the last L
queries against every key, summed per column (vertical) and per diagonal offset (slash).
`vertical_slash_estimate_ref` in PyTorch; `vertical_slash_estimate` in two Triton launches that
never hold more than one [L, L] tile of probabilities per program (L <= 128):
  `_vs_lse_kernel`   one program per (b, h, key split): the rows' running max and sum over its keys;
  `_vs_mass_kernel`  the same grid: combines the splits' maxima and sums into each row's
                     log-sum-exp, recomputes the probabilities tile by tile, stores the column sums
                     (each column belongs to one tile) and adds the tile's diagonal sums into the
                     slash: the tile goes through a per-program scratch tile in device memory and
                     comes back read along its diagonals (a barrier on either side). With tiles as
                     wide as L, an offset gets contributions from at most two tiles, so the fp32
                     atomic adds give the same sum in any order.

Largest entries (the rules' "top k" and "fewest entries covering a mass"): `coverage_count` /
`top_mask` are the sort-based references; `coverage_select` and `top_k_ids` are a radix select in
Triton: eight passes over 4-bit digits of the values' fp32 bit patterns (order-preserving for
values >= 0), each program a chunk of a row and each pass resolving the previous pass's digit
histogram (counts, and masses for coverage) into the bucket that holds the boundary entry; a last
pass keeps the entries above the boundary value and the tied entries in index order (ties: lower
index first, as a stable sort). Nothing of the size of a sorted copy or an index tensor is built.

Executors (same inputs and result):
  `vertical_slash_attention_ref`   PyTorch, any device;
  `vertical_slash_attention`       Triton (CUDA, or the CPU under TRITON_INTERPRET=1): per
                                   64-query block, the kept diagonals' keys as contiguous key
                                   ranges (diagonals closer than the block merge into one range),
                                   then the kept columns gathered; one online softmax over both.
                                   Inside a range only keys on a kept diagonal count (an element
                                   mask); a gathered column is skipped for the queries that reach
                                   it through a kept diagonal, so no key counts twice;
  `vertical_slash_attention_flex`  compiled FlexAttention over the touched 128-blocks, CUDA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .shapes import check_qk
from .triton_util import check_triton_launch, jit, tl, triton


def check_vertical_slash_inputs(
    q: Tensor, k: Tensor, v: Tensor, columns: Tensor, diagonals: Tensor
) -> None:
    """Raise ValueError with a one-line message when shapes, ids or devices do not fit."""
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
    check_pattern(columns, diagonals, n, (b, hq))
    devices = {t.device for t in (q, k, v, columns, diagonals)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")


def check_pattern(columns: Tensor, diagonals: Tensor, seq_len: int, bh=None) -> None:
    """Raise ValueError unless columns/diagonals are integer [B, H, *] ids below seq_len, unique."""
    for name, ids in (("columns", columns), ("diagonals", diagonals)):
        if ids.dim() != 3 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"{name} must be an integer tensor [B, H, count]; got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        if bh is not None and tuple(ids.shape[:2]) != tuple(bh):
            raise ValueError(
                f"{name} must be [B, H, count] = [{bh[0]}, {bh[1]}, *]; got {tuple(ids.shape)}"
            )
        if ids.numel() and int(ids.max()) >= seq_len:
            raise ValueError(f"{name} holds {int(ids.max())}, past seq_len={seq_len}")
        srt = ids.sort(-1).values
        if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
            raise ValueError(f"{name} repeats an id within one (batch, head)")


def membership(ids: Tensor, n: int) -> Tensor:
    """bool [B, H, n]: x is one of the valid ids of its (b, h); padding (< 0) is ignored."""
    idx = torch.where(ids >= 0, ids.long(), n)  # padding writes to a spare slot, cut off below
    out = torch.zeros(*ids.shape[:-1], n + 1, dtype=torch.bool, device=ids.device)
    return out.scatter_(-1, idx, True)[..., :n]


def vertical_slash_token_mask(columns: Tensor, diagonals: Tensor, seq_len: int) -> Tensor:
    """bool [B, H, N, N]: key k is visible to query q. For tests and small inputs."""
    pos = torch.arange(seq_len, device=columns.device)
    off = pos[:, None] - pos[None, :]  # [N, N] query - key
    on_col = membership(columns, seq_len)[:, :, None, :]  # [B, H, 1, N]
    on_diag = membership(diagonals, seq_len)[:, :, off.clamp(min=0)]  # [B, H, N, N]
    return (on_col | on_diag) & (off >= 0)


def _block_bounds(seq_len: int, block: int, device) -> tuple[Tensor, Tensor]:
    first = torch.arange(math.ceil(seq_len / block), device=device) * block
    return first, torch.clamp(first + block, max=seq_len) - 1


def touched_blocks(
    on_col: Tensor | None, on_diag: Tensor | None, seq_len: int, block_q: int, block_k: int
) -> Tensor:
    """bool [B, H, Mq, Mk]: some (q, k) of the pair with k <= q is on a kept column or diagonal.

    on_col / on_diag: bool [B, H, N] memberships (None: that part is empty). Exact: query block
    [qa, qb] and key block [ka, kb] hold, with k <= q, the keys [ka, min(kb, qb)] and every offset
    in [max(0, qa - kb), qb - ka], so prefix sums over positions and offsets answer each pair.
    """
    ref = on_col if on_col is not None else on_diag
    dev = ref.device
    qa, qb = _block_bounds(seq_len, block_q, dev)
    ka, kb = _block_bounds(seq_len, block_k, dev)
    qa, qb, ka, kb = qa[:, None], qb[:, None], ka[None, :], kb[None, :]
    out = torch.zeros(*ref.shape[:2], qa.shape[0], ka.shape[1], dtype=torch.bool, device=dev)
    for member, lo, hi in (
        (on_col, ka.expand(qa.shape[0], -1), torch.minimum(kb, qb)),
        (on_diag, (qa - kb).clamp(min=0), qb - ka),
    ):
        if member is None:
            continue
        prefix = F.pad(member.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))  # [B,H,N+1]
        ok = hi >= lo  # [Mq, Mk]
        lo, hi = lo.clamp(min=0), torch.where(ok, hi, lo - 1) + 1
        out |= (prefix[..., hi] - prefix[..., lo] > 0) & ok
    return out


def full_diagonal_blocks(on_diag: Tensor, seq_len: int, block: int) -> Tensor:
    """bool [B, H, M, M]: pairs strictly below the diagonal whose every offset is a kept diagonal.

    Every (q, k) of such a pair is attended, so an executor may skip the element mask there.
    """
    qa, qb = _block_bounds(seq_len, block, on_diag.device)
    qa, qb, ka, kb = qa[:, None], qb[:, None], qa[None, :], qb[None, :]
    below = kb < qa  # every key before every query
    lo, hi = (qa - kb).clamp(min=0), torch.where(below, qb - ka, qa - kb)
    prefix = F.pad(on_diag.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
    return (prefix[..., hi + 1] - prefix[..., lo] == hi - lo + 1) & below


def vertical_slash_block_mask(
    columns: Tensor, diagonals: Tensor, seq_len: int, block_q: int = 128, block_k: int | None = None
) -> Tensor:
    """bool [B, H, Mq, Mk]: the causal block pairs the pattern touches (what density counts)."""
    block_k = block_q if block_k is None else block_k
    on_col, on_diag = membership(columns, seq_len), membership(diagonals, seq_len)
    return touched_blocks(on_col, on_diag, seq_len, block_q, block_k)


def vertical_slash_estimate_ref(
    q: Tensor, k: Tensor, last_q: int, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Column and diagonal attention mass of the last `last_q` queries (fp32 [B, Hq, N] each).

    The rows are causal softmax(scale * q_r . k) of the last L = min(last_q, N) queries
    (scale defaults to 1/sqrt(d)).
    vertical[t] sums column t over the rows; slash[o] sums the entries at offset o = p_r - t.
    Each sums to L per head. K is read per KV head (no repeat), so the largest temporary is one
    KV head's [B, G, L, N] block of probabilities.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    big_l = min(last_q, n)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = q.device
    q_pos = torch.arange(n - big_l, n, device=dev)  # [L]
    pos = torch.arange(n, device=dev)
    visible = pos[None, :] <= q_pos[:, None]  # [L, N]
    diag_key = q_pos[:, None] - pos[None, :]  # [L, N]: key on offset o of row r is p_r - o
    vertical = torch.empty(b, hq, n, dtype=torch.float32, device=dev)
    slash = torch.empty_like(vertical)
    for j in range(hkv):
        qj = q[:, j * g : (j + 1) * g, n - big_l :].float()  # [B, G, L, D]
        kj = k[:, j].float()  # [B, N, D]
        s = torch.matmul(qj, kj.transpose(-1, -2)[:, None]) * scale  # [B, G, L, N]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        vertical[:, j * g : (j + 1) * g] = p.sum(-2)
        on_diag = torch.gather(p, -1, diag_key.clamp(min=0).expand_as(p))
        slash[:, j * g : (j + 1) * g] = on_diag.masked_fill(diag_key < 0, 0.0).sum(-2)
    return vertical, slash


# ------------------------------------------------------------------ estimate: Triton kernels

MAX_LAST_Q = 128  # rows the estimate kernels hold in one tile
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a handful under the interpreter)."""
    if device.type != "cuda":
        return 2
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def _dot_inputs(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, bool]:
    """fp16/bf16 pairs go to the tensor cores as they are; anything else in fp32 (ieee dot)."""
    if q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16):
        return q, k, False
    return q.float(), k.float(), True


@jit
def _qk_tile(
    q, k_head, cols, k_hi, q_pos, offs_d, d_ok, stride_kn, stride_kd, qk_scale,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """[rows, cols] logits in log2 units, -inf where the key is after the row or past k_hi."""
    k_ptrs = k_head + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
    k = tl.load(k_ptrs, mask=(cols < k_hi)[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    vis = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < k_hi)
    return tl.where(vis, s * qk_scale, float("-inf"))


@jit
def _vs_lse_kernel(
    Q,
    K,
    Mpart,
    Lpart,
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
    stride_ps,
    stride_pr,
    n_ctx,
    big_l,
    heads,
    group,
    d_head,
    keys_per_split,
    qk_scale,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # running max / sum (log2 units) of the last big_l rows over this program's key split
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    rows = tl.arange(0, BLOCK_L)
    q_pos = n_ctx - big_l + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d_head
    q_ptrs = Q + b * stride_qb + h * stride_qh + q_pos[:, None].to(tl.int64) * stride_qn
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd,
        mask=(rows < big_l)[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_head = K + b * stride_kb + hk * stride_kh
    k_lo = split * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, n_ctx)
    m_i = tl.full([BLOCK_L], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    for t0 in range(k_lo, k_hi, BLOCK_N):
        cols = t0 + tl.arange(0, BLOCK_N)
        s = _qk_tile(
            q, k_head, cols, k_hi, q_pos, offs_d, d_ok, stride_kn, stride_kd, qk_scale, DOT_F32
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    out = b * stride_pb + h * stride_ph + split * stride_ps + rows * stride_pr
    tl.store(Mpart + out, m_i)
    tl.store(Lpart + out, l_i)


@jit
def _vs_mass_kernel(
    Q,
    K,
    Mpart,
    Lpart,
    Out,
    Scratch,
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
    stride_ps,
    stride_pr,
    stride_ov,
    stride_ob,
    stride_oh,
    stride_on,
    n_ctx,
    big_l,
    heads,
    group,
    d_head,
    keys_per_split,
    splits,
    qk_scale,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    hk = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    rows = tl.arange(0, BLOCK_L)
    row_ok = rows < big_l
    q_pos = n_ctx - big_l + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d_head
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = Q + b * stride_qb + h * stride_qh + q_pos[:, None].to(tl.int64) * stride_qn
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    k_head = K + b * stride_kb + hk * stride_kh

    # each row's log2-sum-exp2 from the splits' running max and sum
    sp = tl.arange(0, BLOCK_S)
    part = b * stride_pb + h * stride_ph + sp[None, :] * stride_ps + rows[:, None] * stride_pr
    sp_ok = (sp[None, :] < splits) & row_ok[:, None]
    m_p = tl.load(Mpart + part, mask=sp_ok, other=float("-inf"))
    l_p = tl.load(Lpart + part, mask=sp_ok, other=0.0)
    m_row = tl.max(m_p, 1)
    m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
    l_row = tl.sum(l_p * tl.exp2(m_p - m_row[:, None]), 1)
    lse = m_row + tl.log2(tl.where(l_row > 0.0, l_row, 1.0))

    vert = Out + b * stride_ob + h * stride_oh
    slash = vert + stride_ov
    pid = split * tl.num_programs(0) + bh
    scratch = Scratch + pid.to(tl.int64) * (BLOCK_L * BLOCK_N)
    tile = scratch + rows[:, None] * BLOCK_N + offs_n[None, :]
    k_lo = split * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, n_ctx)
    for t0 in range(k_lo, k_hi, BLOCK_N):
        cols = t0 + offs_n
        s = _qk_tile(
            q, k_head, cols, k_hi, q_pos, offs_d, d_ok, stride_kn, stride_kd, qk_scale, DOT_F32
        )
        p = tl.where(row_ok[:, None], tl.exp2(s - lse[:, None]), 0.0)  # [BLOCK_L, BLOCK_N]
        tl.store(vert + cols * stride_on, tl.sum(p, 0), mask=cols < k_hi)
        # Row r, column j sits on offset o = (n - L - t0 - (BLOCK_N - 1)) + e, e = r + BLOCK_N
        # - 1 - j: the scratch tile read at j = r + BLOCK_N - 1 - e gives column e the entries
        # of one offset; e spans BLOCK_L + BLOCK_N - 1 < 2 BLOCK_N values, read in two halves.
        tl.store(tile, p)
        tl.debug_barrier()
        o_base = n_ctx - big_l - t0 - (BLOCK_N - 1)
        for half in tl.static_range(2):
            e = half * BLOCK_N + offs_n
            j = rows[:, None] + (BLOCK_N - 1) - e[None, :]
            j_ok = (j >= 0) & (j < BLOCK_N)
            # volatile: read what the other threads just stored, never a stale cached line
            z = tl.load(scratch + rows[:, None] * BLOCK_N + j, mask=j_ok, other=0.0, volatile=True)
            w = tl.sum(z, 0)
            o = o_base + e
            tl.atomic_add(
                slash + o * stride_on, w, mask=(o >= 0) & (o < n_ctx) & (w != 0.0), sem="relaxed"
            )
        tl.debug_barrier()  # the next tile overwrites the scratch tile


def estimate_supported(last_q: int, head_dim: int) -> bool:
    """Whether the Triton estimate takes this geometry (else use the reference)."""
    return 1 <= last_q and head_dim <= 256 and min(last_q, MAX_LAST_Q) == last_q


def _estimate(
    q: Tensor,
    k: Tensor,
    last_q: int,
    scale: float | None,
    splits: int | None = None,
    programs_per_sm: int = 4,
) -> Tensor:
    """fp32 [2, B, Hq, N]: (vertical, slash) of `vertical_slash_estimate` in one buffer."""
    check_triton_launch("vertical_slash_estimate", q, k)
    check_qk(q, k)
    b, hq, n, d = q.shape
    big_l = min(last_q, n)
    if not estimate_supported(big_l, d):
        raise ValueError(
            f"the Triton estimate takes at most {MAX_LAST_Q} last queries and head dim <= 256; "
            f"got last_q={last_q}, head dim {d}"
        )
    hkv = k.shape[1]
    q, k, dot_f32 = _dot_inputs(q, k)
    block_l = max(16, triton.next_power_of_2(big_l))
    block_n = block_l  # tiles as wide as the rows: each offset gets at most two tile sums
    tiles = math.ceil(n / block_n)
    if splits is None:
        splits = math.ceil(programs_per_sm * _sm_count(q.device) / (b * hq))
    splits = max(1, min(splits, tiles))
    keys_per_split = math.ceil(tiles / splits) * block_n
    splits = math.ceil(n / keys_per_split)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qk_scale = scale * math.log2(math.e)
    dev = q.device
    m_part = torch.empty(b, hq, splits, block_l, device=dev)
    l_part = torch.empty_like(m_part)
    out = torch.empty(2, b, hq, n, device=dev)
    out[1].zero_()  # slash: accumulated with atomic adds
    scratch = torch.empty(splits * b * hq, block_l, block_n, device=dev)
    block_d = max(16, triton.next_power_of_2(d))
    warps = 8 if block_l >= 64 else 4  # sm_90: 174 registers, no spills at L = 64, D = 128
    grid = (b * hq, splits)
    common = (
        n, big_l, hq, hq // hkv, d, keys_per_split,
    )  # fmt: skip
    _vs_lse_kernel[grid](
        q, k, m_part, l_part, *q.stride(), *k.stride(), *m_part.stride(), *common, qk_scale,
        BLOCK_L=block_l, BLOCK_N=block_n, BLOCK_D=block_d, DOT_F32=dot_f32, num_warps=warps,
    )  # fmt: skip
    _vs_mass_kernel[grid](
        q, k, m_part, l_part, out, scratch, *q.stride(), *k.stride(), *m_part.stride(),
        *out.stride(), *common, splits, qk_scale,
        BLOCK_L=block_l, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), DOT_F32=dot_f32, num_warps=warps,
    )  # fmt: skip
    return out


def vertical_slash_estimate(
    q: Tensor, k: Tensor, last_q: int, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Triton `vertical_slash_estimate_ref`: (vertical, slash), fp32 [B, Hq, N] each.

    q [B, Hq, N, D], k [B, Hkv, N, D] on CUDA (or the CPU under the interpreter); at most
    `MAX_LAST_Q` last queries. Workspace: the two outputs, a [L, L] fp32 scratch tile per program
    and the splits' row statistics; no [L, N] tensor is built.
    """
    out = _estimate(q, k, last_q, scale)
    return out[0], out[1]


# ------------------------------------------------ the largest entries: references and radix select


def coverage_count(p: Tensor, target) -> Tensor:
    """int64 [...]: size of the smallest set of entries of p (last dim, largest first) whose sum
    reaches `target` (float or tensor broadcastable to [...]); every entry when none does."""
    cum = torch.sort(p, dim=-1, descending=True).values.double().cumsum(-1)
    if isinstance(target, Tensor):
        target = target[..., None]
    return ((cum < target).sum(-1) + 1).clamp(max=p.shape[-1])


def top_mask(scores: Tensor, count: Tensor) -> Tensor:
    """bool like scores: the `count[...]` largest entries of the last dim (ties: lower index)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank_ok = torch.arange(scores.shape[-1], device=scores.device) < count[..., None]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, rank_ok)


def top_k_ids_ref(scores: Tensor, k: int) -> Tensor:
    """int32 [..., k]: positions of the k largest scores (ties: lower first), ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(-1).values.to(torch.int32)


_PASSES = 8  # 4-bit digits: the whole bit pattern of an fp32 value >= 0 (literal in kernels)


@jit
def _radix_resolve(
    Psum, Pcnt, chunks, stride_pc, prefix, a_mass, a_cnt, target_mass, target_cnt,
    BY_MASS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Fold one pass's per-chunk digit histograms (Psum / Pcnt point at the row) into the state.

    Returns (prefix with the boundary digit appended, mass above it, count above it, whether the
    whole bucket falls short of the target, the digit, the bucket entries with that digit).
    """
    d = tl.arange(0, 16)
    tot_c = tl.zeros([16], dtype=tl.int32)
    tot_s = tl.zeros([16], dtype=tl.float32)
    for c0 in range(0, chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = (c[:, None] < chunks) & (d[None, :] < 16)
        off = c[:, None] * stride_pc + d[None, :]
        tot_c += tl.sum(tl.load(Pcnt + off, mask=ok, other=0), 0)
        if BY_MASS:
            tot_s += tl.sum(tl.load(Psum + off, mask=ok, other=0.0), 0)
    # bucket entries (mass) in the digits above each digit: exact zeros above the highest one
    higher = d[None, :] > d[:, None]  # [digit, other digit]
    above_c = tl.sum(tl.where(higher, tot_c[None, :], 0), 1)
    if BY_MASS:
        above_s = tl.sum(tl.where(higher, tot_s[None, :], 0.0), 1)
        below = a_mass + above_s < target_mass
        short = a_mass + tl.sum(tot_s, 0) < target_mass
    else:
        above_s = tot_s
        below = a_cnt + above_c < target_cnt
        short = a_cnt + tl.sum(tot_c, 0) < target_cnt
    # the boundary entry's digit: the lowest digit whose higher digits still fall short
    digit = tl.minimum(tl.min(tl.where(below, d, 16), 0), 15)
    pick = d == digit
    a_cnt += tl.sum(tl.where(pick, above_c, 0), 0)
    if BY_MASS:
        a_mass += tl.sum(tl.where(pick, above_s, 0.0), 0)
    n_digit = tl.sum(tl.where(pick, tot_c, 0), 0)
    return prefix * 16 + digit, a_mass, a_cnt, short, digit, n_digit


@jit
def _radix_pass_kernel(
    V,
    Psum,
    Pcnt,
    StateI,
    StateF,
    TargetF,
    TargetI,
    stride_vr,
    stride_sp,
    stride_sr,
    stride_sc,
    stride_cp,
    stride_cr,
    stride_cc,
    stride_ir,
    stride_ip,
    stride_fr,
    stride_fp,
    row_len,
    chunk_len,
    chunks,
    p,
    BY_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    si = StateI + row * stride_ir
    sf = StateF + row * stride_fr
    # the state entering pass p: slot 0 is zero; pass p >= 1 folds pass p - 1 into slot p
    slot = tl.maximum(p - 1, 0)
    prefix = tl.load(si + slot * stride_ip)
    a_cnt = tl.load(si + slot * stride_ip + 1)
    short = tl.load(si + slot * stride_ip + 2)
    a_mass = tl.load(sf + slot * stride_fp)
    if p > 0:
        tm = tl.load(TargetF + row)
        tc = tl.load(TargetI + row)
        prefix, a_mass, a_cnt, short_now, _, _ = _radix_resolve(
            Psum + ((p - 1) % 2) * stride_sp + row * stride_sr,
            Pcnt + (p - 1) * stride_cp + row * stride_cr,
            chunks, stride_sc, prefix, a_mass, a_cnt, tm, tc, BY_MASS, BLOCK_C,
        )  # fmt: skip
        if p == 1:  # the whole row falls short: everything is kept
            short = short_now.to(tl.int32)
        if chunk == 0:
            tl.store(si + p * stride_ip, prefix)
            tl.store(si + p * stride_ip + 1, a_cnt)
            tl.store(si + p * stride_ip + 2, short)
            tl.store(sf + p * stride_fp, a_mass)

    shift = 28 - 4 * p
    d = tl.arange(0, 16)
    acc_c = tl.zeros([BLOCK, 16], dtype=tl.int32)
    acc_s = tl.zeros([BLOCK, 16], dtype=tl.float32)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, row_len)
    row_ptr = V + row * stride_vr
    for x0 in range(lo, hi, BLOCK):
        x = x0 + tl.arange(0, BLOCK)
        v = tl.load(row_ptr + x, mask=x < hi, other=0.0)
        key = tl.where(v > 0.0, v.to(tl.int32, bitcast=True), 0)  # order-preserving for v >= 0
        top = key >> shift
        inb = (x < hi) & ((top >> 4) == prefix)
        if tl.sum(inb.to(tl.int32), 0) > 0:  # late passes: most blocks hold no bucket entry
            hit = inb[:, None] & ((top & 15)[:, None] == d[None, :])
            acc_c += hit.to(tl.int32)
            if BY_MASS:
                acc_s += tl.where(hit, v[:, None], 0.0)
    tl.store(Pcnt + p * stride_cp + row * stride_cr + chunk * stride_cc + d, tl.sum(acc_c, 0))
    if BY_MASS:
        out = Psum + (p % 2) * stride_sp + row * stride_sr + chunk * stride_sc + d
        tl.store(out, tl.sum(acc_s, 0))


@jit
def _radix_final_kernel(
    V,
    Psum,
    Pcnt,
    StateI,
    StateF,
    TargetF,
    TargetI,
    Count,
    Mask,
    Ids,
    stride_vr,
    stride_sp,
    stride_sr,
    stride_sc,
    stride_cp,
    stride_cr,
    stride_cc,
    stride_ir,
    stride_ip,
    stride_fr,
    stride_fp,
    stride_mr,
    stride_dr,
    row_len,
    chunk_len,
    chunks,
    BY_MASS: tl.constexpr,
    WANT_MASK: tl.constexpr,
    WANT_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # the state entering the last pass (7) and its histogram, which resolves the last digit
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    si = StateI + row * stride_ir + 7 * stride_ip
    tm = tl.load(TargetF + row)
    tc = tl.load(TargetI + row)
    cnt_last = Pcnt + 7 * stride_cp + row * stride_cr
    thr, a_mass, a_cnt, _, digit, n_ties = _radix_resolve(
        Psum + (1) * stride_sp + row * stride_sr, cnt_last, chunks, stride_sc,
        tl.load(si), tl.load(StateF + row * stride_fr + 7 * stride_fp),
        tl.load(si + 1), tm, tc, BY_MASS, BLOCK_C,
    )  # fmt: skip
    short = tl.load(si + 2)
    # thr is the boundary entry's bit pattern; the entries above it are kept, and of the n_ties
    # entries equal to it the first keep_ties in index order (each while the sum before it is
    # below the target, or up to the count)
    if BY_MASS:
        v_thr = thr.to(tl.float32, bitcast=True)
        need = tm - a_mass
        ratio = tl.minimum(need / tl.maximum(v_thr, 1e-38), n_ties.to(tl.float32) + 1.0)
        keep_ties = tl.maximum(ratio, 0.0).to(tl.int32)
        keep_ties += (keep_ties.to(tl.float32) * v_thr < need).to(tl.int32)  # ceil
    else:
        keep_ties = tc - a_cnt
    keep_ties = tl.minimum(tl.maximum(keep_ties, 0), n_ties)
    if chunk == 0:
        total = a_cnt + keep_ties
        tl.store(Count + row, tl.where(short != 0, row_len, total))

    # ties (and, for ids, kept entries) in the chunks before this one
    d = tl.arange(0, 16)
    tie_before = tl.full([], 0, tl.int32)
    kept_before = tl.full([], 0, tl.int32)
    for c0 in range(0, chunk, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = c < chunk
        ties_c = tl.load(cnt_last + c * stride_cc + digit, mask=ok, other=0)
        if WANT_IDS:
            above = tl.zeros([BLOCK_C], dtype=tl.int32)
            for pp in tl.static_range(8):
                d_pp = (thr >> (28 - 4 * pp)) & 15  # the digit pass pp followed
                blk = Pcnt + pp * stride_cp + row * stride_cr + c[:, None] * stride_cc
                hist = tl.load(blk + d[None, :], mask=ok[:, None] & (d[None, :] > d_pp), other=0)
                above += tl.sum(hist, 1)
            tb = tie_before + tl.cumsum(ties_c, 0) - ties_c
            kept_ties = tl.minimum(tl.maximum(keep_ties - tb, 0), ties_c)
            kept_before += tl.sum(tl.where(ok, above + kept_ties, 0), 0)
        tie_before += tl.sum(ties_c, 0)
    if short != 0:
        kept_before = chunk * chunk_len

    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, row_len)
    row_ptr = V + row * stride_vr
    everything = (tl.zeros([BLOCK], dtype=tl.int32) + short) != 0
    for x0 in range(lo, hi, BLOCK):
        x = x0 + tl.arange(0, BLOCK)
        ok = x < hi
        v = tl.load(row_ptr + x, mask=ok, other=0.0)
        key = tl.where(v > 0.0, v.to(tl.int32, bitcast=True), 0)
        tie = ok & (key == thr)
        t32 = tie.to(tl.int32)
        rank = tie_before + tl.cumsum(t32, 0) - t32
        keep = ok & ((key > thr) | (tie & (rank < keep_ties)) | everything)
        tie_before += tl.sum(t32, 0)
        if WANT_MASK:
            tl.store(Mask + row * stride_mr + x, keep.to(tl.uint8), mask=ok)
        if WANT_IDS:
            k32 = keep.to(tl.int32)
            pos = kept_before + tl.cumsum(k32, 0) - k32
            tl.store(Ids + row * stride_dr + pos, x, mask=keep)
            kept_before += tl.sum(k32, 0)


def _radix_select(
    values: Tensor,
    target: Tensor,
    by_mass: bool,
    want_mask: bool,
    ids_width: int = 0,
    block: int | None = None,
    chunk_len: int | None = None,
    programs_per_sm: int = 8,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(count int32 [R], mask bool [R, L] or None, ids int32 [R, ids_width] or None)."""
    check_triton_launch("radix select", values, target)
    if values.dim() != 2:
        raise ValueError(f"values must be [rows, L]; got {tuple(values.shape)}")
    values = values.float()
    if values.stride(-1) != 1:
        values = values.contiguous()
    r, length = values.shape
    dev = values.device
    block = 256 if block is None else block
    if chunk_len is None:  # enough programs to fill the GPU; one per row under the interpreter
        programs = programs_per_sm * _sm_count(dev) if dev.type == "cuda" else r
        chunk_len = math.ceil(length / max(1, math.ceil(programs / max(r, 1))))
    chunk_len = max(block, math.ceil(chunk_len / block) * block)
    chunks = max(1, math.ceil(length / chunk_len))
    target = target.to(dev).expand(r)
    target_f = target.float().contiguous()
    target_i = target.clamp(min=-1, max=2**31 - 1).to(torch.int32).contiguous()
    psum = torch.empty(2, r, chunks, 16, device=dev)
    pcnt = torch.empty(_PASSES, r, chunks, 16, device=dev, dtype=torch.int32)
    state_i = torch.zeros(r, _PASSES, 4, device=dev, dtype=torch.int32)
    state_f = torch.zeros(r, _PASSES, device=dev)
    count = torch.empty(r, device=dev, dtype=torch.int32)
    mask = torch.empty(r, length, device=dev, dtype=torch.uint8) if want_mask else None
    ids = torch.full((r, max(ids_width, 1)), -1, device=dev, dtype=torch.int32)
    if r == 0 or length == 0:
        count.zero_()
        return count, mask, ids[:, :ids_width] if ids_width else None
    grid = (r, chunks)
    strides = (
        values.stride(0), *psum.stride()[:3], *pcnt.stride()[:3], *state_i.stride()[:2],
        *state_f.stride(),
    )  # fmt: skip
    block_c = 16 if dev.type != "cuda" else 64
    for p in range(_PASSES):
        _radix_pass_kernel[grid](
            values, psum, pcnt, state_i, state_f, target_f, target_i, *strides, length,
            chunk_len, chunks, p, BY_MASS=by_mass, BLOCK=block, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    _radix_final_kernel[grid](
        values, psum, pcnt, state_i, state_f, target_f, target_i, count,
        mask if want_mask else count, ids, *strides,
        mask.stride(0) if want_mask else 0, ids.stride(0), length, chunk_len, chunks,
        BY_MASS=by_mass, WANT_MASK=want_mask, WANT_IDS=ids_width > 0, BLOCK=block,
        BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    mask = mask.view(torch.bool) if want_mask else None
    return count, mask, ids[:, :ids_width] if ids_width else None


def coverage_select(
    values: Tensor, target, want_mask: bool = False, **launch
) -> tuple[Tensor, Tensor | None]:
    """Triton `coverage_count` (+ `top_mask`): rows of values fp32 [R, L] >= 0, target a float or
    fp32 [R]; (count int32 [R], bool mask [R, L] of the counted entries, or None).

    A target <= 0 counts one entry (the largest), as the reference does for rows with a positive
    entry. Sums are fp32 in a different order from the reference's fp64 cumulative sum, so an
    entry whose running sum sits within rounding of the target may go either way.
    """
    target = torch.as_tensor(target, dtype=torch.float32, device=values.device)
    target = target.clamp(min=torch.finfo(torch.float32).tiny)
    count, mask, _ = _radix_select(values, target, True, want_mask, **launch)
    return count, mask


def top_k_ids(values: Tensor, k: int, **launch) -> Tensor:
    """Triton `top_k_ids_ref` over rows [R, L] of values >= 0 (+inf allowed): int32 [R, k]."""
    if k <= 0:
        return torch.empty(values.shape[0], 0, dtype=torch.int32, device=values.device)
    k = min(k, values.shape[-1])
    target = torch.tensor(k, dtype=torch.int64, device=values.device)
    _, _, ids = _radix_select(values, target, False, False, ids_width=k, **launch)
    return ids


# ----------------------------------------------------------------- executors: PyTorch references


def vertical_slash_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    columns: Tensor,
    diagonals: Tensor,
    scale: float | None = None,
    block: int = 128,
    max_elements: int = 1 << 27,
) -> Tensor:
    """Vertical-slash causal prefill attention in PyTorch; out [B, Hq, N, D] in q's dtype.

    q [B, Hq, N, D], k/v [B, Hkv, N, D] (query head h reads KV head h // (Hq // Hkv), no repeat);
    columns / diagonals as in the module docstring. Query blocks of `block` rows are processed
    one at a time: the column keys are gathered once per head ([B, Hq, Nv, D]); the diagonal keys
    are read as the key blocks that hold some q - d of the block, and an element mask keeps
    exactly the keys on a kept diagonal (columns are excluded there so no key counts twice).
    Heads are split so that one step's temporaries stay near `max_elements` fp32 values.
    The softmax runs in fp32; a row that sees no key gets output 0.
    """
    check_vertical_slash_inputs(q, k, v, columns, diagonals)
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = q.device
    on_col, on_diag = membership(columns, n), membership(diagonals, n)  # [B, Hq, N]

    bidx = torch.arange(b, device=dev)[:, None, None]  # [B, 1, 1]
    kv_head = (torch.arange(hq, device=dev) // group)[None, :, None]  # [1, Hq, 1]
    col_ok = columns >= 0  # [B, Hq, Nv]
    cols = columns.long().clamp(min=0)
    kc, vc = k[bidx, kv_head, cols].float(), v[bidx, kv_head, cols].float()  # [B, Hq, Nv, D]

    # key blocks that hold a diagonal key of each query block, as padded ascending lists
    diag_blocks = touched_blocks(None, on_diag, n, block, block)  # [B, Hq, M, M]
    count = diag_blocks.sum(-1)  # [B, Hq, M]
    order = torch.argsort((~diag_blocks).to(torch.int8), dim=-1, stable=True)
    max_count = count.amax(dim=(0, 1)).tolist()  # one host sync
    key_offsets = torch.arange(block, device=dev)
    out = torch.zeros_like(q)

    for i, mc in enumerate(max_count):
        q0, q1 = i * block, min((i + 1) * block, n)
        q_pos = torch.arange(q0, q1, device=dev)  # [T]
        width = mc * block + cols.shape[-1]  # keys per row before masking
        per_head = b * width * (3 * (q1 - q0) + 2 * d)
        step = max(1, min(hq, max_elements // max(per_head, 1)))
        for h0 in range(0, hq, step):
            hs = slice(h0, min(h0 + step, hq))
            qi = q[:, hs, q0:q1].float()  # [B, h, T, D]
            scores = [torch.einsum("bhtd,bhld->bhtl", qi, kc[:, hs]) * scale]
            visible = [col_ok[:, hs, None, :] & (cols[:, hs, None, :] <= q_pos[:, None])]
            values = [vc[:, hs]]
            if mc:
                slot_ok = torch.arange(mc, device=dev) < count[:, hs, i, None]  # [B, h, mc]
                blocks = torch.where(slot_ok, order[:, hs, i, :mc], 0)
                key_pos = blocks[..., None] * block + key_offsets  # [B, h, mc, block]
                key_ok = (slot_ok[..., None] & (key_pos < n)).flatten(2)  # [B, h, L]
                key_pos = key_pos.clamp(max=n - 1).flatten(2)
                ks = k[bidx, kv_head[:, hs], key_pos].float()  # [B, h, L, D]
                off = q_pos[:, None] - key_pos[:, :, None, :]  # [B, h, T, L]
                diag_of = on_diag[:, hs, None, :].expand(-1, -1, q1 - q0, -1)
                on_kept_diag = torch.gather(diag_of, -1, off.clamp(min=0)) & (off >= 0)
                not_col = ~torch.gather(on_col[:, hs], -1, key_pos)  # [B, h, L]
                scores.append(torch.einsum("bhtd,bhld->bhtl", qi, ks) * scale)
                visible.append(on_kept_diag & (key_ok & not_col)[:, :, None, :])
                values.append(v[bidx, kv_head[:, hs], key_pos].float())
            s = torch.cat(scores, -1).masked_fill(~torch.cat(visible, -1), float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see nothing
            p = torch.exp(s - m)
            denom = p.sum(-1, keepdim=True)
            acc = torch.einsum("bhtl,bhld->bhtd", p, torch.cat(values, -2))
            o = torch.where(denom > 0, acc / denom.clamp_min(1e-30), 0.0)
            out[:, hs, q0:q1] = o.to(q.dtype)
    return out


# -------------------------------------------------------------------- executor: Triton kernel


def vertical_slash_index(
    columns: Tensor, diagonals: Tensor, seq_len: int, block_m: int
) -> tuple[Tensor, ...]:
    """What `vertical_slash_attention` reads, built on the pattern's device without a host sync.

    Returns on_diag uint8 [B, H, N] (offset d is a kept diagonal); the kept diagonals merged into
    groups, lo / hi int32 [B, H, G] (first and last offset of each group, ascending) with the
    group count int32 [B, H]; the kept columns ascending, int32 [B, H, Nv] (padding sorted last,
    as N); and the columns each query block sees, int32 [B, H, Mq] (those <= its last query).
    Two diagonals whose offsets differ by at most block_m share a group: for a query block their
    key spans overlap or touch, so a group is one contiguous key range per query block and the
    ranges of different groups never overlap.
    """
    b, h = diagonals.shape[:2]
    dev = diagonals.device
    big = seq_len + 2 * block_m + 2  # sorts padding last, beyond any merge gap
    on_diag = membership(diagonals, seq_len).to(torch.uint8)
    o = torch.where(diagonals >= 0, diagonals.long(), big).sort(-1).values  # [B, H, Ns]
    valid = o < seq_len
    prev = F.pad(o[..., :-1], (1, 0), value=-big)
    nxt = F.pad(o[..., 1:], (0, 1), value=big)
    first = valid & (o - prev > block_m)
    last = valid & (nxt - o > block_m)
    gid = first.cumsum(-1) - 1  # the group of each diagonal
    slots = o.shape[-1]
    lo = torch.zeros(b, h, slots + 1, dtype=torch.int32, device=dev)
    hi = torch.zeros_like(lo)
    lo.scatter_(-1, torch.where(first, gid, slots), o.to(torch.int32))
    hi.scatter_(-1, torch.where(last, gid, slots), o.to(torch.int32))
    count = first.sum(-1, dtype=torch.int32)
    cols = torch.where(columns >= 0, columns, seq_len).to(torch.int32).sort(-1).values
    cols = cols.contiguous()
    mq = math.ceil(seq_len / block_m)
    q_last = (torch.arange(1, mq + 1, device=dev) * block_m).clamp(max=seq_len) - 1
    seen = torch.searchsorted(
        cols, q_last.to(torch.int32).expand(b, h, mq).contiguous(), right=True
    )
    return on_diag, lo[..., :slots], hi[..., :slots], count, cols, seen.to(torch.int32)


@jit
def _online_update(acc, l_i, m_i, s, v, DOT_F32: tl.constexpr):
    """One key tile of the online softmax; s holds log2-unit logits, -inf where not attended."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@jit
def _vs_attn_kernel(
    Q,
    K,
    V,
    Out,
    OnDiag,
    GroupLo,
    GroupHi,
    GroupCount,
    Cols,
    ColSeen,
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
    stride_db,
    stride_dh,
    stride_gb,
    stride_gh,
    stride_nb,
    stride_cb,
    stride_ch,
    stride_sb,
    stride_sh,
    stride_sm,
    n_ctx,
    num_q_blocks,
    d_head,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    i = num_q_blocks - 1 - tl.program_id(0)  # late query blocks (more columns) first
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv_h = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    q0 = i * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_ctx
    q_last = tl.minimum(q0 + BLOCK_M, n_ctx) - 1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < d_head
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qn
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok, other=0.0)
    k_head = K + b * stride_kb + kv_h * stride_kh + offs_d[None, :] * stride_kd
    v_head = V + b * stride_vb + kv_h * stride_vh + offs_d[None, :] * stride_vd
    on_diag = OnDiag + b * stride_db + h * stride_dh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # slash part: each group of diagonals is one key range [start, end] for this query block
    offs_n = tl.arange(0, BLOCK_N)
    n_groups = tl.load(GroupCount + b * stride_nb + h)
    g_lo = GroupLo + b * stride_gb + h * stride_gh
    g_hi = GroupHi + b * stride_gb + h * stride_gh
    for g in range(0, n_groups):
        start = tl.maximum(q0 - tl.load(g_hi + g), 0)
        end = q_last - tl.load(g_lo + g)  # < start: the group's keys all precede key 0
        for t0 in range(start, end + 1, BLOCK_N):
            cols = t0 + offs_n
            col_ok = cols <= end
            off = offs_m[:, None] - cols[None, :]
            ok = col_ok[None, :] & (off >= 0) & row_ok[:, None]
            vis = tl.load(on_diag + off, mask=ok, other=0) != 0  # exactly the kept offsets
            k = tl.load(k_head + cols[:, None] * stride_kn, mask=col_ok[:, None] & d_ok, other=0.0)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(vis, s * qk_scale, float("-inf"))
            v = tl.load(v_head + cols[:, None] * stride_vn, mask=col_ok[:, None] & d_ok, other=0.0)
            acc, l_i, m_i = _online_update(acc, l_i, m_i, s, v, DOT_F32)

    # vertical part: the kept columns this block sees, gathered; a column a query also reaches
    # through a kept diagonal was attended above
    offs_c = tl.arange(0, BLOCK_C)
    seen = tl.load(ColSeen + b * stride_sb + h * stride_sh + i * stride_sm)
    col_row = Cols + b * stride_cb + h * stride_ch
    for c0 in range(0, seen, BLOCK_C):
        idx = c0 + offs_c
        c_ok = idx < seen
        cols = tl.load(col_row + idx, mask=c_ok, other=0)
        off = offs_m[:, None] - cols[None, :]
        ok = c_ok[None, :] & (off >= 0) & row_ok[:, None]
        dup = tl.load(on_diag + off, mask=ok, other=0) != 0
        k = tl.load(k_head + cols[:, None] * stride_kn, mask=c_ok[:, None] & d_ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok & ~dup, s * qk_scale, float("-inf"))
        v = tl.load(v_head + cols[:, None] * stride_vn, mask=c_ok[:, None] & d_ok, other=0.0)
        acc, l_i, m_i = _online_update(acc, l_i, m_i, s, v, DOT_F32)

    seen_any = l_i > 0.0  # a row that sees no key gets 0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_on
    o_ptrs += offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok)


MAX_HEAD_DIM = 128  # the Triton executor's head dims (any up to this; padded to a power of two)


def attention_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `vertical_slash_attention` takes these inputs (else use flex or the reference)."""
    return head_dim <= MAX_HEAD_DIM and dtype in (torch.float16, torch.bfloat16, torch.float32)


def vertical_slash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    columns: Tensor,
    diagonals: Tensor,
    scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
    block_c: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:
    """Triton `vertical_slash_attention_ref`: out [B, Hq, N, D] in q's dtype.

    q [B, Hq, N, D], k/v [B, Hkv, N, D] (query head h reads KV head h // (Hq // Hkv), no repeat),
    one dtype of fp16 / bf16 / fp32 (fp32 with ieee dots), head dim <= 128; columns / diagonals
    as in the module docstring. CUDA, or the CPU under TRITON_INTERPRET=1 (fp32 / fp16 there).
    Cost: per 64-query block, the key ranges of its diagonal groups plus its visible columns.
    """
    check_triton_launch("vertical_slash_attention", q, k, v, columns, diagonals)
    check_vertical_slash_inputs(q, k, v, columns, diagonals)
    b, hq, n, d = q.shape
    if not attention_supported(d, q.dtype) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"vertical_slash_attention takes one dtype of float16/bfloat16/float32 and head dim "
            f"<= {MAX_HEAD_DIM}; got {q.dtype}/{k.dtype}/{v.dtype}, head dim {d}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    if n == 0:
        return out
    on_diag, lo, hi, n_groups, cols, seen = vertical_slash_index(columns, diagonals, n, block_m)
    if lo.shape[-1] == 0:  # a pointer to something, never read
        lo = hi = torch.zeros(b, hq, 1, dtype=torch.int32, device=q.device)
    if cols.shape[-1] == 0:
        cols = torch.zeros(b, hq, 1, dtype=torch.int32, device=q.device)
    mq = math.ceil(n / block_m)
    block_d = max(16, triton.next_power_of_2(d))
    if num_warps is None:  # sm_90, d 128: 8 warps hold the tiles without spilling
        num_warps = 8 if block_d >= 128 else 4
    _vs_attn_kernel[(mq, hq, b)](
        q, k, v, out, on_diag, lo, hi, n_groups, cols, seen,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *on_diag.stride()[:2],
        *lo.stride()[:2], n_groups.stride(0), *cols.stride()[:2], *seen.stride(),
        n, mq, d, scale * math.log2(math.e),
        GROUP=hq // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=block_c,
        BLOCK_D=block_d, DOT_F32=q.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


_compiled_flex_attention = None  # torch.compile(flex_attention), built on first use


def vertical_slash_attention_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    columns: Tensor,
    diagonals: Tensor,
    scale: float | None = None,
    block: int = 128,
) -> Tensor:
    """Vertical-slash causal prefill attention with compiled FlexAttention (CUDA only).

    Same inputs and result as `vertical_slash_attention_ref`: the touched `block` x `block` pairs
    become the BlockMask lists, and a `mask_mod` keeps exactly the pattern's keys inside them, so
    the cost follows the touched-block density. Pairs whose every offset is a kept diagonal go to
    the full lists and skip the mask. Out [B, Hq, N, D] in q's dtype.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    global _compiled_flex_attention
    if q.device.type != "cuda":
        raise ValueError("the FlexAttention path needs a CUDA device; use the reference on CPU")
    check_vertical_slash_inputs(q, k, v, columns, diagonals)
    n = q.shape[2]
    on_col, on_diag = membership(columns, n), membership(diagonals, n)  # [B, Hq, N]
    full = full_diagonal_blocks(on_diag, n, block)  # [B, Hq, M, M]: no element mask needed
    partial = touched_blocks(on_col, on_diag, n, block, block) & ~full
    lists = [
        (m.sum(-1, dtype=torch.int32), torch.argsort((~m).to(torch.int8), dim=-1, stable=True))
        for m in (partial, full)
    ]
    (count, indices), (full_count, full_indices) = [(c, i.to(torch.int32)) for c, i in lists]

    def mask_mod(b, h, q_idx, kv_idx):
        off = q_idx - kv_idx
        return (off >= 0) & (on_col[b, h, kv_idx] | on_diag[b, h, off.clamp(min=0)])

    block_mask = BlockMask.from_kv_blocks(
        count,
        indices,
        full_count,
        full_indices,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(n, n),
    )
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def main() -> None:
    """Compare the executors with dense masked SDPA on one random pattern."""
    from .triton_util import INTERPRET

    torch.manual_seed(0)
    b, hq, hkv, n, d = 1, 4, 2, 1000, 64
    q, k, v = (torch.randn(b, h, n, d) for h in (hq, hkv, hkv))
    columns = torch.stack([torch.randperm(n)[:40] for _ in range(hq)])[None]
    diagonals = torch.cat(
        [
            torch.arange(16)[None].expand(hq, -1),
            torch.stack([torch.randperm(n - 16)[:24] + 16 for _ in range(hq)]),
        ],
        -1,
    )
    diagonals = diagonals[None]
    out = vertical_slash_attention_ref(q, k, v, columns, diagonals)
    token_mask = vertical_slash_token_mask(columns, diagonals, n)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask, enable_gqa=True)
    blocks = vertical_slash_block_mask(columns, diagonals, n)
    causal = torch.ones(blocks.shape[-2:], dtype=torch.bool).tril()
    print(
        f"N={n} heads {hq}/{hkv}: 40 columns + 40 diagonals per head touch "
        f"{blocks.sum().item() / (b * hq * causal.sum().item()):.3f} of causal 128-block pairs; "
        f"max |ref - dense masked SDPA| = {(out - dense).abs().max().item():.2e}"
    )
    device = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
    if triton is not None and device is not None:
        args = [t.to(device) for t in (q, k, v, columns, diagonals)]
        kernel = vertical_slash_attention(*args).cpu()
        print(f"max |triton kernel - ref| = {(kernel - out).abs().max().item():.2e} ({device})")


if __name__ == "__main__":
    main()
