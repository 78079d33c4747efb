"""Vertical-slash sparse prefill attention (MInference's pattern): PyTorch reference and helpers.

A pattern is given per (batch, query head):

    columns   int [B, H, Nv]  kept key positions ("vertical" lines), 0 <= c < N
    diagonals int [B, H, Ns]  kept offsets d = query - key ("slash" lines), 0 <= d < N

Entries < 0 are padding; the valid entries of one (b, h) must be unique, in any order. Query p
attends to exactly {c in columns : c <= p} ∪ {p - d : d in diagonals, d <= p}, each key once.

The pattern is token-level, so it is not a `BlockSelection`; `vertical_slash_block_mask` gives the
block pairs it touches (what density counts). Executors: `vertical_slash_attention_ref` (PyTorch,
any device) and `vertical_slash_attention_flex` (compiled FlexAttention over the touched blocks,
CUDA). The estimate of the last queries' column and diagonal mass that MInference and FlexPrefill
both start from lives here too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


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


def vertical_slash_estimate(
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


if __name__ == "__main__":
    main()
