"""Structured, seeded Q/K/V for kernel tests and attention benchmarks.

Random Q/K make every key block look alike, so every selector keeps everything or nothing. Real
prefill attention has structure that separates selectors, and these generators plant it:

- attention sinks: the first `sink_tokens` keys share a direction every query leans towards;
- local bias: a rotating positional component makes nearby (and recent) keys score higher;
- vertical columns: a few keys anywhere in the prompt that every query of the head attends to;
- diluted needles: one strong key in an otherwise dispersed key block, matched by the queries of
  one later query block only. The block's centroid barely moves, its radius is large: the case
  where centroid scoring underestimates a block and radius-aware scoring should not.

Strengths are in logit units (after the 1/sqrt(d) scale) over a unit-variance random background.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Structure:
    sink_tokens: int = 4
    sink_strength: float = 9.0
    local_strength: float = 2.0
    local_period: int = 4096  # tokens for a full turn of the short-range positional component
    vertical_columns: int = 8  # per KV head
    vertical_strength: float = 3.0
    needles: int = 8  # per batch row and KV head
    needle_strength: float = 13.0
    needle_block: int = 128  # size of the diluted blocks the needles are planted in
    dilution: float = 2.0  # noise scale of the keys sharing a needle's block


@dataclass(frozen=True)
class SyntheticAttention:
    q: Tensor  # [B, Hq, N, D]
    k: Tensor  # [B, Hkv, N, D]
    v: Tensor  # [B, Hkv, N, D]
    needles: Tensor  # int64 [n, 4]: batch, kv head, key position, query block (needle_block units)


def _unit(shape, d: int, gen: torch.Generator, device) -> Tensor:
    x = torch.randn(*shape, d, generator=gen, device=device)
    return x / x.norm(dim=-1, keepdim=True)


def generate(
    batch: int = 1,
    q_heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 4096,
    head_dim: int = 64,
    *,
    structure: Structure = Structure(),
    seed: int = 0,
    device="cpu",
    dtype: torch.dtype = torch.float32,
) -> SyntheticAttention:
    """Seeded structured attention inputs; the same seed gives the same tensors on one device."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim < 8:
        raise ValueError(
            f"head_dim must be >= 8 (positional components use 4 dims), got {head_dim}"
        )
    s, d, n, g = structure, head_dim, seq_len, q_heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, kv_heads, g, n, d, generator=gen, device=device)
    k = torch.randn(batch, kv_heads, n, d, generator=gen, device=device)
    v = torch.randn(batch, kv_heads, n, d, generator=gen, device=device)

    def mag(strength: float) -> float:  # q and k magnitudes giving this logit: m^2 / sqrt(d)
        return math.sqrt(max(strength, 0.0) * math.sqrt(d))

    pos = torch.arange(n, device=device, dtype=torch.float32)
    # Local bias: two rotating 2-d components; their dot product falls with distance.
    for dims, period, strength in (
        ((0, 1), s.local_period, s.local_strength),
        ((2, 3), 4 * n, s.local_strength),
    ):
        angle = 2 * math.pi * pos / period
        rot = torch.stack((angle.cos(), angle.sin()), -1) * mag(strength)  # [N, 2]
        q[..., list(dims)] += rot
        k[..., list(dims)] += rot

    def lean(rows: Tensor, strength: float, direction: Tensor) -> None:
        """Keys at `rows` [B, Hkv, R] point along direction [B, Hkv, D]; every query leans to it."""
        idx = rows[..., None].expand(-1, -1, -1, d)
        k.scatter_add_(2, idx, (mag(strength) * direction)[:, :, None].expand_as(idx).clone())
        q.add_(mag(strength) * direction[:, :, None, None])

    if s.sink_tokens:
        sinks = torch.arange(min(s.sink_tokens, n), device=device).expand(batch, kv_heads, -1)
        lean(sinks, s.sink_strength, _unit((batch, kv_heads), d, gen, device))
    if s.vertical_columns and n > 1:
        cols = torch.randint(
            1, n, (batch, kv_heads, s.vertical_columns), generator=gen, device=device
        )
        lean(cols, s.vertical_strength, _unit((batch, kv_heads), d, gen, device))

    needles = []
    bs = s.needle_block
    m = math.ceil(n / bs)
    if s.needles and m >= 9:  # room for a key block in [2, m-6) and a later query block
        for b in range(batch):
            for h in range(kv_heads):
                # key block in [2, m-6), query block at least 4 blocks later and before the last 2
                kb = torch.randint(2, m - 6, (s.needles,), generator=gen, device=device)
                for j in kb.tolist():
                    qb = int(torch.randint(j + 4, m - 2, (1,), generator=gen, device=device))
                    t = j * bs + int(
                        torch.randint(0, min(bs, n - j * bs), (1,), generator=gen, device=device)
                    )
                    direction = _unit((), d, gen, device)
                    k[b, h, j * bs : (j + 1) * bs] *= s.dilution  # a dispersed block
                    k[b, h, t] = mag(s.needle_strength) * direction
                    q[b, h, :, qb * bs : (qb + 1) * bs] += mag(s.needle_strength) * direction
                    needles.append((b, h, t, qb))
    q = q.reshape(batch, q_heads, n, d)
    needle_t = torch.tensor(needles, dtype=torch.int64).reshape(-1, 4)
    return SyntheticAttention(q.to(dtype), k.to(dtype), v.to(dtype), needle_t)


def main() -> None:
    from rbs_bench import methods

    data = generate(seq_len=8192, seed=0)
    print(f"q {tuple(data.q.shape)}  k {tuple(data.k.shape)}  {len(data.needles)} needles")
    for name in ("centroid", "full_l2", "rbs"):
        sel = methods.build(name).select(data.q, data.k)
        mask = sel.mask()
        g = data.q.shape[1] // data.k.shape[1]
        kept = [bool(mask[b, h * g, qb, t // 128]) for b, h, t, qb in data.needles.tolist()]
        print(f"{name:9s} density {sel.density():.3f}  needle blocks kept {sum(kept)}/{len(kept)}")


if __name__ == "__main__":
    main()
