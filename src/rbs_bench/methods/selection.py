"""The selection API: what every method returns, and the block-geometry helpers they share.

A selector never runs attention. It returns a `BlockSelection`, whose `kv_count`/`kv_indices`
are exactly the layout of PyTorch's `BlockMask.from_kv_blocks`, so the same selection can be
executed by the PyTorch reference, FlexAttention, or a Triton kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# The block-level mask rule lives beside the fused kernel that implements it, and is shared here.
from rbs_bench.kernels.block_masks import candidate_mask, forced_mask, relative_threshold
from rbs_bench.kernels.block_sparse_attn import (
    block_geometry,
    block_lists_from_mask,
    block_mask_from_lists,
)

__all__ = [
    "BlockSelection",
    "Selector",
    "candidate_mask",
    "causal_block_mask",
    "forced_mask",
    "num_blocks",
    "relative_threshold",
]


def num_blocks(n: int, block: int) -> int:
    return math.ceil(n / block)


def causal_block_mask(seq_len: int, block_q: int, block_k: int, device=None) -> Tensor:
    """bool [Mq, Mk]: key block j holds a key <= some query of block i (a causal pair)."""
    return block_geometry(seq_len, block_q, block_k, device)[0]


@dataclass(frozen=True)
class BlockSelection:
    """Kept key blocks per (batch, head, query block).

    kv_count:   int32 [B, H, Mq]      number of kept key blocks of each query block
    kv_indices: int32 [B, H, Mq, Mk]  kept key-block ids in ascending order, padded past the count
    """

    kv_count: Tensor
    kv_indices: Tensor
    block_q: int
    block_k: int
    seq_len: int

    @classmethod
    def from_mask(cls, mask: Tensor, block_q: int, block_k: int, seq_len: int) -> BlockSelection:
        """Compact a bool [B, H, Mq, Mk] mask; blocks outside the causal region are dropped."""
        mask = mask & causal_block_mask(seq_len, block_q, block_k, mask.device)
        return cls(*block_lists_from_mask(mask), block_q, block_k, seq_len)

    @classmethod
    def full(cls, batch: int, heads: int, seq_len: int, block: int, device=None) -> BlockSelection:
        """Every causal block pair (what dense attention computes)."""
        mq = num_blocks(seq_len, block)
        mask = torch.ones(batch, heads, mq, mq, dtype=torch.bool, device=device)
        return cls.from_mask(mask, block, block, seq_len)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, mq, mk = self.kv_indices.shape
        return b, h, mq, mk

    def mask(self) -> Tensor:
        """bool [B, H, Mq, Mk]; for tests and small inputs."""
        return block_mask_from_lists(self.kv_count, self.kv_indices)

    def causal_pairs(self) -> int:
        """Causally valid block pairs of one (batch, head)."""
        return int(causal_block_mask(self.seq_len, self.block_q, self.block_k).sum())

    def head_density(self) -> Tensor:
        """float [B, H]: kept / causally valid block pairs of each (batch, head)."""
        return self.kv_count.sum(-1).double() / self.causal_pairs()

    def density(self) -> float:
        """Kept / causally valid block pairs over the whole selection (forced blocks included)."""
        return float(self.head_density().mean())


@runtime_checkable
class Selector(Protocol):
    """A method: a small dataclass with a registered name and one calibration knob.

    `select(q, k)` takes q [B, Hq, N, D] and k [B, Hkv, N, D] (Hq a multiple of Hkv) and returns
    the kept key blocks per query head. `knob` names the field calibration moves; `knob_direction`
    is -1 when a larger knob keeps fewer blocks, +1 when it keeps more.
    """

    name: str
    knob: str
    knob_direction: int
    block_size: int
    is_dense: bool

    def select(self, q: Tensor, k: Tensor, scale: float | None = None) -> BlockSelection: ...
