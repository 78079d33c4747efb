"""MInference vertical-slash: forced lines, sizes, touched-block density, its executor, registry."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import structured_qk
from rbs_bench.baselines.minference import MInference, VerticalSlashPattern
from rbs_bench.kernels.vertical_slash_attn import vertical_slash_attention_ref

from rbs_bench import methods
from rbs_bench.execution import execute


def rotary_qk(n, d, offset, column):
    """q/k [1, 1, n, d] whose last queries favour key `column` and the diagonal `offset` and give
    the first 30 keys and the 100 nearest diagonals little mass: the estimate alone would pick
    none of the forced lines. Logits at scale 1: a rotation in dims 0-1 peaking at `offset`
    (1e4 cos(w (o - offset)), one peak over the prompt), 1e4 for `column` via dim 2, and a small
    random background in the other dims."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.zeros(1, 1, n, d), torch.zeros(1, 1, n, d)
    q[..., 3:] = 0.1 * torch.randn(1, 1, n, d - 3, generator=gen)
    k[..., 3:] = 0.1 * torch.randn(1, 1, n, d - 3, generator=gen)
    pos, w, amp = torch.arange(n, dtype=torch.float32), 2 * math.pi / (1.1 * n), 100.0
    q[0, 0, :, 0], q[0, 0, :, 1] = amp * torch.cos(w * pos), amp * torch.sin(w * pos)
    k[0, 0, :, 0] = amp * torch.cos(w * (pos + offset))
    k[0, 0, :, 1] = amp * torch.sin(w * (pos + offset))
    q[0, 0, :, 2], k[0, 0, column, :3] = amp, torch.tensor([0.0, 0.0, amp])
    return q, k


def test_forced_sinks_and_local_diagonals_even_when_not_estimated():
    n, d = 1000, 16
    q, k = rotary_qk(n, d, offset=500, column=700)
    free = MInference(vertical_size=31, slash_size=101, sink_tokens=0, local_diagonals=0)
    pat = free.select(q, k, scale=1.0)
    cols, diags = set(pat.columns[0, 0].tolist()), set(pat.diagonals[0, 0].tolist())
    assert 700 in cols and 500 in diags
    assert not cols & set(range(30)) and not diags & set(range(100))  # estimate picks neither

    pat = MInference(vertical_size=31, slash_size=101).select(q, k, scale=1.0)
    assert pat.columns[0, 0].tolist() == [*range(30), 700]
    assert pat.diagonals[0, 0].tolist() == [*range(100), 500]
    only_forced = MInference(ratio=0.0).select(q, k, scale=1.0)  # sizes floor at the forced
    assert only_forced.columns[0, 0].tolist() == list(range(30))
    assert only_forced.diagonals[0, 0].tolist() == list(range(100))


@pytest.mark.parametrize(
    "fields,n,want",
    [
        ({}, 100_000, (1000, 6096)),
        ({}, 2048, (1000, 2048)),
        ({}, 20, (20, 20)),
        ({"ratio": 0.5}, 100_000, (500, 3048)),
        ({"ratio": 0.01}, 100_000, (30, 100)),  # floors: the forced lines
        ({"ratio": 0.1}, 100_000, (100, 610)),  # round(609.6); upstream's int() gives 609
        (  # 100 * 0.29 = 28.999999999999996: round() gives 29, upstream's int() 28
            {
                "vertical_size": 100,
                "slash_size": 100,
                "ratio": 0.29,
                "sink_tokens": 0,
                "local_diagonals": 0,
            },
            1000,
            (29, 29),
        ),
        (
            {"vertical_size": 10, "slash_size": 60, "sink_tokens": 4, "local_diagonals": 8},
            99,
            (10, 60),
        ),
    ],
)
def test_sizes(fields, n, want):
    assert MInference(**fields).sizes(n) == want


def test_density_counts_touched_128_block_pairs():
    # N = 300: query/key blocks 0..2, 6 causal pairs; one head per hand-built case
    cols = torch.tensor([[[5], [-1], [-1], [299], [130]]], dtype=torch.int32)
    diags = torch.tensor([[[0], [128], [200], [-1], [-1]]], dtype=torch.int32)
    pat = VerticalSlashPattern(cols, diags, 300)
    assert pat.causal_pairs() == 6
    want = torch.tensor([[5, 2, 2, 1, 2]], dtype=torch.float64) / 6
    torch.testing.assert_close(pat.head_density(), want)
    assert pat.density() == pytest.approx(12 / 30)
    assert pat.mask()[0, 1].nonzero().tolist() == [[1, 0], [2, 1]]


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("b,hq,hkv", [(2, 2, 2), (1, 4, 1)])
def test_invariants_and_execution(n, b, hq, hkv):
    d = 16
    q, k = structured_qk(b, hq, hkv, n, d, seed=n, kind="sinks")
    v = torch.randn(b, hkv, n, d)
    sel = MInference(vertical_size=40, slash_size=60, sink_tokens=5, local_diagonals=10)
    pat = sel.select(q, k)
    nv, ns = sel.sizes(n)
    assert pat.columns.shape == (b, hq, nv) and pat.diagonals.shape == (b, hq, ns)
    assert pat.columns.dtype == pat.diagonals.dtype == torch.int32
    for ids in (pat.columns, pat.diagonals):
        assert (ids[..., 1:] > ids[..., :-1]).all() and ids.min() >= 0 and ids.max() < n
    assert pat.columns[..., : min(5, n)].tolist() == [[list(range(min(5, n)))] * hq] * b
    assert pat.diagonals[..., : min(10, n)].tolist() == [[list(range(min(10, n)))] * hq] * b
    tokens = pat.token_mask()
    assert not (tokens & ~torch.ones(n, n, dtype=torch.bool).tril()).any()  # no key after query
    assert tokens.diagonal(dim1=-2, dim2=-1).all()  # every query sees itself
    m = math.ceil(n / 128)
    assert pat.mask().shape == (b, hq, m, m)
    assert not (pat.mask() & ~torch.ones(m, m, dtype=torch.bool).tril()).any()
    assert pat.head_density().shape == (b, hq)
    out = execute(q, k, v, pat)  # a non-BlockSelection runs through pattern.attend
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=tokens, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_all_diagonals_run_as_dense_causal():
    q, k, v = torch.randn(1, 4, 300, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    pat = MInference().select(q, k)  # slash_size 6096 >= N: every diagonal
    assert pat.covers_every_diagonal() and pat.density() == 1.0
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(pat.attend(q, k, v), want, atol=1e-5, rtol=1e-5)
    ref = vertical_slash_attention_ref(q, k, v, pat.columns, pat.diagonals)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    assert not MInference(ratio=0.01).select(q, k).covers_every_diagonal()


def test_density_monotone_in_ratio():
    q, k = structured_qk(1, 2, 1, 3000, 16, seed=7, kind="sinks")
    base = MInference(vertical_size=200, slash_size=400)
    dens = [base.with_knob(r).select(q, k).density() for r in (0.0, 0.1, 0.3, 1.0, 3.0)]
    assert all(a <= b for a, b in zip(dens, dens[1:]))
    assert dens[0] < dens[-1]
    pats = [base.with_knob(r).select(q, k) for r in (0.1, 0.3)]
    small, large = (set(p.columns[0, 0].tolist()) for p in pats)
    assert small <= large  # nested: ties broken by position


def test_density_curve_is_each_ratios_own_selection_from_one_estimate(monkeypatch):
    """Calibration's curve: the density `select` measures at every ratio, the estimate made once."""
    from rbs_bench.baselines import minference

    q, k = structured_qk(1, 4, 2, 3000, 16, seed=3, kind="sinks")
    base = MInference(vertical_size=200, slash_size=400, impl="torch")
    ratios = [0.01, 0.05, 0.2, 0.5, 1.0, 4.0]
    want = [base.with_knob(r).select(q, k, scale=0.3).density() for r in ratios]
    calls = []
    real = minference.vertical_slash_estimate_ref
    monkeypatch.setattr(
        minference,
        "vertical_slash_estimate_ref",
        lambda *a: calls.append(1) or real(*a),
    )
    got = base.density_curve(q, k, 0.3, ratios)
    assert got.tolist() == want and len(calls) == 1
    assert got[0] < got[-1]


def test_gqa_uses_own_kv_head():
    q, k = structured_qk(1, 4, 2, 600, 16, seed=5, kind="sinks")
    sel = MInference(vertical_size=50, slash_size=80)
    a = sel.select(q, k)
    k2 = k.clone()
    k2[:, 0] = torch.randn_like(k2[:, 0])
    b = sel.select(q, k2)
    assert torch.equal(a.columns[:, 2:], b.columns[:, 2:])
    assert not torch.equal(a.columns[:, :2], b.columns[:, :2])


def test_attend_checks_length():
    pat = MInference().select(torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8))
    with pytest.raises(ValueError, match="seq_len=50"):
        pat.attend(*(torch.randn(1, 2, 40, 8) for _ in range(3)))
    with pytest.raises(ValueError, match="unknown executor 'cuda'; choose auto, reference, flex"):
        pat.attend(*(torch.randn(1, 2, 50, 8) for _ in range(3)), executor="cuda")


def test_benchmark_runs_the_named_executor():
    from rbs_bench.bench.attention import run_executor

    q, k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 1, 300, 16), torch.randn(1, 1, 300, 16)
    pat = MInference(vertical_size=20, slash_size=40).select(q, k)
    want = pat.attend(q, k, v, executor="reference")
    torch.testing.assert_close(run_executor(q, k, v, pat, "reference"), want)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            run_executor(q, k, v, pat, "flex")  # the pattern's own flex, not the block executor


def test_registry_and_knob():
    sel = methods.build("minference")
    assert sel == MInference() and (sel.vertical_size, sel.slash_size) == (1000, 6096)
    assert (sel.knob, sel.knob_direction, sel.is_dense) == ("ratio", 1, False)
    assert sel.last_q == 64 and sel.sink_tokens == 30 and sel.local_diagonals == 100
    assert sel.impl == "auto"  # Triton selector on CUDA, the PyTorch one elsewhere
    assert methods.build("minference", ratio=0.5).with_knob(2.0).ratio == 2.0
    assert sel.fields()["ratio"] == 1.0


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"ratio": -0.1}, "ratio must be"),
        ({"ratio": float("nan")}, "ratio must be"),
        ({"ratio": float("inf")}, "ratio must be"),
        ({"vertical_size": -1}, "vertical_size must be"),
        ({"slash_size": 2.5}, "slash_size must be"),
        ({"last_q": 0}, "last_q must be"),
        ({"sink_tokens": True}, "sink_tokens must be"),
        ({"local_diagonals": -3}, "local_diagonals must be"),
        ({"ratios": 1.0}, "no field 'ratios'"),
        ({"impl": "cuda"}, "impl must be one of auto, torch, triton"),
    ],
)
def test_bad_fields_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        methods.build("minference", **fields)
    with pytest.raises(ValueError, match="ratio must be"):
        MInference().with_knob(-1.0)


def test_pattern_mass_chunks_bound_their_workspace(monkeypatch):
    """The default chunk shrinks so that a chunk's fp32 rows fit PATTERN_MASS_WORKSPACE; the
    mass does not depend on the chunk."""
    from rbs_bench.baselines import minference

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 300, 16, generator=g) * 2, torch.randn(1, 2, 300, 16, generator=g)
    base = minference.MInference(
        vertical_size=40, slash_size=60, last_q=16, sink_tokens=3, local_diagonals=5
    )
    pats = [base.with_knob(r).select(q, k) for r in (0.2, 2.0)]
    whole = minference.pattern_mass(q, k, None, pats, chunk=512)
    chunks = []
    real = minference.causal_softmax_chunks

    def spy(q, k, scale, chunk, **kw):
        chunks.append(chunk)
        return real(q, k, scale, chunk, **kw)

    monkeypatch.setattr(minference, "causal_softmax_chunks", spy)
    monkeypatch.setattr(minference, "PATTERN_MASS_WORKSPACE", 5 * 4 * 4 * 300 * 7)  # 7 rows
    for got, want in zip(minference.pattern_mass(q, k, None, pats), whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert chunks == [7]
