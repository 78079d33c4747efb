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

Input families (`FAMILIES`, `generate(..., structure=FAMILIES[name])`):

- `synthetic`: the default `Structure()`; every committed result made from these inputs uses it.
- `needles`: larger logits and scattered needles. Needles with logits drawn in [40, 60], each
  matched by a few dozen query tokens scattered over the rest of the prompt instead of one query
  block, stronger vertical columns, and more dispersed needle blocks. Softmax rows there are
  dominated by one key, the regime where low-precision intermediates and exponent offsets show,
  and block scores span a far wider range than on the default family.
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
    # None: every needle has needle_strength; else each draws its logit in [strength, this]
    needle_strength_max: float | None = None
    # None: the queries of one later query block match the needle; else this many query tokens
    # drawn anywhere after the needle's key block
    needle_queries: int | None = None


FAMILIES = {
    "synthetic": Structure(),
    "needles": Structure(
        vertical_columns=16,
        vertical_strength=6.0,
        needles=32,
        needle_strength=40.0,
        needle_strength_max=60.0,
        needle_queries=48,
        dilution=3.0,
    ),
}


@dataclass(frozen=True)
class SyntheticAttention:
    q: Tensor  # [B, Hq, N, D]
    k: Tensor  # [B, Hkv, N, D]
    v: Tensor  # [B, Hkv, N, D]
    # int64 [n, 4]: batch, kv head, key position, query block (needle_block units); with
    # scattered needle queries, one row per query block that holds at least one of them
    needles: Tensor


def _unit(shape, d: int, gen: torch.Generator, device) -> Tensor:
    x = torch.randn(*shape, d, generator=gen, device=device)
    return x / x.norm(dim=-1, keepdim=True)


def _needle_strength(s: Structure, gen: torch.Generator, device) -> float:
    if s.needle_strength_max is None:
        return s.needle_strength
    u = float(torch.rand((), generator=gen, device=device))
    return s.needle_strength + u * (s.needle_strength_max - s.needle_strength)


def _plant_blocks(q, k, s: Structure, mag, gen, d, n, m, b, h) -> list[tuple]:
    """Needles of one (batch, kv head), each matched by every query of one later query block.

    q [G, N, D] and k [N, D] are modified in place; returns the (b, h, key, query block) rows.
    """
    bs, dev, rows = s.needle_block, q.device, []
    # key block in [2, m-6), query block at least 4 blocks later and before the last 2
    kb = torch.randint(2, m - 6, (s.needles,), generator=gen, device=dev)
    for j in kb.tolist():
        qb = int(torch.randint(j + 4, m - 2, (1,), generator=gen, device=dev))
        t = j * bs + int(torch.randint(0, min(bs, n - j * bs), (1,), generator=gen, device=dev))
        direction = _unit((), d, gen, dev)
        strength = _needle_strength(s, gen, dev)
        k[j * bs : (j + 1) * bs] *= s.dilution  # a dispersed block
        k[t] = mag(strength) * direction
        q[:, qb * bs : (qb + 1) * bs] += mag(strength) * direction
        rows.append((b, h, t, qb))
    return rows


def _plant_scattered(q, k, s: Structure, mag, gen, d, n, m, b, h) -> list[tuple]:
    """Needles in distinct dispersed key blocks, each matched by `needle_queries` query tokens
    drawn anywhere after its block. Every block is dispersed before any needle is planted, so
    no needle key is scaled twice."""
    bs, dev, rows = s.needle_block, q.device, []
    kb = 2 + torch.randperm(m - 8, generator=gen, device=dev)[: s.needles]
    for j in kb.tolist():
        k[j * bs : (j + 1) * bs] *= s.dilution
    for j in kb.tolist():
        t = j * bs + int(torch.randint(0, min(bs, n - j * bs), (1,), generator=gen, device=dev))
        direction = _unit((), d, gen, dev)
        strength = _needle_strength(s, gen, dev)
        k[t] = mag(strength) * direction
        tok = torch.randint((j + 1) * bs, n, (s.needle_queries,), generator=gen, device=dev)
        tok = tok.unique()
        q[:, tok] += mag(strength) * direction
        rows += [(b, h, t, qb) for qb in (tok // bs).unique().tolist()]
    return rows


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
        plant = _plant_blocks if s.needle_queries is None else _plant_scattered
        for b in range(batch):
            for h in range(kv_heads):
                needles += plant(q[b, h], k[b, h], s, mag, gen, d, n, m, b, h)
    q = q.reshape(batch, q_heads, n, d)
    needle_t = torch.tensor(needles, dtype=torch.int64).reshape(-1, 4)
    return SyntheticAttention(q.to(dtype), k.to(dtype), v.to(dtype), needle_t)


def main() -> None:
    from rbs_bench import methods

    data = generate(seq_len=8192, seed=0)
    print(f"q {tuple(data.q.shape)}  k {tuple(data.k.shape)}  {len(data.needles)} needles")
    for name in methods.compared():
        sel = methods.build(name).select(data.q, data.k)
        mask = sel.mask()
        g = data.q.shape[1] // data.k.shape[1]
        kept = [bool(mask[b, h * g, qb, t // 128]) for b, h, t, qb in data.needles.tolist()]
        print(f"{name:12s} density {sel.density():.3f}  needle blocks kept {sum(kept)}/{len(kept)}")


if __name__ == "__main__":
    main()
