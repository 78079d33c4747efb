"""FlashPrefill v1 against a loop-by-loop transcription of its rule (docs/baselines.md §2.1)."""

import math

import pytest
import torch
from conftest import structured_qk

from rbs_bench import methods  # first: importing it registers the baselines

# isort: split
from rbs_bench.baselines.flashprefill import FlashPrefill

from rbs_bench.methods.rbs import Centroid

EPS = 1e-3  # blocks whose log tile mass sits this close to the threshold are not compared


def spec_selection(q, k, fields, scale=None):
    """FlashPrefill's rule, one (batch, head, query block) at a time, in float64.

    S[j] = sum over the rows r of block i of exp(q_r . kbar_j * scale - M_i), kept iff
    S[j] >= alpha * max S; forced: j < sink, 0 <= i - j < window, i >= M - last_n.
    Returns (kept bool [B, H, M, M], near-threshold bool [B, H, M, M]).
    """
    sel = FlashPrefill(**fields)
    bs, alpha = sel.block_size, sel.alpha
    b_, hq, n, d = q.shape
    g = hq // k.shape[1]
    m = math.ceil(n / bs)
    scale = 1 / math.sqrt(d) if scale is None else scale
    kept = torch.zeros(b_, hq, m, m, dtype=torch.bool)
    near = torch.zeros_like(kept)
    forced = torch.zeros_like(kept)
    for b in range(b_):
        for h in range(hq):
            kv = k[b, h // g].double()
            kbar = [kv[j * bs : min(n, (j + 1) * bs)].mean(0) for j in range(m)]
            for i in range(m):
                rows = q[b, h, i * bs : min(n, (i + 1) * bs)].double()
                for j in range(i + 1):
                    forced[b, h, i, j] = (
                        j < sel.sink_blocks
                        or i - j < sel.window_blocks
                        or i >= m - sel.last_q_blocks
                    )
                if i == 0:
                    continue
                s = torch.stack([rows @ kbar[j] * scale for j in range(i)], 1)  # [rows, i]
                mass = (s - s.max()).exp().sum(0)  # [i]: tile mass under one shared max
                for j in range(i):
                    if alpha == 0:
                        kept[b, h, i, j] = True
                        continue
                    gap = math.log(mass[j]) - math.log(alpha * mass.max())
                    kept[b, h, i, j] = gap >= 0
                    near[b, h, i, j] = abs(gap) < EPS
    return kept | forced, near & ~forced  # forced blocks are kept whatever their mass


CASES = [  # (fields, n, hq, hkv, batch)
    ({}, 2000, 4, 2, 1),
    ({"block_size": 64}, 1500, 4, 1, 2),
    (
        {"alpha": 0.3, "block_size": 32, "sink_blocks": 1, "window_blocks": 1, "last_q_blocks": 0},
        1000,
        2,
        2,
        1,
    ),
    ({"alpha": 0.05, "block_size": 64, "window_blocks": 2}, 3000, 2, 1, 1),
]


@pytest.mark.parametrize("fields,n,hq,hkv,batch", CASES)
def test_matches_spec(fields, n, hq, hkv, batch):
    q, k = structured_qk(batch, hq, hkv, n, 32, seed=7 * n + hq)
    got = methods.build("flashprefill", **fields).select(q, k).mask()
    want, near = spec_selection(q, k, fields)
    assert near.float().mean() < 0.02, "too many boundary blocks for a meaningful comparison"
    differ = (got != want) & ~near
    assert not differ.any(), f"{int(differ.sum())} blocks differ ({int(near.sum())} excepted)"
    assert want.sum() < torch.ones_like(want).tril().sum()  # the rule prunes something


def test_scale_argument_is_used():
    q, k = structured_qk(1, 2, 1, 1000, 32, seed=11)
    got = methods.build("flashprefill", block_size=64).select(q, k, scale=0.05).mask()
    want, near = spec_selection(q, k, {"block_size": 64}, scale=0.05)
    assert not ((got != want) & ~near).any()


def needle_case():
    """8 blocks of 32; the queries of block 7 point along e0. Block 2's keys all lean on e0
    (moderately); block 4 is noise except one key far along e0 (the needle)."""
    g = torch.Generator().manual_seed(0)
    d, bs = 16, 32
    e0 = torch.zeros(d)
    e0[0] = 1.0
    k = 0.3 * torch.randn(1, 1, 8 * bs, d, generator=g)
    k[0, 0, 2 * bs : 3 * bs] += 2.0 * e0
    k[0, 0, 4 * bs + 5] += 8.0 * e0
    q = 3.0 * e0 + 0.1 * torch.randn(1, 1, 8 * bs, d, generator=g)
    forced = {"block_size": bs, "sink_blocks": 0, "window_blocks": 1, "last_q_blocks": 0}
    return q, k, forced


def test_needle_in_noisy_block_is_dropped_by_mean_key():
    q, k, forced = needle_case()
    # the needle's logit (q . k ~ 24) dominates its row, yet the block mean dilutes it 32-fold
    assert (q[0, 0, -1] @ k[0, 0, 4 * 32 + 5]) > 2 * (
        q[0, 0, -1] @ k[0, 0, 2 * 32 : 3 * 32].T
    ).max()
    tight = methods.build("flashprefill", alpha=0.5, **forced).select(q, k).mask()[0, 0, 7]
    assert tight.nonzero().flatten().tolist() == [2, 7]  # block 2 and the diagonal, no needle
    loose = methods.build("flashprefill", alpha=0.01, **forced).select(q, k).mask()[0, 0, 7]
    assert loose[4]


def test_is_the_centroid_rule():
    sel = methods.build("flashprefill")
    assert isinstance(sel, FlashPrefill) and isinstance(sel, Centroid)
    assert (sel.alpha, sel.block_size, sel.sink_blocks, sel.window_blocks, sel.last_q_blocks) == (
        0.12,
        128,
        2,
        4,
        2,
    )
    assert (sel.name, sel.knob, sel.knob_direction, sel.is_dense) == (
        "flashprefill",
        "alpha",
        -1,
        False,
    )
    q, k = structured_qk(1, 4, 2, 1200, 32, seed=3)
    same = methods.build("centroid", alpha=0.12, block_size=64).select(q, k)
    ours = methods.build("flashprefill", block_size=64).select(q, k)
    assert torch.equal(same.kv_count, ours.kv_count) and torch.equal(same.mask(), ours.mask())


def test_knob_is_monotone_and_causal():
    q, k = structured_qk(1, 2, 1, 2048, 32, seed=9)
    sel = methods.build("flashprefill", block_size=64)
    sels = [sel.with_knob(v).select(q, k) for v in (0.0, 0.05, 0.12, 0.5, 5.0)]
    dens = [s.density() for s in sels]
    assert all(a >= b for a, b in zip(dens, dens[1:])) and dens[0] == 1.0 and dens[-1] < dens[1]
    for s in sels:
        assert not s.mask().triu(1).any()
        assert s.kv_count.dtype == s.kv_indices.dtype == torch.int32


@pytest.mark.parametrize("n", [1, 127, 128, 129])
def test_tiny_sequences(n):
    s = methods.build("flashprefill").select(torch.randn(1, 2, n, 16), torch.randn(1, 1, n, 16))
    assert s.kv_count.shape == (1, 2, math.ceil(n / 128))
    assert s.density() == 1.0  # M <= window: every block is forced


def test_bad_fields_raise():
    with pytest.raises(ValueError, match="alpha must be"):
        methods.build("flashprefill", alpha=-0.1)
    with pytest.raises(ValueError, match="block_size"):
        methods.build("flashprefill", block_size=0)
    with pytest.raises(ValueError, match="window_blocks"):
        methods.build("flashprefill", window_blocks=-1)
    with pytest.raises(ValueError, match="impl must be one of"):
        methods.build("flashprefill", impl="cuda")
    with pytest.raises(ValueError, match="no field 'tau'"):
        methods.build("flashprefill", tau=0.9)
