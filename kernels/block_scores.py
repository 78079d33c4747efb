"""Query-block log-sum-exp scores against key-block summaries (the RBS scoring step).

For query head h, query block i and key block b, with token logits
    z(t, b) = (q_t . c_b + ||q_t||_2 * u_b) * scale
(u_b = 0 for the centroid branch, r_b * beta_b for the rescue branch, r_b for the full L2 bound),
the score is L[i, b] = logsumexp over the real tokens t of block i of z(t, b). Every branch shares
the q . c products. The N x M token logits are built one chunk of query blocks at a time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Elements of the [B, Hq, tokens, M] logits tile built at once (bounds the reference's memory).
_TILE_ELEMS = 1 << 25


def block_scores_ref(
    q: Tensor,
    centroid: Tensor,
    uplifts: list[Tensor | None],
    block_size: int,
    scale: float | None = None,
) -> list[Tensor]:
    """One fp32 [B, Hq, Mq, Mk] score tensor per entry of `uplifts` (None or [B, Hkv, Mk]).

    q [B, Hq, N, D]; centroid fp32 [B, Hkv, Mk, D]; query head h reads KV head h // (Hq // Hkv).
    """
    b, hq, n, d = q.shape
    hkv, mk = centroid.shape[1], centroid.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mq = math.ceil(n / block_size)
    qf = q.float()
    outs = [torch.empty(b, hq, mq, mk, device=q.device) for _ in uplifts]
    step = max(1, _TILE_ELEMS // max(1, b * hq * block_size * mk))  # query blocks per tile
    for i0 in range(0, mq, step):
        i1 = min(mq, i0 + step)
        t0, t1 = i0 * block_size, min(n, i1 * block_size)
        qt = qf[:, :, t0:t1].reshape(b, hkv, group, t1 - t0, d)  # [B, Hkv, G, T, D]
        dots = torch.einsum("bkgtd,bkmd->bkgtm", qt, centroid)  # [B, Hkv, G, T, Mk]
        norms = qt.norm(dim=-1, keepdim=True)  # [B, Hkv, G, T, 1]
        pad = (i1 - i0) * block_size - (t1 - t0)
        for out, u in zip(outs, uplifts):
            z = dots if u is None else dots + norms * u[:, :, None, None, :]
            z = (z * scale).reshape(b, hq, t1 - t0, mk)
            if pad:  # a partial last query block: padded tokens add nothing to the sum
                z = torch.nn.functional.pad(z, (0, 0, 0, pad), value=-math.inf)
            out[:, :, i0:i1] = z.view(b, hq, i1 - i0, block_size, mk).logsumexp(3)
    return outs
