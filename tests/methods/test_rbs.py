"""The RBS family against a literal, loop-by-loop transcription of docs/design.md §4."""

import math

import pytest
import torch
from conftest import structured_qk
from rbs_bench.kernels.block_stats import block_stats_ref, rescue_beta_ref

from rbs_bench import methods
from rbs_bench.methods.selection import BlockSelection

EPS = 1e-3  # blocks whose score sits this close to a threshold (log space) are not compared

# the needles of `structured_qk` here: a diluted needle every 192 tokens
NEEDLES = {"stride": 192, "span": 40, "reader": 7}


def spec_selection(name, q, k, fields, scale=None):
    """Transcription of the rule, one (batch, head, query block, key block) at a time.

    Returns (kept bool [B, H, M, M], near-threshold bool [B, H, M, M]).
    """
    sel = methods.build(name, **fields)
    bs = sel.block_size
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
            blocks = [kv[j * bs : min(n, (j + 1) * bs)] for j in range(m)]
            cent = [blk.mean(0) for blk in blocks]
            rad = torch.stack([(blk - c).norm(dim=-1).max() for blk, c in zip(blocks, cent)])
            lo, hi = torch.quantile(rad, 0.5), torch.quantile(rad, 0.9)
            beta = ((rad - lo) / (hi - lo)).clamp(0, 1) if hi > lo else torch.zeros_like(rad)
            branches = {
                "rbs": [
                    (0.0 * rad, fields.get("alpha_base", 0.22)),
                    (rad * beta, fields.get("alpha_rescue", 0.18)),
                ],
                "centroid": [(0.0 * rad, fields.get("alpha", 0.22))],
                "full_l2": [(rad, fields.get("alpha", 0.18))],
            }[name]
            for i in range(m):
                qi = q[b, h, i * bs : min(n, (i + 1) * bs)].double()
                for uplift, alpha in branches:
                    if i == 0:
                        continue  # no candidates before the first block
                    scores = torch.stack(
                        [
                            torch.logsumexp((qi @ cent[j] + qi.norm(dim=-1) * uplift[j]) * scale, 0)
                            for j in range(i)
                        ]
                    )
                    thr = math.log(alpha) + scores.max() if alpha > 0 else -math.inf
                    kept[b, h, i, :i] |= scores >= thr
                    near[b, h, i, :i] |= (scores - thr).abs() < EPS
                for j in range(i + 1):
                    if (
                        j < sel.sink_blocks
                        or j > i - sel.window_blocks
                        or i >= m - sel.last_q_blocks
                    ):
                        forced[b, h, i, j] = True
    return kept | forced, near & ~forced  # forced blocks are kept whatever their score


CASES = [  # (name, fields)
    ("rbs", {}),
    ("rbs", {"alpha_base": 0.5, "alpha_rescue": 0.05, "block_size": 32}),
    ("centroid", {"block_size": 64}),
    (
        "centroid",
        {"alpha": 0.6, "sink_blocks": 1, "window_blocks": 1, "last_q_blocks": 0, "block_size": 32},
    ),
    ("full_l2", {"block_size": 64}),
    (
        "full_l2",
        {"alpha": 0.9, "sink_blocks": 0, "window_blocks": 2, "last_q_blocks": 1, "block_size": 32},
    ),
]


@pytest.mark.parametrize("name,fields", CASES)
@pytest.mark.parametrize("n,hq,hkv", [(1000, 4, 2), (777, 2, 2), (1025, 8, 1), (3000, 2, 1)])
def test_matches_spec(name, fields, n, hq, hkv):
    q, k = structured_qk(
        2 if n == 777 else 1, hq, hkv, n, 32, seed=n + hq, kind="needles", **NEEDLES
    )
    got = methods.build(name, **fields).select(q, k).mask()
    want, near = spec_selection(name, q, k, fields)
    assert near.float().mean() < 0.02, "too many boundary blocks for a meaningful comparison"
    differ = (got != want) & ~near
    assert not differ.any(), f"{int(differ.sum())} blocks differ from the rule"
    assert got.any(-1).all() or fields.get("window_blocks", 4) == 0
    if want.shape[-1] >= 12:  # enough blocks that the rule must prune something
        assert want.sum() < torch.ones_like(want).tril().sum()


def test_scale_argument_is_used():
    q, k = structured_qk(1, 2, 1, 640, 32, seed=3, kind="needles", **NEEDLES)
    got = methods.build("rbs", block_size=32).select(q, k, scale=0.05).mask()
    want, near = spec_selection("rbs", q, k, {"block_size": 32}, scale=0.05)
    assert not ((got != want) & ~near).any()


def test_block_stats_partial_block():
    k = torch.randn(1, 1, 130, 8)
    c, r = block_stats_ref(k, 64)
    assert c.shape == (1, 1, 3, 8) and r.shape == (1, 1, 3)
    torch.testing.assert_close(c[0, 0, 2], k[0, 0, 128:].mean(0))
    want = (k[0, 0, 128:] - k[0, 0, 128:].mean(0)).norm(dim=-1).max()
    torch.testing.assert_close(r[0, 0, 2], want)
    _, r1 = block_stats_ref(k[:, :, :129], 64)
    assert r1[0, 0, 2] == 0  # a one-token block has radius 0


def test_beta_degenerate_and_ramp():
    assert (rescue_beta_ref(torch.full((1, 1, 7), 2.0)) == 0).all()
    r = torch.arange(11.0).view(1, 1, 11)  # q50 = 5, q90 = 9
    torch.testing.assert_close(rescue_beta_ref(r)[0, 0], ((r[0, 0] - 5) / 4).clamp(0, 1))


@pytest.mark.parametrize("n", [1, 100, 128, 129])
def test_tiny_sequences_keep_diagonal(n):
    q, k = torch.randn(1, 2, n, 16), torch.randn(1, 1, n, 16)
    s = methods.build("rbs").select(q, k)
    assert s.density() == 1.0  # every block is forced when M <= window
    assert s.kv_count.shape == (1, 2, math.ceil(n / 128))


def test_gqa_uses_own_kv_head():
    q, k = structured_qk(1, 4, 2, 1024, 32, seed=5, kind="needles", **NEEDLES)
    full = methods.build("centroid", block_size=64).select(q, k).mask()
    # query heads 2-3 read KV head 1: replacing KV head 0 must not move their selection
    k2 = k.clone()
    k2[:, 0] = torch.randn_like(k2[:, 0])
    alt = methods.build("centroid", block_size=64).select(q, k2).mask()
    assert torch.equal(full[:, 2:], alt[:, 2:])
    assert not torch.equal(full[:, :2], alt[:, :2])


@pytest.mark.parametrize("name", ["rbs", "centroid", "full_l2"])
def test_knob_is_monotone(name):
    q, k = structured_qk(1, 2, 1, 2048, 32, seed=9, kind="needles", **NEEDLES)
    sel = methods.build(name, block_size=64)
    dens = [sel.with_knob(v).select(q, k).density() for v in (0.0, 0.05, 0.3, 1.0, 5.0)]
    assert all(a >= b for a, b in zip(dens, dens[1:]))
    assert dens[0] == 1.0  # alpha 0 keeps every candidate
    forced_only = methods.build(name, block_size=64).with_knob(5.0).select(q, k).density()
    assert dens[-1] == forced_only < dens[1]


def test_rbs_knob_scales_default_pair():
    sel = methods.build("rbs").with_knob(0.5)
    assert (sel.alpha_base, sel.alpha_rescue) == pytest.approx((0.11, 0.09))


def test_selection_layout_and_density():
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)[None, None]
    s = BlockSelection.from_mask(mask | torch.ones_like(mask).triu(1), 64, 64, 150)
    assert s.kv_count.tolist() == [[[1, 2, 2]]]
    assert s.kv_indices[0, 0, 2, :2].tolist() == [1, 2]
    assert s.kv_count.dtype == s.kv_indices.dtype == torch.int32
    assert torch.equal(s.mask(), mask)  # above-diagonal blocks were dropped
    assert s.density() == pytest.approx(5 / 6)


def test_dense_selects_everything():
    q, k = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 300, 16)
    s = methods.build("dense").select(q, k)
    assert s.density() == 1.0 and s.mask().shape == (2, 4, 3, 3)


def test_registry_errors():
    with pytest.raises(methods.UnknownMethodError, match="valid methods: centroid, dense"):
        methods.build("nosuch")
    with pytest.raises(ValueError, match="no field 'alpah'.*alpha_base"):
        methods.build("rbs", alpah=0.1)
    with pytest.raises(ValueError, match="alpha must be"):
        methods.build("centroid", alpha=-1)
    with pytest.raises(ValueError, match="block_size"):
        methods.build("rbs", block_size=0)
