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


def test_families_default_is_the_plain_structure():
    a = synthetic.generate(1, 4, 2, 2048, 64, seed=5)
    b = synthetic.generate(1, 4, 2, 2048, 64, seed=5, structure=synthetic.FAMILIES["synthetic"])
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.needles, b.needles)


def test_needles_family_has_large_logits_on_scattered_queries():
    s = synthetic.FAMILIES["needles"]
    d = synthetic.generate(1, 2, 1, 8192, 128, structure=s, seed=0)
    again = synthetic.generate(1, 2, 1, 8192, 128, structure=s, seed=0)
    assert torch.equal(d.q, again.q) and torch.equal(d.needles, again.needles)
    q, k = d.q[0, 0], d.k[0, 0]
    keys = d.needles[:, 2].unique()
    assert len(keys) == s.needles  # one key per needle, in distinct blocks
    assert len((keys // s.needle_block).unique()) == s.needles
    logits = (q @ k[keys].T) / 128**0.5  # [N, needles]
    # each needle is matched by queries spread over several query blocks after its key, at a
    # logit in the family's range (up to the random background's noise)
    for j, t in enumerate(keys.tolist()):
        blocks = d.needles[d.needles[:, 2] == t, 3]
        later = 8192 // s.needle_block - t // s.needle_block - 1  # query blocks after the key's
        assert len(blocks) >= min(8, later) and int(blocks.min()) > t // s.needle_block
        hits = logits[:, j] > 0.5 * s.needle_strength
        assert hits.sum() >= 0.8 * s.needle_queries
        typical = logits[hits, j].median()
        assert 0.9 * s.needle_strength < typical < 1.1 * s.needle_strength_max
