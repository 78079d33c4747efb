"""Block-sparse causal prefill attention: the PyTorch reference and the block-geometry helpers.

A selection is given per (batch, query head, query block) as `kv_count` int32 [B, Hq, Mq] and
`kv_indices` int32 [B, Hq, Mq, Mk] (kept key-block ids, ascending, padded past the count), the
layout of FlexAttention's `BlockMask.from_kv_blocks`. Query block i covers the tokens
[i * block_q, min((i + 1) * block_q, N)), key block j likewise with block_k; the last block of
either kind may be partial, and block_q may differ from block_k.
Inside the kept blocks attention is causal (key position <= query position).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


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
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    if tuple(kv_count.shape) != (b, hq, mq):
        raise ValueError(
            f"kv_count must be [B, Hq, Mq] = [{b}, {hq}, {mq}] for N={n}, "
            f"block_q={block_q}; got {tuple(kv_count.shape)}"
        )
    if tuple(kv_indices.shape) != (b, hq, mq, mk):
        raise ValueError(
            f"kv_indices must be [B, Hq, Mq, Mk] = [{b}, {hq}, {mq}, {mk}] for N={n}, "
            f"block_q={block_q}, block_k={block_k}; got {tuple(kv_indices.shape)}"
        )
    if kv_count.dtype != torch.int32 or kv_indices.dtype != torch.int32:
        raise ValueError(
            f"kv_count and kv_indices must be int32; got {kv_count.dtype}, {kv_indices.dtype}"
        )
    devices = {t.device for t in (q, k, v, kv_count, kv_indices)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")


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
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse causal prefill attention in PyTorch, one query block at a time.

    q [B, Hq, N, D], k/v [B, Hkv, N, D] (query head h reads kv head h // (Hq // Hkv)),
    kv_count int32 [B, Hq, Mq], kv_indices int32 [B, Hq, Mq, Mk]. Only the kept key blocks are
    gathered, so the cost scales with density; the gathered keys of one query block are
    [B, Hq, max count, block_k, D]. The softmax runs in fp32; a query row that sees no key gets
    output 0 and lse -inf.

    Returns out [B, Hq, N, D] in q's dtype, and with `return_lse` also the natural-log
    logsumexp of the scaled scores, fp32 [B, Hq, N].
    """
    check_block_sparse_inputs(q, k, v, kv_count, kv_indices, block_q, block_k)
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = q.device

    out = torch.zeros_like(q)
    lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=dev)
    batch_idx = torch.arange(b, device=dev)[:, None, None]  # [B, 1, 1]
    head_idx = (torch.arange(hq, device=dev) // group)[None, :, None]  # [1, Hq, 1] kv head
    key_offsets = torch.arange(block_k, device=dev)
    max_count = kv_count.amax(dim=(0, 1)).tolist()  # one host sync for all query blocks

    for i, mc in enumerate(max_count):
        if mc == 0:
            continue  # no head keeps a key block: the rows stay 0 / -inf
        q0, q1 = i * block_q, min((i + 1) * block_q, n)
        slot_valid = torch.arange(mc, device=dev) < kv_count[:, :, i, None]  # [B, Hq, mc]
        blocks = torch.where(slot_valid, kv_indices[:, :, i, :mc].long(), 0)  # [B, Hq, mc]
        key_pos = blocks[..., None] * block_k + key_offsets  # [B, Hq, mc, Bk]
        key_ok = slot_valid[..., None] & (key_pos < n)
        key_pos = key_pos.clamp_max(n - 1).flatten(2)  # [B, Hq, L], L = mc * Bk
        key_ok = key_ok.flatten(2)

        ks = k[batch_idx, head_idx, key_pos].float()  # [B, Hq, L, D]
        vs = v[batch_idx, head_idx, key_pos].float()
        qi = q[:, :, q0:q1].float()  # [B, Hq, Tq, D]
        s = torch.einsum("bhtd,bhld->bhtl", qi, ks) * scale  # [B, Hq, Tq, L]
        q_pos = torch.arange(q0, q1, device=dev)
        visible = key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= q_pos[:, None])
        s = s.masked_fill(~visible, float("-inf"))

        m = s.amax(-1, keepdim=True)  # -inf on rows that see no key
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)  # exactly 0 where masked
        denom = p.sum(-1, keepdim=True)  # [B, Hq, Tq, 1]
        acc = torch.einsum("bhtl,bhld->bhtd", p, vs)
        seen = denom > 0
        out[:, :, q0:q1] = torch.where(seen, acc / denom.clamp_min(1e-30), 0.0).to(q.dtype)
        row_lse = torch.where(seen, m + torch.log(denom.clamp_min(1e-30)), float("-inf"))
        lse[:, :, q0:q1] = row_lse.squeeze(-1)

    return (out, lse) if return_lse else out


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


if __name__ == "__main__":
    main()
