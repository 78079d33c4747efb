"""Block-mask rules every selector shares (pure PyTorch): the scored candidates, the forced
blocks (sinks, local window, last query rows), the relative threshold in log space, and the
compaction of a bool mask into ascending index lists for the sparse attention kernels."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_sparse_attn import block_lists_from_mask


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
