"""XAttention against a loop-by-loop transcription of its antidiagonal / cumulative rule."""

import math

import pytest
import torch
from conftest import structured_qk

from rbs_bench import methods  # first: importing it registers the baselines

# isort: split
from rbs_bench.baselines.xattn import (
    XAttention,
    antidiagonal_mass_ref,
    cumulative_keep,
    upstream_chunk_tokens,
    upstream_first_chunk_keep,
)

EPS = 1e-3  # cumulative sums this close to tau (as fractions of the row mass) are not compared
TIE = 1e-5  # masses this close (same units) may rank either way in fp32: excepted too


def spec_mass(q, k, block_size, stride, scale=None):
    """float64 [B, H, M, M]: reshaped row r of query head h (the S queries r S .. r S + S - 1,
    reversed) against reshaped column c <= r (keys c S .. c S + S - 1); the cell's logit is the sum
    over t of q[r S + S - 1 - t] . k[c S + t], times scale / S; row softmax; summed per block."""
    b_, hq, n, d = q.shape
    g = hq // k.shape[1]
    m = math.ceil(n / block_size)
    rb = block_size // stride
    scale = 1 / math.sqrt(d) if scale is None else scale
    pad = m * block_size - n  # zero tokens: they add nothing to an antidiagonal sum
    mass = torch.zeros(b_, hq, m, m, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            qh = torch.nn.functional.pad(q[b, h].double(), (0, 0, 0, pad))
            kh = torch.nn.functional.pad(k[b, h // g].double(), (0, 0, 0, pad))
            for r in range(math.ceil(n / stride)):  # rows holding at least one real query
                rev = qh[[r * stride + stride - 1 - t for t in range(stride)]]  # [S, D], row t
                keys = kh[: (r + 1) * stride].view(r + 1, stride, d)  # keys[c, t] = k[c S + t]
                logits = torch.einsum("ctd,td->c", keys, rev)  # sum over t of the S products
                probs = torch.softmax(logits * scale / stride, 0)
                block_of_c = torch.arange(r + 1) // rb
                mass[b, h, r // rb].index_add_(0, block_of_c, probs)
    return mass


def spec_keep(mass, tau):
    """XAttention's per-row rule on float64 masses; returns (kept, near) bool [B, H, M, M]."""
    b_, hq, m, _ = mass.shape
    kept = torch.zeros(b_, hq, m, m, dtype=torch.bool)
    near = torch.zeros_like(kept)
    for b in range(b_):
        for h in range(hq):
            for i in range(m):
                v = mass[b, h, i].tolist()
                total = sum(v[: i + 1])
                required = tau * total
                kept[b, h, i, 0] = kept[b, h, i, i] = True
                done = v[0] + (v[i] if i > 0 else 0.0)
                ranked = sorted(range(1, i), key=lambda j: (-v[j], j))
                crossing = None
                for p, j in enumerate(ranked):
                    if done < required:
                        kept[b, h, i, j] = True
                    elif crossing is None:
                        crossing = p
                    if abs(done - required) < EPS * total:
                        near[b, h, i, j] = True
                    done += v[j]
                if crossing:  # a near tie across the boundary makes the order ambiguous
                    lo, hi = v[ranked[crossing]], v[ranked[crossing - 1]]
                    if hi - lo < TIE * total:
                        for j in range(1, i):
                            near[b, h, i, j] |= lo - TIE * total < v[j] < hi + TIE * total
    return kept, near


CASES = [  # (fields, n, hq, hkv, batch); n % stride != 0 in two cases (partial reshaped rows)
    ({}, 2000, 4, 2, 1),
    ({"stride": 8, "block_size": 64, "tau": 0.8}, 1500, 4, 1, 2),
    ({"tau": 0.5, "block_size": 32}, 1000, 2, 2, 1),
    ({"tau": 0.95, "stride": 8}, 3000, 2, 1, 1),
]


@pytest.mark.parametrize("fields,n,hq,hkv,batch", CASES)
def test_matches_spec(fields, n, hq, hkv, batch):
    q, k = structured_qk(batch, hq, hkv, n, 32, seed=3 * n + hq)
    sel = methods.build("xattn", **fields)
    want_mass = spec_mass(q, k, sel.block_size, sel.stride)
    mass = antidiagonal_mass_ref(q, k, sel.block_size, sel.stride)
    assert torch.allclose(mass.double(), want_mass, atol=1e-4, rtol=1e-4)
    got = sel.select(q, k).mask()
    want, near = spec_keep(want_mass, sel.tau)
    assert near.float().mean() < 0.02, "too many boundary blocks for a meaningful comparison"
    differ = (got != want) & ~near
    assert not differ.any(), f"{int(differ.sum())} blocks differ ({int(near.sum())} excepted)"
    assert want.sum() < torch.ones_like(want).tril().sum()  # the rule prunes something


def test_scale_argument_is_used():
    q, k = structured_qk(1, 2, 1, 700, 16, seed=4)
    got = methods.build("xattn", block_size=32).select(q, k, scale=0.02).mask()
    want, near = spec_keep(spec_mass(q, k, 32, 16, scale=0.02), 0.9)
    assert not ((got != want) & ~near).any()
    assert not torch.equal(got, methods.build("xattn", block_size=32).select(q, k).mask())


def test_cumulative_rule_crosses_tau_exactly():
    # query block 5; dyadic masses, so every sum below is exact. Forced: block 0 (0.25) and the
    # diagonal (0.0625); the rest ranked 2 (0.375), then 1 and 4 tied at 0.125 (lower id first), 3.
    mass = torch.zeros(1, 1, 6, 6)
    mass[0, 0, 5] = torch.tensor([0.25, 0.125, 0.375, 0.0625, 0.125, 0.0625])

    def kept(tau):
        return cumulative_keep(mass, tau)[0, 0, 5].nonzero().flatten().tolist()

    assert kept(0.0) == [0, 5]  # nothing is required: only the forced blocks
    assert kept(0.3125) == [0, 5]  # the forced mass alone reaches tau: stop before block 2
    assert kept(0.3126) == [0, 2, 5]  # block 2 crosses tau and is kept
    assert kept(0.6875) == [0, 2, 5]  # 0.3125 + 0.375 reaches tau exactly: block 1 is not added
    assert kept(0.6876) == [0, 1, 2, 5]  # ... and is once tau is a hair above it
    assert kept(0.8125) == [0, 1, 2, 5]  # the tie: block 1 is taken before block 4
    assert kept(0.8126) == [0, 1, 2, 4, 5]
    assert kept(1.0) == [0, 1, 2, 3, 4, 5]
    assert cumulative_keep(mass, 1.0)[0, 0].triu(1).sum() == 0  # never above the diagonal


def test_uniform_attention_is_the_known_mass():
    # q = 0: every reshaped row spreads its unit mass evenly over the columns it sees
    n, bs, s = 256, 64, 16  # 4 blocks of 4 reshaped rows
    q, k = torch.zeros(1, 1, n, 8), torch.randn(1, 1, n, 8)
    mass = antidiagonal_mass_ref(q, k, bs, s)[0, 0]
    rb = bs // s
    for i in range(4):
        rows = range(i * rb, (i + 1) * rb)
        for j in range(i):
            assert mass[i, j].item() == pytest.approx(sum(rb / (r + 1) for r in rows))
        diag = sum((r - i * rb + 1) / (r + 1) for r in rows)
        assert mass[i, i].item() == pytest.approx(diag)
    assert mass.sum(-1).tolist() == pytest.approx([rb] * 4)  # each row total is B / S
    # equal masses: the cumulative rule takes the lowest ids first
    sel = methods.build("xattn", block_size=bs, tau=0.6)
    got = sel.select(q, k).mask()[0, 0, 3].nonzero().flatten().tolist()
    v = mass[3].double()  # 0.6 of the row: block 0 and the diagonal, then blocks 1, 2 in order
    need = [j for j in (1, 2) if v[0] + v[3] + v[1:j].sum() < 0.6 * v.sum()]
    assert got == sorted([0, 3, *need])


def test_gqa_matches_repeated_kv():
    q, k = structured_qk(2, 4, 2, 700, 16, seed=2)
    sel = methods.build("xattn", block_size=32, tau=0.8)
    got = sel.select(q, k).mask()
    assert torch.equal(got, sel.select(q, k.repeat_interleave(2, 1)).mask())
    assert not torch.equal(got[:, 0], got[:, 2])  # heads read different KV heads


def test_knob_is_monotone_and_causal():
    q, k = structured_qk(1, 2, 1, 2048, 32, seed=9)
    sel = methods.build("xattn", block_size=64, stride=8)
    sels = [sel.with_knob(v).select(q, k) for v in (0.0, 0.5, 0.8, 0.95, 1.0)]
    dens = [s.density() for s in sels]
    assert all(a <= b for a, b in zip(dens, dens[1:])) and dens[0] < dens[2] < dens[-1]
    m = 2048 // 64
    assert dens[0] == pytest.approx((2 * m - 1) / (m * (m + 1) / 2))  # block 0 and the diagonal
    for s in sels:
        assert not s.mask().triu(1).any()


@pytest.mark.parametrize("n", [1, 127, 128, 129])
@pytest.mark.parametrize("stride", [8, 16])
def test_tiny_sequences(n, stride):
    s = methods.build("xattn", stride=stride).select(
        torch.randn(1, 2, n, 16), torch.randn(1, 1, n, 16)
    )
    assert s.kv_count.shape == (1, 2, math.ceil(n / 128))
    assert s.density() == 1.0  # at most two blocks: block 0 and the diagonal


def test_registry_and_bad_fields():
    sel = methods.build("xattn")
    assert isinstance(sel, XAttention) and (sel.tau, sel.stride, sel.block_size) == (0.9, 16, 128)
    assert (sel.name, sel.knob, sel.knob_direction, sel.is_dense) == ("xattn", "tau", 1, False)
    assert sel.with_knob(0.5).tau == 0.5 and sel.fields() == {
        "tau": 0.9,
        "stride": 16,
        "block_size": 128,
        "impl": "auto",
    }
    for bad in (-0.1, 1.01, math.inf, "0.9"):
        with pytest.raises(ValueError, match="tau must be"):
            methods.build("xattn", tau=bad)
    for bad in (4, 12, 32, 16.0):
        with pytest.raises(ValueError, match="stride must be one of"):
            methods.build("xattn", stride=bad)
    with pytest.raises(ValueError, match="multiple of stride"):
        methods.build("xattn", block_size=136)
    with pytest.raises(ValueError, match="block_size"):
        methods.build("xattn", block_size=0)
    with pytest.raises(ValueError, match="no field 'sink_blocks'"):
        methods.build("xattn", sink_blocks=2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sel.select(torch.randn(1, 3, 64, 8), torch.randn(1, 2, 64, 8))


# ------------------------------------------------------------------ upstream's first query chunk


def upstream_chunk(rows, c0, tau):
    """Kept block ids of each row of one query chunk, by the steps of upstream's
    `find_blocks_chunked` (threshold, causal, prefill), one at a time.

    `rows`: the masses (lists of M floats, zero above the diagonal) of query blocks c0, c0 + 1, ...
    Column 0 is marked, then the chunk's identity block is written over columns c0 .. c0 + rows - 1
    (in the first chunk, over column 0 too). The running sum walks slots that start with 0 and the
    marked mass, then the unmarked masses in descending order, less the last two; the blocks walk
    the marked ones first, then the others by descending mass (ties: lower id first). A block is
    kept while the sum of the slots before its position is < tau * total; any other position
    points at block 0, which is then kept too. Blocks above the diagonal are dropped at the end.
    """
    m, out = len(rows[0]), []
    for r, v in enumerate(rows):
        marked = [j == 0 for j in range(m)]
        for c in range(c0, c0 + len(rows)):
            marked[c] = c == c0 + r
        required = tau * sum(v)
        others = sorted((0.0 if marked[j] else v[j] for j in range(m)), reverse=True)
        slots = [0.0, sum(v[j] for j in range(m) if marked[j])] + others[: m - 2]
        order = sorted(range(m), key=lambda j: (not marked[j], -v[j], j))
        kept, running = {j for j in range(m) if marked[j]}, 0.0
        for pos in range(m):
            kept.add(order[pos] if running < required else 0)
            running += slots[pos]
        out.append(sorted(j for j in kept if j <= c0 + r))
    return out


def rows_of(mask):
    """bool [M', M] -> kept ids per row."""
    return [row.nonzero().flatten().tolist() for row in mask]


def random_masses(m, seed):
    """float64 [1, 1, m, m]: random positive masses on and below the diagonal, none above."""
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(1, 1, m, m, generator=g, dtype=torch.float64) ** 3
    return mass.tril()


@pytest.mark.parametrize("tau", [0.3, 0.6, 0.9, 0.97])
def test_first_chunk_matches_upstream_steps_and_later_chunks_are_the_rule(tau):
    m, chunk = 12, 4
    mass = random_masses(m, seed=int(100 * tau))
    v = mass[0, 0].tolist()
    first = upstream_first_chunk_keep(mass, tau, chunk)[0, 0]
    assert rows_of(first) == upstream_chunk(v[:chunk], 0, tau)
    rule = cumulative_keep(mass, tau)[0, 0]
    for c0 in range(chunk, m, chunk):  # later chunks: upstream's steps give the intended rule
        assert rows_of(rule[c0 : c0 + chunk]) == upstream_chunk(v[c0 : c0 + chunk], c0, tau)
    # upstream's first-chunk rows keep a superset of the rule's, here with more in some row
    assert not (rule[:chunk] & ~first).any() and (first & ~rule[:chunk]).any()


def test_first_chunk_lags_by_one_block():
    # query block 3 of the first chunk; dyadic masses, so every sum is exact, tau 0.7
    mass = torch.zeros(1, 1, 4, 4)
    mass[0, 0, 3] = torch.tensor([0.25, 0.375, 0.125, 0.25])
    # the rule: block 0 and the diagonal first (0.5), then block 1 (0.5 < 0.7, kept) and block 2
    # (0.875, not kept)
    assert cumulative_keep(mass, 0.7)[0, 0, 3].nonzero().flatten().tolist() == [0, 1, 3]
    # upstream: block 1 on nothing, block 0 on the diagonal alone (0.25), block 2 on the diagonal
    # and block 1 (0.625 < 0.7): kept
    got = upstream_first_chunk_keep(mass, 0.7, 4)[0, 0, 3].nonzero().flatten().tolist()
    assert got == [0, 1, 2, 3] == upstream_chunk(mass[0, 0].tolist(), 0, 0.7)[3]
    assert upstream_first_chunk_keep(mass, 0.0, 4)[0, 0].sum(-1).tolist() == [1, 2, 2, 2]


@pytest.mark.parametrize(
    "n,tokens",
    [(1, 2048), (1000, 2048), (4096, 4096), (16384, 16384), (20000, 8192), (131072, 2048)],
)
def test_upstream_chunk_size(n, tokens):
    assert upstream_chunk_tokens(n) == tokens
    assert upstream_chunk_tokens(4 * 131072) == 2048


def test_upstream_first_chunk_option_changes_the_first_chunk_only():
    n, bs = 20000, 128  # upstream's chunk: 8192 tokens = 64 of the 157 query blocks
    q, k = structured_qk(1, 2, 1, n, 16, seed=11)
    default = methods.build("xattn")
    upstream = methods.build("xattn", upstream_first_chunk=True)
    mass = antidiagonal_mass_ref(q, k, bs, 16)
    rule = cumulative_keep(mass, 0.9)
    off, on = default.select(q, k).mask(), upstream.select(q, k).mask()
    assert torch.equal(off, rule)  # the default is the rule, unchanged
    chunk = upstream_chunk_tokens(n) // bs
    assert chunk == 64 and off.shape[-1] == 157
    assert torch.equal(on[..., chunk:, :], off[..., chunk:, :])  # later chunks: the same blocks
    extra = on[..., :chunk, :] & ~off[..., :chunk, :]
    assert not (off & ~on).any()  # the first chunk only gains blocks ...
    assert extra.sum() >= chunk and extra.any(-1).any(-1).all()  # ... here many, in both heads
    for h in range(2):  # and exactly the ones upstream's steps keep
        want = upstream_chunk(mass[0, h, :chunk].double().tolist(), 0, 0.9)
        assert rows_of(on[0, h, :chunk]) == want
    assert "upstream_first_chunk" not in default.fields()
    assert upstream.fields()["upstream_first_chunk"] is True
    with pytest.raises(ValueError, match="PyTorch path only"):
        methods.build("xattn", upstream_first_chunk=True, impl="triton")
    with pytest.raises(ValueError, match="true or false"):
        methods.build("xattn", upstream_first_chunk=1)
