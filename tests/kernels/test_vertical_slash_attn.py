"""The vertical-slash reference against dense SDPA with the pattern expanded to a token mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rbs_bench.kernels.vertical_slash_attn import (
    full_diagonal_blocks,
    membership,
    vertical_slash_attention_flex,
    vertical_slash_attention_ref,
    vertical_slash_block_mask,
    vertical_slash_estimate,
    vertical_slash_token_mask,
)

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
    vertical, slash = vertical_slash_estimate(q, k, last_q, scale=0.4)
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
