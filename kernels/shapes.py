"""The one check of query and key shapes that every selector, kernel and reference shares."""

from __future__ import annotations

from torch import Tensor


def check_qk(q: Tensor, k: Tensor) -> None:
    """q [B, Hq, N, D] and k [B, Hkv, N, D] with Hq a multiple of Hkv, or ValueError."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, N, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, N or D")
    if q.shape[1] % max(k.shape[1], 1):
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )
