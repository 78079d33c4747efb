"""FlexPrefill against a loop-by-loop transcription of its rule, plus hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import structured_qk
from rbs_bench.baselines.flexprefill import FlexPrefill, coverage_count, top_mask

from rbs_bench import methods
from rbs_bench.methods.selection import BlockSelection


def fewest_reaching(values, target):
    """Python: how many of the largest values it takes for their sum to reach target."""
    total = 0.0
    for count, x in enumerate(sorted(values, reverse=True), start=1):
        total += x
        if total >= target:
            return count
    return len(values)


def top_ids(scores, count):
    """Python: ids of the `count` largest scores, ties to the lower id."""
    return set(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:count])


def spec_selection(q, k, fields, scale=None):
    """The rule for one (batch, head) at a time, in float64: (kept bool [B, H, M, M], query-aware
    bool [B, H])."""
    sel = FlexPrefill(**fields)
    bs = sel.block_size
    b_, hq, n, d = q.shape
    g = hq // k.shape[1]
    m = math.ceil(n / bs)
    scale = 1 / math.sqrt(d) if scale is None else scale
    lo = math.ceil(sel.min_budget / bs)
    hi = m if sel.max_budget is None else min(m, math.ceil(sel.max_budget / bs))
    kept = torch.zeros(b_, hq, m, m, dtype=torch.bool)
    aware = torch.zeros(b_, hq, dtype=torch.bool)
    for b in range(b_):
        for h in range(hq):
            qh, kh = q[b, h].double(), k[b, h // g].double()
            vert, slash = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
            for p in range(n - bs, n):
                a = torch.softmax(kh[: p + 1] @ qh[p] * scale, 0) / bs  # keys 0..p
                vert[: p + 1] += a
                slash[: p + 1] += a.flip(0)  # offset o = p - t
            vert, slash = vert.tolist(), slash.tolist()
            n_v = min(max(fewest_reaching(vert, sel.gamma) // bs + 1, lo), hi)
            n_s = min(max(fewest_reaching(slash, sel.gamma) // bs + 1, lo), hi)
            vb = [sum(vert[j * bs : (j + 1) * bs]) for j in range(m)]
            sb = [sum(slash[j * bs : (j + 1) * bs]) for j in range(m)]
            q_bar = [qh[i * bs : (i + 1) * bs].mean(0) for i in range(m)]
            k_bar = [kh[j * bs : (j + 1) * bs].mean(0) for j in range(m)]
            q_last = qh[n - bs :].mean(0)
            est = torch.softmax(torch.stack([q_last @ kb for kb in k_bar]) * scale, 0).tolist()
            jsd = 0.0
            for x, y in zip(est, vb):
                mid = (x + y) / 2
                jsd += 0.5 * (x * math.log(x / mid) if x > 0 else 0.0)
                jsd += 0.5 * (y * math.log(y / mid) if y > 0 else 0.0)
            if math.sqrt(max(jsd, 0.0)) < sel.tau:
                aware[b, h] = True
                n_v = n_s = min(lo, hi)
            vb[0] = sb[0] = math.inf
            keep_v, keep_s = top_ids(vb, max(n_v, 1)), top_ids(sb, max(n_s, 1))
            for i in range(m):
                for j in range(i + 1):
                    kept[b, h, i, j] = j in keep_v or (i - j) in keep_s
            if aware[b, h]:
                entries = {}
                for i in range(m):
                    row = torch.softmax(
                        torch.stack([q_bar[i] @ k_bar[j] for j in range(i + 1)]) * scale, 0
                    )
                    for j in range(i + 1):
                        entries[i * m + j] = row[j].item()
                ids = sorted(entries, key=lambda e: (-entries[e], e))
                count = fewest_reaching(list(entries.values()), sel.gamma * m)
                for e in ids[:count]:
                    kept[b, h, e // m, e % m] = True
    return kept, aware


CASES = [  # (fields, (b, hq, hkv, n, d)); every case mixes query-aware and vertical-slash heads
    ({"min_budget": 0, "block_size": 32, "tau": 0.2}, (1, 4, 2, 1000, 16)),
    ({"min_budget": 100, "block_size": 32, "gamma": 0.6, "tau": 0.25}, (2, 4, 1, 777, 16)),
    ({"min_budget": 64, "max_budget": 200, "block_size": 64, "tau": 0.4}, (1, 4, 2, 1025, 16)),
    ({"min_budget": 0, "block_size": 16, "gamma": 0.95, "tau": 0.3}, (1, 8, 2, 300, 8)),
]


@pytest.mark.parametrize("fields,shape", CASES)
def test_matches_spec(fields, shape):
    q, k = structured_qk(*shape, seed=shape[3], kind="tempered")
    sel = methods.build("flexprefill", **fields)
    got = sel.select(q, k)
    want, aware = spec_selection(q, k, fields)
    est = sel.estimate(q, k)
    assert ((est.distance - sel.tau).abs() > 0.01).all(), "a head sits on the tau boundary"
    assert torch.equal(est.query_aware, aware) and aware.any() and not aware.all()
    assert torch.equal(got.mask(), want), f"{int((got.mask() != want).sum())} blocks differ"
    assert got.density() < 1.0


def test_scale_argument_is_used():
    fields = {"min_budget": 0, "block_size": 32, "tau": 0.3}
    q, k = structured_qk(1, 2, 1, 400, 16, seed=4, kind="tempered")
    got = FlexPrefill(**fields).select(q, k, scale=0.6).mask()
    want, _ = spec_selection(q, k, fields, scale=0.6)
    assert torch.equal(got, want)


def test_coverage_picks_the_minimal_set():
    p = torch.tensor([[0.125, 0.5, 0.0625, 0.25, 0.0625]], dtype=torch.float64)
    for gamma, want in [(0.0, 1), (0.5, 1), (0.75, 2), (0.76, 3), (0.875, 3), (0.9, 4), (1.0, 5)]:
        assert coverage_count(p, gamma).item() == want, gamma
    keep = top_mask(p, coverage_count(p, 0.8))
    assert keep.tolist() == [[True, True, False, True, False]]
    per_row = coverage_count(p.expand(2, -1), torch.tensor([0.5, 0.9]))
    assert per_row.tolist() == [1, 4]


def two_kind_heads(n=1024, bs=64, d=16):
    """Head 0 is pooled-friendly: keys constant over each block and identical last queries, so
    the pooled estimate equals the real block mass (the last block's keys score low and vanish);
    JSD ~ 0. Head 1 hides one strong key in an otherwise average block: the pooled estimate
    misses it while the last queries put almost all their mass there; JSD is large."""
    gen = torch.Generator().manual_seed(1)
    m = n // bs
    q, k = torch.zeros(1, 2, n, d), torch.zeros(1, 2, n, d)
    u = torch.zeros(d)
    u[0] = 1.0
    levels = torch.randn(m, generator=gen)
    levels[-1] = -30.0
    k[0, 0] = (levels[:, None] * u).repeat_interleave(bs, 0)
    k[0, 0, :, 1:] = torch.randn(m, d - 1, generator=gen).repeat_interleave(bs, 0) * 0.1
    q[0, 0] = 4.0 * u  # every query identical
    k[0, 1] = 0.3 * torch.randn(n, d, generator=gen)
    k[0, 1, 5 * bs + 17] = 20.0 * u  # the needle
    q[0, 1] = 4.0 * u + 0.1 * torch.randn(n, d, generator=gen)
    return q, k


def test_query_aware_switch_follows_jsd_and_tau():
    q, k = two_kind_heads()
    est = FlexPrefill(tau=0.1, min_budget=128, block_size=64).estimate(q, k, scale=1.0)
    assert est.distance[0, 0] < 0.01 and est.distance[0, 1] > 0.5
    assert est.query_aware.tolist() == [[True, False]]
    # a query-aware head drops to the minimum budget; the other keeps its coverage budget
    assert est.n_vertical[0, 0] == est.n_slash[0, 0] == 2
    for tau, want in [(0.0, [False, False]), (0.9, [True, True])]:  # sqrt(JSD) <= sqrt(ln 2)
        got = FlexPrefill(tau=tau, min_budget=128, block_size=64).estimate(q, k, scale=1.0)
        assert got.query_aware[0].tolist() == want
    # the query-aware head gets its pooled-coverage blocks on top of the vertical-slash ones
    sel = FlexPrefill(tau=0.1, min_budget=128, block_size=64)
    aware = sel.select(q, k, scale=1.0).mask()[0, 0]
    plain = FlexPrefill(tau=0.0, min_budget=128, block_size=64)
    vs_only = plain.select(q, k, scale=1.0).mask()[0, 0]
    assert (aware & ~vs_only).any()


def test_min_and_max_budget_honoured():
    q, k = two_kind_heads()  # head 1: one token holds almost all mass -> 1 block of coverage
    est = FlexPrefill(tau=0.0, min_budget=3 * 64 - 10, block_size=64).estimate(q, k, scale=1.0)
    assert est.n_vertical[0, 1] == 3 and est.n_slash[0, 1] == 3  # ceil(182 / 64) blocks
    sel = FlexPrefill(tau=0.0, min_budget=3 * 64 - 10, block_size=64).select(q, k, scale=1.0)
    last_row = sel.mask()[0, 1, -1]
    assert last_row.sum() >= 3 and last_row[0] and last_row[-1]
    gen = torch.Generator().manual_seed(0)
    flat_q, flat_k = 0.01 * torch.randn(1, 1, 1024, 16, generator=gen), torch.randn(1, 1, 1024, 16)
    capped = FlexPrefill(tau=0.0, min_budget=0, max_budget=130, block_size=64)
    est = capped.estimate(flat_q, flat_k)
    assert est.n_vertical.item() == est.n_slash.item() == 3  # ceil(130 / 64), not ~15


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("b,hq,hkv", [(2, 2, 2), (1, 4, 1)])
def test_invariants(n, b, hq, hkv):
    q, k = structured_qk(b, hq, hkv, n, 16, seed=n, kind="tempered")
    sel = FlexPrefill(min_budget=0, block_size=32, gamma=0.5)
    s = sel.select(q, k)
    m = math.ceil(n / 32)
    assert isinstance(s, BlockSelection) and s.kv_count.shape == (b, hq, m)
    mask = s.mask()
    assert not (mask & ~torch.ones(m, m, dtype=torch.bool).tril()).any()
    assert mask.diagonal(dim1=-2, dim2=-1).all() and mask[..., 0].all()  # forced blocks
    if sel.runs_dense(n):
        assert s.density() == 1.0


def test_default_runs_dense_up_to_min_budget():
    sel = methods.build("flexprefill")
    q, k = torch.randn(1, 2, 1024, 8), torch.randn(1, 1, 1024, 8)
    assert sel.runs_dense(1024) and sel.select(q, k).density() == 1.0
    assert not sel.runs_dense(1025)
    q2, k2 = structured_qk(1, 2, 1, 1300, 8, seed=0, kind="tempered")
    assert sel.select(q2, k2).shape == (1, 2, 11, 11)


def test_density_monotone_in_gamma():
    q, k = structured_qk(1, 4, 2, 1024, 16, seed=9, kind="tempered")
    base = FlexPrefill(min_budget=0, block_size=32)
    dens = [base.with_knob(g).select(q, k).density() for g in (0.0, 0.5, 0.8, 0.95, 1.0)]
    assert all(a <= b for a, b in zip(dens, dens[1:]))
    assert dens[0] < dens[-1]


def test_gqa_uses_own_kv_head():
    q, k = structured_qk(1, 4, 2, 800, 16, seed=5, kind="tempered")
    sel = FlexPrefill(min_budget=0, block_size=32, gamma=0.6)
    a = sel.select(q, k).mask()
    k2 = k.clone()
    k2[:, 0] = torch.randn_like(k2[:, 0])
    b = sel.select(q, k2).mask()
    assert torch.equal(a[:, 2:], b[:, 2:]) and not torch.equal(a[:, :2], b[:, :2])


def test_registry_and_knob():
    sel = methods.build("flexprefill")
    assert sel == FlexPrefill()
    assert (sel.gamma, sel.tau, sel.min_budget, sel.max_budget, sel.block_size) == (
        0.9,
        0.1,
        1024,
        None,
        128,
    )
    assert (sel.knob, sel.knob_direction, sel.is_dense) == ("gamma", 1, False)
    assert sel.with_knob(0.5).gamma == 0.5 and sel.fields()["min_budget"] == 1024
    assert sel.impl == "auto"  # Triton path on CUDA, the PyTorch reference elsewhere


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"gamma": 1.5}, "gamma must be"),
        ({"gamma": -0.1}, "gamma must be"),
        ({"gamma": float("nan")}, "gamma must be"),
        ({"tau": -1.0}, "tau must be"),
        ({"tau": float("inf")}, "tau must be"),
        ({"min_budget": -1}, "min_budget must be"),
        ({"min_budget": 10.5}, "min_budget must be"),
        ({"max_budget": 100}, "max_budget must be"),  # below the default min_budget 1024
        ({"max_budget": 0, "min_budget": 0}, "max_budget must be"),
        ({"block_size": 0}, "block_size must be"),
        ({"gama": 0.5}, "no field 'gama'"),
        ({"impl": "cuda"}, "impl must be one of auto, torch, triton"),
    ],
)
def test_bad_fields_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        methods.build("flexprefill", **fields)
    with pytest.raises(ValueError, match="gamma must be"):
        FlexPrefill().with_knob(2.0)
