"""Structured attention inputs: seeded, shaped, and carrying the structure they promise."""

import torch

from rbs_bench import synthetic


def test_seeded_and_shaped():
    a = synthetic.generate(2, 8, 2, 2048, 64, seed=3)
    b = synthetic.generate(2, 8, 2, 2048, 64, seed=3)
    c = synthetic.generate(2, 8, 2, 2048, 64, seed=4)
    assert a.q.shape == (2, 8, 2048, 64) and a.k.shape == a.v.shape == (2, 2, 2048, 64)
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.needles, b.needles)
    assert not torch.equal(a.q, c.q)
    assert a.needles.shape == (2 * 2 * 8, 4)


def test_structure_shows_in_attention():
    d = synthetic.generate(1, 2, 1, 4096, 64, seed=0)
    logits = d.q[0, 0] @ d.k[0, 0].T / 8  # [N, N]
    causal = torch.ones(4096, 4096, dtype=torch.bool).tril()
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    assert probs[1024:, :4].sum(-1).mean() > 0.2  # sinks draw mass from every later query
    found = []
    for _, h, t, qb in d.needles.tolist():
        found.append(probs[qb * 128 : (qb + 1) * 128, t].mean())  # mass on the needle key
        # ...while the needle's block centroid hides it among dispersed keys
        blk = d.k[0, h, (t // 128) * 128 : (t // 128 + 1) * 128]
        assert (blk - blk.mean(0)).norm(dim=-1).max() > 1.5 * (d.k[0, h] - d.k[0, h].mean(0)).norm(
            dim=-1
        ).median()
    assert torch.stack(found).mean() > 0.2  # the needles' query blocks find their keys
