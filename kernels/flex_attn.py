"""FlexAttention executor for block selections (GPU only).

The selection lists become a `BlockMask` with one canonical split: per query block, the kept
diagonal key blocks (where some key comes after some query) go to the partial lists and get the
causal `mask_mod`; the kept strictly-lower blocks go to the full lists and skip it. Semantically
equal splits can round differently in FlexAttention, so there is only this one.

Eager (uncompiled) `flex_attention` ignores the block lists and applies only `mask_mod` densely,
so the executor always runs the compiled function, and refuses CPU tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .block_sparse_attn import (
    block_geometry,
    block_lists_from_mask,
    block_mask_from_lists,
    check_block_sparse_inputs,
)

_compiled_flex_attention = None  # torch.compile(flex_attention), built on first use


def causal_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def block_mask_from_selection(
    kv_count: Tensor, kv_indices: Tensor, block_q: int, block_k: int, seq_len: int
) -> BlockMask:
    """BlockMask for FlexAttention from int32 kv_count [B, H, Mq] / kv_indices [B, H, Mq, Mk].

    Kept blocks outside the causal region are dropped. Everything stays on the lists' device.
    """
    mq, mk = math.ceil(seq_len / block_q), math.ceil(seq_len / block_k)
    if kv_count.shape[-1] != mq or kv_indices.shape[-2:] != (mq, mk):
        raise ValueError(
            f"selection lists must be [B, H, {mq}] / [B, H, {mq}, {mk}] for "
            f"seq_len={seq_len}, blocks ({block_q}, {block_k}); got "
            f"{tuple(kv_count.shape)} / {tuple(kv_indices.shape)}"
        )
    causal, full = block_geometry(seq_len, block_q, block_k, kv_count.device)  # [Mq, Mk]
    kept = block_mask_from_lists(kv_count, kv_indices)  # [B, H, Mq, Mk]
    partial_count, partial_indices = block_lists_from_mask(kept & causal & ~full)
    full_count, full_indices = block_lists_from_mask(kept & full)
    return BlockMask.from_kv_blocks(
        partial_count,
        partial_indices,
        full_count,
        full_indices,
        BLOCK_SIZE=(block_q, block_k),
        mask_mod=causal_mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def _kernel_options(block_q: int, block_k: int) -> dict | None:
    """Tile sizes that divide the selection blocks, or None to keep Inductor's defaults.

    The default forward tiles are up to 128 x 128, and Inductor refuses tiles that do not divide
    the sparse block (e.g. block 64 with head dim 128 on H100/H200).
    """
    if block_q % 128 == 0 and block_k % 128 == 0:
        return None
    tile_m, tile_n = math.gcd(block_q, 128), math.gcd(block_k, 128)
    if min(tile_m, tile_n) < 16:
        raise ValueError(
            f"FlexAttention needs block sizes that are multiples of 16; got ({block_q}, {block_k})"
        )
    return {"BLOCK_M": tile_m, "BLOCK_N": tile_n}


def _flex():
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def flex_block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_indices: Tensor,
    block_q: int,
    block_k: int,
    scale: float | None = None,
) -> Tensor:
    """Block-sparse causal prefill attention with compiled FlexAttention.

    q [B, Hq, N, D], k/v [B, Hkv, N, D] (GQA through `enable_gqa`), kv_count int32 [B, Hq, Mq],
    kv_indices int32 [B, Hq, Mq, Mk]. Returns out [B, Hq, N, D] in q's dtype.
    """
    if q.device.type != "cuda":
        raise ValueError(
            "FlexAttention executor needs a CUDA device; use executor=reference on CPU"
        )
    check_block_sparse_inputs(q, k, v, kv_count, kv_indices, block_q, block_k)
    block_mask = block_mask_from_selection(kv_count, kv_indices, block_q, block_k, q.shape[2])
    options = _kernel_options(block_q, block_k)
    return _flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=options
    )
