"""Key-block statistics for radius-bounded selection: centroid, radius and rescue coefficient.

Per KV head and key block b (fp32, over the block's real tokens, a partial last block included):
    c_b = mean(k),  r_b = max ||k - c_b||_2
and per KV head, from the M radii of the prompt,
    beta_b = clamp((r_b - q50(r)) / (q90(r) - q50(r)), 0, 1),  0 everywhere if q90 <= q50.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _pad_to_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """[B, H, N, D] -> ([B, H, M, block, D] zero-padded, bool [M, block] real-token mask)."""
    b, h, n, d = x.shape
    m = math.ceil(n / block)
    pad = m * block - n
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    real = (torch.arange(m * block, device=x.device) < n).view(m, block)
    return x.view(b, h, m, block, d), real


def block_stats_ref(k: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Centroid fp32 [B, Hkv, M, D] and radius fp32 [B, Hkv, M] of each key block."""
    kb, real = _pad_to_blocks(k.float(), block_size)  # [B, H, M, Bk, D], [M, Bk]
    count = real.sum(-1).to(kb.dtype)  # [M]
    centroid = kb.sum(3) / count[:, None]  # padded rows are zero, so the sum is over real tokens
    dist = (kb - centroid[:, :, :, None, :]).norm(dim=-1)  # [B, H, M, Bk]
    radius = dist.masked_fill(~real, 0.0).amax(-1)
    return centroid, radius


def rescue_beta_ref(radius: Tensor, q_low: float = 0.5, q_high: float = 0.9) -> Tensor:
    """Radius-adaptive rescue coefficient beta [B, Hkv, M] from the per-head radius quantiles."""
    r_low = torch.quantile(radius, q_low, dim=-1, keepdim=True)
    r_high = torch.quantile(radius, q_high, dim=-1, keepdim=True)
    spread = r_high - r_low
    beta = ((radius - r_low) / spread.clamp_min(torch.finfo(radius.dtype).tiny)).clamp(0.0, 1.0)
    return torch.where(spread > 0, beta, torch.zeros_like(beta))


def main() -> None:
    torch.manual_seed(0)
    k = torch.randn(1, 2, 1000, 64)
    k[:, :, 500:628] *= 3.0  # one dispersed block
    centroid, radius = block_stats_ref(k, 128)
    beta = rescue_beta_ref(radius)
    print("centroid", tuple(centroid.shape))
    print("radius[0, 0]", [round(x, 2) for x in radius[0, 0].tolist()])
    print("beta[0, 0]  ", [round(x, 2) for x in beta[0, 0].tolist()])


if __name__ == "__main__":
    main()
