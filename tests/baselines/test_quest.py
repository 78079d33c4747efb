"""Quest-style prefill selection against a loop-by-loop transcription of its box-bound rule."""

import math

import pytest
import torch
from conftest import structured_qk

from rbs_bench import methods  # first: importing it registers the baselines

# isort: split
from rbs_bench.baselines.quest import Quest, box_scores_ref, box_stats_ref, top_fraction

from rbs_bench.methods.selection import candidate_mask

EPS = 1e-3  # blocks within this (scaled logit units) of the top-k boundary are not compared


def spec_selection(q, k, fields):
    """The rule, one (batch, head, query block, key block) at a time, in float64.

    bound(t, j) = sum_d max(q_td kmax_jd, q_td kmin_jd); score(i, j) = max_t bound(t, j); keep the
    ceil(ratio * i) best of j < i (at least 1; ties to the lower id) plus RBS's forced blocks.
    Returns (kept bool [B, H, M, M], near-boundary bool [B, H, M, M]).
    """
    sel = Quest(**fields)
    bs = sel.block_size
    b_, hq, n, d = q.shape
    g = hq // k.shape[1]
    m = math.ceil(n / bs)
    kept = torch.zeros(b_, hq, m, m, dtype=torch.bool)
    near = torch.zeros_like(kept)
    forced = torch.zeros_like(kept)
    for b in range(b_):
        for h in range(hq):
            kv = k[b, h // g].double()
            blocks = [kv[j * bs : min(n, (j + 1) * bs)] for j in range(m)]
            kmin = [blk.min(0).values for blk in blocks]
            kmax = [blk.max(0).values for blk in blocks]
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
                score = []
                for j in range(i):
                    bound = torch.maximum(rows * kmax[j], rows * kmin[j]).sum(-1)  # [rows]
                    score.append(float(bound.max()) / math.sqrt(d))
                count = max(1, math.ceil(round(sel.ratio * i, 9)))
                ranked = sorted(range(i), key=lambda j: (-score[j], j))
                for j in ranked[:count]:
                    kept[b, h, i, j] = True
                if count < i:  # a near tie across the boundary makes the order ambiguous
                    lo, hi = score[ranked[count]], score[ranked[count - 1]]
                    if hi - lo < EPS:
                        for j in range(i):
                            near[b, h, i, j] = lo - EPS < score[j] < hi + EPS
    return kept | forced, near & ~forced


CASES = [  # (fields, n, hq, hkv, batch)
    ({}, 2000, 4, 2, 1),
    ({"ratio": 0.3, "block_size": 64}, 1500, 4, 1, 2),
    (
        {"ratio": 0.05, "block_size": 32, "sink_blocks": 1, "window_blocks": 1, "last_q_blocks": 0},
        1000,
        2,
        2,
        1,
    ),
    ({"ratio": 0.15, "block_size": 64, "window_blocks": 2}, 3000, 2, 1, 1),
]


@pytest.mark.parametrize("fields,n,hq,hkv,batch", CASES)
def test_matches_spec(fields, n, hq, hkv, batch):
    q, k = structured_qk(batch, hq, hkv, n, 32, seed=5 * n + hq)
    got = methods.build("quest", **fields).select(q, k).mask()
    want, near = spec_selection(q, k, fields)
    assert near.float().mean() < 0.02, "too many boundary blocks for a meaningful comparison"
    differ = (got != want) & ~near
    assert not differ.any(), f"{int(differ.sum())} blocks differ ({int(near.sum())} excepted)"
    assert want.sum() < torch.ones_like(want).tril().sum()  # the rule prunes something


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


def test_box_bound_ranks_the_needle_first():
    q, k, forced = needle_case()
    # ratio 0.1 of 7 candidates keeps one block: the needle's, not the moderately aligned block 2
    kept = methods.build("quest", ratio=0.1, **forced).select(q, k).mask()[0, 0, 7]
    assert kept.nonzero().flatten().tolist() == [4, 7]
    # on the same input the mean key (FlashPrefill at a tight threshold) keeps block 2 instead
    mean_key = methods.build("flashprefill", alpha=0.5, **forced).select(q, k).mask()[0, 0, 7]
    assert mean_key.nonzero().flatten().tolist() == [2, 7]


def test_bound_is_an_upper_bound_and_exact_for_one_key():
    q, k = torch.randn(1, 2, 300, 8), torch.randn(1, 1, 300, 8)
    scores = box_scores_ref(q, *box_stats_ref(k, 64), 64)  # [1, 2, 5, 5]; last block partial
    logits = q @ k.transpose(-1, -2)  # [1, 2, 300, 300]
    for i in range(5):
        for j in range(5):
            tile = logits[0, :, i * 64 : (i + 1) * 64, j * 64 : (j + 1) * 64]
            assert (scores[0, :, i, j] >= tile.amax((1, 2)) - 1e-5).all()
    # one-key blocks and one-token query blocks: the box is the key, the bound is the logit
    one = box_scores_ref(q[:, :, :20], *box_stats_ref(k[:, :, :20], 1), 1)
    assert torch.allclose(one, logits[:, :, :20, :20], atol=1e-5)


def test_ties_go_to_the_lower_block_id():
    scores = torch.zeros(1, 1, 6, 6)  # every candidate ties
    keep = top_fraction(scores, candidate_mask(6), 0.4)
    # ceil(0.4 * |C_i|) of the candidates 0..i-1: 1, 1, 2, 2, 2 for i = 1..5
    assert [keep[0, 0, i].nonzero().flatten().tolist() for i in range(6)] == [
        [],
        [0],
        [0],
        [0, 1],
        [0, 1],
        [0, 1],
    ]
    # 0.1 * 30 is 3.0000000000000004 in floating point: still 3 blocks, not 4
    keep = top_fraction(torch.zeros(31, 31), candidate_mask(31), 0.1)
    assert int(keep[30].sum()) == 3


def test_gqa_matches_repeated_kv():
    q, k = structured_qk(2, 4, 2, 700, 16, seed=1)
    sel = methods.build("quest", block_size=32, ratio=0.2)
    got = sel.select(q, k).mask()
    assert torch.equal(got, sel.select(q, k.repeat_interleave(2, 1)).mask())
    assert not torch.equal(got[:, 0], got[:, 2])  # heads read different KV heads


def test_knob_is_monotone_and_causal():
    q, k = structured_qk(1, 2, 1, 2048, 32, seed=9)
    sel = methods.build("quest", block_size=64)
    sels = [sel.with_knob(v).select(q, k) for v in (0.0, 0.05, 0.1, 0.3, 1.0)]
    dens = [s.density() for s in sels]
    assert all(a <= b for a, b in zip(dens, dens[1:])) and dens[-1] == 1.0 and dens[0] < dens[-2]
    for s in sels:
        assert not s.mask().triu(1).any()
    # ratio 0 still keeps one candidate per query block that has any
    m = sels[0].mask()[0, 0]
    assert all(int(m[i, :i].sum()) >= 1 for i in range(1, m.shape[0]))


@pytest.mark.parametrize("n", [1, 127, 128, 129])
def test_tiny_sequences(n):
    s = methods.build("quest").select(torch.randn(1, 2, n, 16), torch.randn(1, 1, n, 16))
    assert s.kv_count.shape == (1, 2, math.ceil(n / 128))
    assert s.density() == 1.0  # M <= window: every block is forced


def test_registry_and_bad_fields():
    sel = methods.build("quest")
    assert isinstance(sel, Quest) and sel.ratio == 0.1
    assert (sel.name, sel.knob, sel.knob_direction, sel.is_dense) == ("quest", "ratio", 1, False)
    assert sel.with_knob(0.3).ratio == 0.3 and sel.fields()["ratio"] == 0.1
    for bad in (-0.1, 1.5, math.nan, "0.1"):
        with pytest.raises(ValueError, match="ratio must be"):
            methods.build("quest", ratio=bad)
    with pytest.raises(ValueError, match="sink_blocks"):
        methods.build("quest", sink_blocks=-1)
    with pytest.raises(ValueError, match="no field 'alpha'"):
        methods.build("quest", alpha=0.1)
