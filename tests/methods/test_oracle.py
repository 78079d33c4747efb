"""The oracle keeps each row's heaviest candidate blocks by true attention mass, and attention
recall is the share of the dense softmax mass a selection keeps."""

import math

import pytest
import torch
from rbs_bench.baselines.minference import MInference

from rbs_bench import methods
from rbs_bench.methods.mass import attention_recall
from rbs_bench.methods.oracle import Oracle
from rbs_bench.methods.selection import BlockSelection, causal_block_mask, forced_mask


def _qk(n=200, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g) * 2
    k = torch.randn(1, hkv, n, d, generator=g) * 2
    return q, k


def _dense_probs(q, k, scale=None):
    """fp64 [B, Hq, N, N] causal softmax, written out."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    z = q.double() @ kk.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    n = q.shape[2]
    z = z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return z.softmax(-1)


def _block_sums(p, bs):
    n = p.shape[-1]
    m = -(-n // bs)
    pad = m * bs - n
    p = torch.nn.functional.pad(p, (0, pad, 0, pad))
    return p.reshape(*p.shape[:2], m, bs, m, bs).sum((3, 5))


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_oracle_keeps_the_heaviest_candidates_of_each_row(ratio):
    bs = 32
    q, k = _qk()
    sel = Oracle(ratio=ratio, block_size=bs, sink_blocks=1, window_blocks=1, last_q_blocks=1)
    got = sel.select(q, k).mask()[0]
    mass = _block_sums(_dense_probs(q, k), bs)[0]  # [H, M, M]
    m = mass.shape[-1]
    want = forced_mask(m, 1, 1, 1).expand(q.shape[1], m, m).clone()
    for h in range(q.shape[1]):
        for i in range(1, m):
            count = min(i, max(1, math.ceil(ratio * i - 1e-9)))
            top = mass[h, i, :i].argsort(descending=True, stable=True)[:count]
            want[h, i, top] = True
    assert torch.equal(got, want)


def test_oracle_holds_at_least_the_mass_of_any_selector_with_its_row_counts():
    q, k = _qk(n=256, seed=3)
    none = dict(block_size=32, sink_blocks=0, window_blocks=0, last_q_blocks=0)  # no forced
    a = methods.build("quest", ratio=0.25, **none).select(q, k)
    b = Oracle(ratio=0.25, **none).select(q, k)
    assert torch.equal(a.kv_count, b.kv_count)  # the same number of blocks per row
    assert (attention_recall(q, k, b) >= attention_recall(q, k, a) - 1e-6).all()


def test_recall_is_the_kept_share_of_the_dense_mass():
    q, k = _qk(n=200)
    p = _dense_probs(q, k)
    full = BlockSelection.full(1, q.shape[1], 200, 32)
    torch.testing.assert_close(attention_recall(q, k, full), torch.ones(1, 4))
    sel = methods.build("quest", ratio=0.2, block_size=32, sink_blocks=1, window_blocks=1)
    s = sel.select(q, k)
    token = s.mask()[0].repeat_interleave(32, -1).repeat_interleave(32, -2)[:, :200, :200]
    want = (p[0] * token).sum((-1, -2)) / 200
    torch.testing.assert_close(attention_recall(q, k, s)[0], want.float(), atol=1e-5, rtol=0)
    assert (s.kv_count.sum(-1) < causal_block_mask(200, 32, 32).sum()).all()  # blocks dropped


def test_recall_of_a_token_pattern_counts_its_pairs():
    q, k = _qk(n=300)
    pat = MInference(vertical_size=20, slash_size=30, last_q=16, sink_tokens=4, local_diagonals=8)
    pat = pat.with_knob(1.0).select(q, k)
    want = (_dense_probs(q, k)[0] * pat.token_mask()[0]).sum((-1, -2)) / 300
    torch.testing.assert_close(attention_recall(q, k, pat)[0], want.float(), atol=1e-5, rtol=0)
    assert (want < 1).all()


def test_density_curve_is_the_selection_density_at_every_ratio():
    q, k = _qk(n=300, seed=5)
    sel = Oracle(block_size=32, sink_blocks=1, window_blocks=2, last_q_blocks=1)
    ratios = [0.0, 0.05, 0.2, 0.37, 0.5, 0.8, 1.0]
    want = [sel.with_knob(r).select(q, k).density() for r in ratios]
    assert sel.density_curve(q, k, None, ratios) == pytest.approx(want, abs=1e-12)


def test_one_block_mass_serves_select_curve_and_recall(monkeypatch):
    from rbs_bench.methods import mass

    calls = []
    real = mass.block_mass_ref
    monkeypatch.setattr(mass, "block_mass_ref", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    mass.forget_block_mass()
    q, k = _qk(n=256, seed=7)
    sel = Oracle(ratio=0.3, block_size=32, sink_blocks=1, window_blocks=1, last_q_blocks=1)
    s = sel.select(q, k)
    sel.density_curve(q, k, None, [0.1, 0.5])
    got = attention_recall(q, k, s)
    assert len(calls) == 1  # the same q and k: one pass
    fresh = _block_sums(_dense_probs(q, k), 32)  # the recall is still the one of these q, k
    want = (fresh * s.mask()).sum((-1, -2)) / 256
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)

    attention_recall(q, k, s, scale=0.5)  # another scale
    attention_recall(q.clone(), k, s)  # another tensor with the same values
    assert len(calls) == 3
    q.mul_(2)  # changed in place: its version counter moved
    attention_recall(q, k, s)
    assert len(calls) == 4
    with torch.inference_mode():  # inference tensors have no version counter: identity only
        qi, ki = _qk(n=256, seed=8)
        sel.select(qi, ki)
        attention_recall(qi, ki, s)
        assert len(calls) == 5


def test_kept_block_mass_goes_with_its_tensors():
    import gc

    from rbs_bench.methods import mass

    q, k = _qk(n=128)
    mass.true_block_mass(q, k, 32)
    assert mass._last is not None
    del q
    gc.collect()
    assert mass._last is None  # the mass is freed with its layer's q
