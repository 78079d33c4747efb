"""Vertical-slash attention: the references against dense SDPA with the pattern expanded to a
token mask, and the Triton kernels (estimate, radix selection, executor) against the references.

Kernel tests (`test_triton_*`) run on CUDA, or on CPU under Triton's interpreter in a fresh
Python with TRITON_INTERPRET=1 (`test_interpreter_suite`), small shapes, fp32/fp16. The
`gpu`-marked tests take real sizes in bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import interpreter_suite
import pytest
import torch
import torch.nn.functional as F
from interpreter_suite import CUDA, DEVICE, kernel_test
from rbs_bench.kernels.triton_util import INTERPRET
from rbs_bench.kernels.vertical_slash_attn import (
    coverage_count,
    coverage_select,
    full_diagonal_blocks,
    membership,
    top_k_ids,
    top_k_ids_ref,
    top_mask,
    vertical_slash_attention,
    vertical_slash_attention_flex,
    vertical_slash_attention_ref,
    vertical_slash_block_mask,
    vertical_slash_estimate,
    vertical_slash_estimate_ref,
    vertical_slash_index,
    vertical_slash_token_mask,
)

from rbs_bench import methods

# (batch, q heads, kv heads, N, head dim)
SHAPES = [
    (1, 2, 2, 1, 16),
    (1, 4, 1, 127, 32),
    (2, 4, 4, 128, 16),
    (2, 4, 1, 129, 32),
    (1, 4, 2, 1000, 64),
]
SHAPE_IDS = [f"B{b}-H{hq}/{hkv}-N{n}-D{d}" for b, hq, hkv, n, d in SHAPES]


def random_pattern(b, h, n, nv, ns, gen, pad=True, local=True):
    """Unique random columns/diagonals per (b, h), in random order, ~20% of slots padded with -1.

    With `local` the diagonal 0 is kept (first slot), so every query sees at least itself.
    """
    nv, ns = min(nv, n), min(ns, n)
    cols = torch.stack([torch.randperm(n, generator=gen)[:nv] for _ in range(b * h)])
    diags = torch.stack([torch.randperm(n, generator=gen)[:ns] for _ in range(b * h)])
    if local:
        zero = torch.zeros(1, dtype=torch.long)
        diags = torch.stack([torch.cat([zero, r[r != 0]])[:ns] for r in diags])
    if pad:
        cols = torch.where(torch.rand(cols.shape, generator=gen) < 0.2, -1, cols)
        drop = torch.rand(diags.shape, generator=gen) < 0.2
        drop[:, 0] &= not local
        diags = torch.where(drop, -1, diags)
    return cols.view(b, h, -1).int(), diags.view(b, h, -1).int()


def dense_masked(q, k, v, columns, diagonals, scale=None):
    token_mask = vertical_slash_token_mask(columns, diagonals, q.shape[2])
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=token_mask, scale=scale, enable_gqa=True
    )
    return torch.where(token_mask.any(-1, keepdim=True), out, torch.zeros_like(out))


def make_inputs(shape, dtype=torch.float32, seed=0, nv=20, ns=30):
    b, hq, hkv, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    cols, diags = random_pattern(b, hq, n, nv, ns, gen)
    return q, k, v, cols, diags


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ref_matches_dense_fp32(shape):
    q, k, v, cols, diags = make_inputs(shape)
    out = vertical_slash_attention_ref(q, k, v, cols, diags)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, dense_masked(q, k, v, cols, diags), atol=1e-5, rtol=1e-5)


def test_ref_small_blocks_head_split_and_scale():
    q, k, v, cols, diags = make_inputs((2, 4, 2, 300, 16), seed=3, nv=7, ns=40)
    want = dense_masked(q, k, v, cols, diags, scale=0.3)
    for block, max_elements in ((128, 1 << 27), (32, 1), (48, 5000)):
        out = vertical_slash_attention_ref(
            q, k, v, cols, diags, scale=0.3, block=block, max_elements=max_elements
        )
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_ref_dense_pattern_is_causal_attention():
    n = 200
    q, k, v = (torch.randn(1, h, n, 32) for h in (4, 2, 2))
    cols = torch.arange(n)[None, None].expand(1, 4, -1).int()
    out = vertical_slash_attention_ref(q, k, v, cols, cols)  # every key twice: counted once
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        pytest.param(SHAPES[3], torch.float16, id=f"{SHAPE_IDS[3]}-fp16"),
        pytest.param(SHAPES[3], torch.bfloat16, id=f"{SHAPE_IDS[3]}-bf16"),
        pytest.param(SHAPES[4], torch.float16, id=f"{SHAPE_IDS[4]}-fp16"),
    ],
)
def test_ref_low_precision(shape, dtype):
    q, k, v, cols, diags = make_inputs(shape, dtype=dtype, seed=2)
    truth = dense_masked(q.float(), k.float(), v.float(), cols, diags)
    out = vertical_slash_attention_ref(q, k, v, cols, diags)
    assert out.dtype == dtype
    torch_lowp = dense_masked(q, k, v, cols, diags)
    err = (out.float() - truth).abs().max().item()
    torch_err = (torch_lowp.float() - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"ref err {err:.3e} vs torch {dtype} err {torch_err:.3e}"


def test_ref_rows_that_see_nothing_are_zero():
    q, k, v = (torch.randn(1, 1, 100, 8) for _ in range(3))
    cols = torch.tensor([[[60, -1]]], dtype=torch.int32)  # rows < 60 see no column
    diags = torch.tensor([[[50]]], dtype=torch.int32)  # and rows < 50 no diagonal
    out = vertical_slash_attention_ref(q, k, v, cols, diags)
    assert torch.count_nonzero(out[:, :, :50]) == 0
    torch.testing.assert_close(out, dense_masked(q, k, v, cols, diags), atol=1e-5, rtol=1e-5)


def test_token_mask_is_the_definition():
    n = 37
    cols = torch.tensor([[[3, 20, -1, 36]]])
    diags = torch.tensor([[[0, 5, -1]]])
    got = vertical_slash_token_mask(cols, diags, n)[0, 0]
    for p in range(n):
        want = {c for c in (3, 20, 36) if c <= p} | {p - d for d in (0, 5) if d <= p}
        assert set(torch.nonzero(got[p]).flatten().tolist()) == want


@pytest.mark.parametrize("n", [1, 127, 128, 129, 300, 1000])
@pytest.mark.parametrize("block_q,block_k", [(128, 128), (32, 32), (48, 20)])
def test_block_mask_is_the_pooled_token_mask(n, block_q, block_k):
    gen = torch.Generator().manual_seed(n + block_q)
    cols, diags = random_pattern(2, 3, n, 4, 5, gen, local=False)
    tokens = vertical_slash_token_mask(cols, diags, n)  # [B, H, N, N]
    mq, mk = math.ceil(n / block_q), math.ceil(n / block_k)
    padded = F.pad(tokens, (0, mk * block_k - n, 0, mq * block_q - n))
    pooled = padded.unflatten(2, (mq, block_q)).unflatten(4, (mk, block_k)).any(5).any(3)
    assert torch.equal(vertical_slash_block_mask(cols, diags, n, block_q, block_k), pooled)


def test_block_mask_hand_cases():
    # N = 300, blocks of 128: query blocks 0..2; causal pairs (0,0) (1,0) (1,1) (2,0) (2,1) (2,2)
    def blocks(cols, diags):
        m = vertical_slash_block_mask(torch.tensor([[cols]]), torch.tensor([[diags]]), 300)
        return {tuple(x) for x in torch.nonzero(m[0, 0]).tolist()}

    assert blocks([5], [0]) == {(0, 0), (1, 1), (2, 2), (1, 0), (2, 0)}
    assert blocks([-1], [128]) == {(1, 0), (2, 1)}  # q 128..255 -> k 0..127; q 256.. -> k 128..
    assert blocks([-1], [200]) == {(1, 0), (2, 0)}  # q 200..299 -> k 0..99, split at q 256
    assert blocks([299], [-1]) == {(2, 2)}  # only query 299 sees key 299
    assert blocks([130], [-1]) == {(1, 1), (2, 1)}


@pytest.mark.parametrize("shape", [(1, 4, 1, 50, 16), (2, 4, 2, 130, 8)])
@pytest.mark.parametrize("last_q", [1, 16, 64])
def test_estimate_against_loops(shape, last_q):
    b, hq, hkv, n, d = shape
    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(b, hq, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    vertical, slash = vertical_slash_estimate_ref(q, k, last_q, scale=0.4)
    big_l = min(last_q, n)
    kr = k.repeat_interleave(hq // hkv, 1).double()  # test-side only
    want_v = torch.zeros(b, hq, n, dtype=torch.float64)
    want_s = torch.zeros_like(want_v)
    for p in range(n - big_l, n):
        a = torch.softmax(
            torch.einsum("bhd,bhtd->bht", q[:, :, p].double(), kr[:, :, : p + 1]) * 0.4, -1
        )
        want_v[:, :, : p + 1] += a
        want_s[:, :, : p + 1] += a.flip(-1)  # key t sits on offset p - t
    torch.testing.assert_close(vertical.double(), want_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slash.double(), want_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,block", [(300, 32), (1000, 128), (129, 64)])
def test_full_diagonal_blocks_are_fully_attended(n, block):
    gen = torch.Generator().manual_seed(n)
    cols = torch.full((1, 3, 1), -1)
    w = min(2 * block + 7, n - 3)  # head 0: a run from 0, head 1: a run from 3, head 2: random
    runs = [torch.arange(w), torch.arange(3, w + 3), torch.randperm(n, generator=gen)[:w]]
    diags = torch.stack(runs)[None]
    full = full_diagonal_blocks(membership(diags, n), n, block)
    tokens = vertical_slash_token_mask(cols, diags, n)
    m = math.ceil(n / block)
    padded = F.pad(tokens, (0, m * block - n, 0, m * block - n))
    pairs = padded.unflatten(2, (m, block)).unflatten(4, (m, block))  # [B, H, M, b, M, b]
    pos = torch.arange(m * block)
    causal = (pos[:, None] >= pos[None, :]) & (pos[:, None] < n)
    causal = causal.unflatten(0, (m, block)).unflatten(2, (m, block))  # [M, b, M, b]
    everything = (pairs | ~causal).all(3).all(4)  # every causal (q, k) of the pair attended
    below = torch.ones(m, m, dtype=torch.bool).tril(-1)
    assert torch.equal(full, everything & below)
    assert full[0, 0].any()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "columns": a["columns"].float()}, "integer tensor"),
        (lambda a: {**a, "columns": a["columns"][0]}, "integer tensor"),
        (lambda a: {**a, "diagonals": a["diagonals"][:, :2]}, r"diagonals must be \[B, H"),
        (lambda a: {**a, "columns": torch.full_like(a["columns"], 100)}, "past seq_len"),
        (lambda a: {**a, "diagonals": torch.zeros_like(a["diagonals"])}, "repeats an id"),
        (lambda a: {**a, "k": a["k"][:, :, :-1]}, "k and v must be"),
        (
            lambda a: {
                **a,
                "k": a["k"][:, :1].expand(-1, 3, -1, -1),
                "v": a["v"][:, :1].expand(-1, 3, -1, -1),
            },
            "multiple of kv",
        ),
    ],
)
def test_ref_rejects_bad_inputs(change, message):
    q, k, v, cols, diags = make_inputs((1, 4, 2, 100, 16))
    args = dict(q=q, k=k, v=v, columns=cols, diagonals=diags)
    with pytest.raises(ValueError, match=message):
        vertical_slash_attention_ref(**change(args))


def test_flex_refuses_cpu():
    q, k, v, cols, diags = make_inputs((1, 2, 2, 64, 16))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        vertical_slash_attention_flex(q, k, v, cols, diags)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1000, 64), (2, 4, 1, 4097, 128)])
@pytest.mark.parametrize("band", [False, True])
def test_flex_matches_dense(shape, dtype, band):
    q, k, v, cols, diags = make_inputs(shape, dtype=dtype, seed=4, nv=60, ns=90)
    if band:  # a run of 400 diagonals: many block pairs are full and skip the mask
        b, h = diags.shape[:2]
        diags = torch.arange(400, dtype=torch.int32).expand(b, h, -1).contiguous()
    q, k, v, cols, diags = (t.cuda() for t in (q, k, v, cols, diags))
    truth = dense_masked(q.float(), k.float(), v.float(), cols, diags)
    out = vertical_slash_attention_flex(q, k, v, cols, diags)
    assert out.dtype == dtype and out.shape == q.shape
    ref = vertical_slash_attention_ref(q, k, v, cols, diags)
    err = (out.float() - truth).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-4, err
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch_err = (dense_masked(q, k, v, cols, diags).float() - truth).abs().max().item()
        assert err <= 2 * torch_err + 1e-5, f"flex err {err:.3e} vs torch err {torch_err:.3e}"


# ------------------------------------------------------------- index of the Triton executor


def test_index_groups_and_visible_columns():
    cols = torch.tensor([[[5, 130, -1, 64]]], dtype=torch.int32)
    diags = torch.tensor([[[250, 0, 70, 2, -1, 1, 200]]], dtype=torch.int32)
    on_diag, lo, hi, count, sorted_cols, seen = vertical_slash_index(cols, diags, 300, 64)
    assert set(torch.nonzero(on_diag[0, 0]).flatten().tolist()) == {0, 1, 2, 70, 200, 250}
    # gaps <= 64 merge: {0, 1, 2}, {70} (68 after 2), {200, 250} (50 apart)
    assert count.tolist() == [[3]]
    assert lo[0, 0, :3].tolist() == [0, 70, 200] and hi[0, 0, :3].tolist() == [2, 70, 250]
    assert sorted_cols.tolist() == [[[5, 64, 130, 300]]]
    # query blocks end at 63, 127, 191, 255, 299
    assert seen.tolist() == [[[1, 2, 3, 3, 3]]]


@pytest.mark.parametrize("n,block", [(300, 64), (129, 16), (1000, 64)])
def test_index_ranges_cover_each_diagonal_key_once(n, block):
    gen = torch.Generator().manual_seed(n)
    _, diags = random_pattern(1, 2, n, 1, 40, gen, local=False)
    diags[0, 1, :10] = torch.arange(n // 3, n // 3 + 10)  # a run of diagonals: one range
    _, lo, hi, count, _, _ = vertical_slash_index(torch.zeros(1, 2, 1).int() - 1, diags, n, block)
    for h in range(2):
        kept = {d for d in diags[0, h].tolist() if d >= 0}
        for i in range(math.ceil(n / block)):
            q0, q_last = i * block, min(n, (i + 1) * block) - 1
            ranges = []
            for g in range(int(count[0, h])):
                start, end = max(q0 - int(hi[0, h, g]), 0), q_last - int(lo[0, h, g])
                if end >= start:
                    ranges.append(range(start, end + 1))
            keys = [t for r in ranges for t in r]
            assert len(keys) == len(set(keys)), "two ranges overlap"
            wanted = {q - d for q in range(q0, q_last + 1) for d in kept if d <= q}
            assert wanted <= set(keys)


# -------------------------------------------------------------------- Triton kernels


ESTIMATE_CASES = [  # (B, Hq, Hkv, N, D, last_q, dtype, splits)
    (1, 2, 1, 300, 16, 64, torch.float32, 3),
    (1, 4, 2, 129, 32, 16, torch.float16, None),
    (1, 1, 1, 1, 16, 64, torch.float32, None),
    (1, 2, 2, 200, 128, 128, torch.float32, 2),
]


@kernel_test
@pytest.mark.parametrize(
    "case",
    ESTIMATE_CASES,
    ids=[f"B{c[0]}-H{c[1]}/{c[2]}-N{c[3]}-D{c[4]}-L{c[5]}" for c in ESTIMATE_CASES],
)
def test_triton_estimate_matches_ref(case):
    from rbs_bench.kernels.vertical_slash_attn import _estimate

    b, hq, hkv, n, d, last_q, dtype, splits = case
    gen = torch.Generator().manual_seed(n + d)
    q = torch.randn(b, hq, n, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(DEVICE, dtype)
    k[:, :, :3] += 2.0  # sink-like keys: uneven columns
    got = _estimate(q, k, last_q, 0.3, splits=splits)
    want_v, want_s = vertical_slash_estimate_ref(q.float(), k.float(), last_q, scale=0.3)
    torch.testing.assert_close(got[0], want_v, atol=2e-6 * min(last_q, n), rtol=1e-5)
    torch.testing.assert_close(got[1], want_s, atol=2e-6 * min(last_q, n), rtol=1e-5)
    v2, s2 = vertical_slash_estimate(q, k, last_q, 0.3)
    assert torch.equal(v2, got[0]) and torch.equal(s2, got[1])  # the slash sums too (atomics)


def _reference_margin(values, target):
    """Distance of each row's running sum at its counted entry from the target (rows sorted)."""
    cum = values.double().sort(-1, descending=True).values.cumsum(-1)
    count = coverage_count(values, target)
    at = cum.gather(-1, (count - 1)[:, None])[:, 0]
    before = torch.where(count > 1, cum.gather(-1, (count - 2).clamp(min=0)[:, None])[:, 0], 0.0)
    return torch.minimum((at - target).abs(), (before - target).abs())


@kernel_test
def test_triton_coverage_matches_ref():
    gen = torch.Generator().manual_seed(3)
    vals = torch.rand(4, 300, generator=gen) ** 4
    vals[1, :] = 0.01 * torch.rand(300, generator=gen)
    vals[1, 50:90] = 0.02  # 40 tied entries: the boundary falls inside them
    vals[3, ::3] = 0.0  # zeros are never counted before the positive entries
    above = float(vals[1][vals[1] > 0.02].double().sum())
    target = torch.tensor([0.0, above + 0.02 * 17.5, 1e9, 0.5 * float(vals[3].sum())])
    count, mask = coverage_select(vals.to(DEVICE), target, want_mask=True, block=64, chunk_len=128)
    want = coverage_count(vals, target.clamp(min=1e-38))
    assert (_reference_margin(vals, target)[[1, 3]] > 1e-6).all()  # no row sits on rounding
    assert count.cpu().tolist() == want.tolist()
    assert want[0] == 1 and want[2] == 300  # target 0: the largest; unreachable: every entry
    mask1 = top_mask(vals, want)
    assert torch.equal(mask.cpu(), mask1)
    tied = mask1[1, 50:90]
    assert tied.tolist() == [True] * 18 + [False] * 22  # ties kept in index order


@kernel_test
def test_triton_top_k_ids_matches_ref():
    gen = torch.Generator().manual_seed(4)
    vals = torch.rand(3, 300, generator=gen)
    vals[:, :7] = float("inf")  # forced entries
    vals[1, 100:160] = 0.999  # ties across the boundary: lower ids first
    vals[2, 200:] = 0.0
    got = top_k_ids(vals.to(DEVICE), 37, block=64, chunk_len=128)
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu(), top_k_ids_ref(vals, 37))


ATTN_CASES = [  # (B, Hq, Hkv, N, D, dtype, columns, diagonals, kind)
    ((1, 2, 1, 300, 16), torch.float32, 10, 30, "random"),
    ((1, 4, 2, 129, 64), torch.float16, 20, 30, "random"),
    ((1, 8, 1, 100, 16), torch.float32, 12, 1, "band"),
    ((2, 2, 2, 1, 16), torch.float32, 4, 4, "random"),
    ((1, 2, 2, 200, 128), torch.float32, 6, 20, "no-local"),
]


@kernel_test
@pytest.mark.parametrize(
    "case",
    ATTN_CASES,
    ids=[f"{'x'.join(map(str, c[0]))}-{str(c[1])[6:]}-{c[4]}" for c in ATTN_CASES],
)
def test_triton_attention_matches_dense(case):
    shape, dtype, nv, ns, kind = case
    q, k, v, cols, diags = make_inputs(shape, dtype=dtype, seed=5, nv=nv, ns=ns)
    if kind == "band":  # a run of 40 diagonals (one range) and columns inside it (no double count)
        b, h = cols.shape[:2]
        diags = torch.arange(40, dtype=torch.int32).expand(b, h, -1).contiguous()
        ids = torch.tensor([0, 50, 60, 99, 5, 39, 40, 41, 70, -1, 80, 90], dtype=torch.int32)
        cols = ids.expand(b, h, -1).contiguous()
    if kind == "no-local":  # rows that see nothing get 0
        gen = torch.Generator().manual_seed(1)
        diags = torch.stack([torch.randperm(150, generator=gen)[:ns] + 50 for _ in range(2)])
        diags = diags[None].int()
    args = [t.to(DEVICE) for t in (q, k, v, cols, diags)]
    out = vertical_slash_attention(*args, scale=0.2)
    assert out.dtype == dtype and out.shape == q.shape
    truth = dense_masked(q.float(), k.float(), v.float(), cols, diags, scale=0.2)
    err = (out.float().cpu() - truth).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:
        torch_err = (dense_masked(q, k, v, cols, diags, scale=0.2).float() - truth).abs().max()
        assert err <= 2 * torch_err.item() + 1e-5, f"kernel err {err:.3e} vs torch {torch_err:.3e}"


@kernel_test
def test_triton_minference_density_curve_is_each_ratios_selection():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 300, 16, generator=gen).to(DEVICE)
    k = torch.randn(1, 1, 300, 16, generator=gen).to(DEVICE)
    sel = methods.build(
        "minference", impl="triton", vertical_size=20, slash_size=40, sink_tokens=4,
        local_diagonals=8,
    )  # fmt: skip
    ratios = [0.1, 0.5, 1.0, 2.0, 5.0]
    want = [sel.with_knob(r).select(q, k).density() for r in ratios]
    assert sel.density_curve(q, k, None, ratios).tolist() == want


@kernel_test
def test_triton_minference_impls_agree():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 200, 16, generator=gen).to(DEVICE)
    k = torch.randn(1, 1, 200, 16, generator=gen).to(DEVICE)
    k[:, :, 150] += 4.0 * q[:, :1, 199]  # a column the last query looks at
    fields = {"vertical_size": 20, "slash_size": 40, "sink_tokens": 4, "local_diagonals": 8}
    got = methods.build("minference", impl="triton", **fields).select(q, k)
    want = methods.build("minference", impl="torch", **fields).select(q, k)
    assert torch.equal(got.columns, want.columns) and torch.equal(got.diagonals, want.diagonals)
    assert 150 in got.columns[0, 0].tolist()
    v = torch.randn(1, 1, 200, 16, generator=gen).to(DEVICE)
    torch.testing.assert_close(
        got.attend(q, k, v, executor="triton"),
        got.attend(q, k, v, executor="reference"),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.skipif(INTERPRET or CUDA, reason="checks the CPU error without the interpreter")
def test_cpu_without_interpreter_refuses_kernels():
    q, k, v, cols, diags = make_inputs((1, 2, 2, 64, 16))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        vertical_slash_attention(q, k, v, cols, diags)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        vertical_slash_estimate(q, k, 16)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        methods.build("minference", impl="triton").select(q, k)


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-m", "not gpu", "-k", "test_triton_", at_least=12)


# ------------------------------------------------------------------------ GPU, bf16, large


def _synthetic(n, hq=8, hkv=2, d=128, seed=1):
    from rbs_bench import synthetic

    data = synthetic.generate(1, hq, hkv, n, d, seed=seed, device="cuda", dtype=torch.bfloat16)
    return data.q, data.k, data.v


gpu_test = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu_test
@pytest.mark.parametrize("last_q", [64, 128])
def test_gpu_estimate_bf16(last_q):
    q, k, _ = _synthetic(16384)
    got_v, got_s = vertical_slash_estimate(q, k, last_q)
    want_v, want_s = vertical_slash_estimate_ref(q, k, last_q)
    torch.testing.assert_close(got_v, want_v, atol=1e-4 * last_q, rtol=1e-3)
    torch.testing.assert_close(got_s, want_s, atol=1e-4 * last_q, rtol=1e-3)
    again_v, again_s = vertical_slash_estimate(q, k, last_q)
    assert torch.equal(again_v, got_v) and torch.equal(again_s, got_s)  # deterministic


@pytest.mark.gpu
@gpu_test
def test_gpu_radix_select_large_rows():
    gen = torch.Generator(device="cuda").manual_seed(0)
    vals = torch.rand(8, 1 << 20, generator=gen, device="cuda") ** 8
    vals[1, 1000:3000] = vals[1, 5000]  # a run of ties
    target = torch.linspace(0.1, 0.95, 8, device="cuda") * vals.double().sum(-1).float()
    count, mask = coverage_select(vals, target, want_mask=True)
    want = coverage_count(vals, target)
    near = _reference_margin(vals, target) < 1e-4 * target
    assert ((count.long() - want).abs() <= near.long()).all(), (count, want)
    ok = ~near
    assert torch.equal(mask[ok], top_mask(vals[ok], want[ok]))
    ids = top_k_ids(vals, 5000)
    assert torch.equal(ids, top_k_ids_ref(vals, 5000))


@pytest.mark.gpu
@gpu_test
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_attention_matches_dense_bf16(d):
    shape = (2, 4, 1, 4097, d)
    q, k, v, cols, diags = make_inputs(shape, dtype=torch.bfloat16, seed=4, nv=60, ns=90)
    q, k, v, cols, diags = (t.cuda() for t in (q, k, v, cols, diags))
    truth = dense_masked(q.float(), k.float(), v.float(), cols, diags)
    out = vertical_slash_attention(q, k, v, cols, diags)
    err = (out.float() - truth).abs().max().item()
    torch_err = (dense_masked(q, k, v, cols, diags).float() - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"triton err {err:.3e} vs torch err {torch_err:.3e}"


def _differ_only_at_boundary(got, want, mass, forced, n, eps=1e-3):
    """Ids kept by one selection and not the other have an estimate within eps (relative) of the
    reference's boundary value (its smallest kept estimate outside the forced ids)."""
    differ = membership(got, n) ^ membership(want, n)  # [B, H, N]
    kept = torch.zeros_like(mass).scatter_(-1, want.long(), 1.0).bool()
    kept[..., :forced] = False
    boundary = mass.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
    far = (mass - boundary).abs() > eps * boundary
    assert not (differ & far).any(), f"{int((differ & far).sum())} ids differ off the boundary"
    assert differ.sum() <= 0.001 * want.numel() + 2


@pytest.mark.gpu
@gpu_test
def test_gpu_minference_pattern_at_32k_bf16():
    # Earlier GPU tests fill torch.compile's caches; past its limit flex_attention falls back to
    # the unfused eager path, which materialises 64 GiB of scores at this size.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    n = 32768
    q, k, v = _synthetic(n)
    sel = methods.build("minference", ratio=0.1)
    pat = sel.select(q, k)  # auto: the Triton selector
    ref = dataclasses.replace(sel, impl="torch").select(q, k)
    vert, slash = vertical_slash_estimate_ref(q, k, sel.last_q)
    _differ_only_at_boundary(pat.columns, ref.columns, vert, sel.sink_tokens, n)
    _differ_only_at_boundary(pat.diagonals, ref.diagonals, slash, sel.local_diagonals, n)
    truth = vertical_slash_attention_ref(
        q.float(), k.float(), v.float(), pat.columns, pat.diagonals
    )
    out = pat.attend(q, k, v, executor="triton")
    flex = pat.attend(q, k, v, executor="flex")
    # The tolerance: the bf16 reference's own error (flex's too, which can be far smaller when
    # it falls back to its unfused eager path after other tests used up compile slots).
    ref_bf16 = vertical_slash_attention_ref(q, k, v, pat.columns, pat.diagonals)
    ref_err = (ref_bf16.float() - truth).abs().max().item()
    err = (out.float() - truth).abs().max().item()
    flex_err = (flex.float() - truth).abs().max().item()
    tol = 2 * max(ref_err, flex_err) + 1e-3
    assert err <= tol, f"triton err {err:.3e} vs bf16 reference {ref_err:.3e}, flex {flex_err:.3e}"
