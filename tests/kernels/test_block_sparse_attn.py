"""The block-sparse reference against dense SDPA with the block mask expanded to tokens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rbs_bench.kernels.block_sparse_attn import (
    block_geometry,
    block_lists_from_mask,
    block_mask_from_lists,
    block_sparse_attention_ref,
    expand_block_mask,
)

# (batch, q heads, kv heads, N, head dim, block_q, block_k)
SHAPES = [
    (1, 2, 2, 1, 64, 64, 64),
    (1, 4, 1, 127, 64, 64, 64),
    (1, 4, 1, 128, 128, 128, 128),
    (2, 4, 4, 129, 64, 64, 64),
    (1, 8, 2, 1000, 64, 128, 128),
    (1, 8, 1, 1025, 128, 64, 64),
    (1, 4, 2, 1000, 64, 64, 128),
    (1, 2, 1, 1025, 64, 128, 64),
]
SHAPE_IDS = [f"B{b}-H{hq}/{hkv}-N{n}-D{d}-bq{bq}-bk{bk}" for b, hq, hkv, n, d, bq, bk in SHAPES]


def some_shapes(*which: int):
    return [pytest.param(SHAPES[i], id=SHAPE_IDS[i]) for i in which]


def make_inputs(shape, density: str, dtype=torch.float32, seed: int = 0):
    """Random q/k/v and a block mask [B, Hq, Mq, Mk] with lists whose padding is junk."""
    b, hq, hkv, n, d, bq, bk = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    mq, mk = math.ceil(n / bq), math.ceil(n / bk)
    if density == "zero":
        mask = torch.zeros(b, hq, mq, mk, dtype=torch.bool)
    elif density == "full":
        mask = torch.ones(b, hq, mq, mk, dtype=torch.bool)
    else:  # kept blocks above the diagonal are left in: the kernel must mask them causally
        mask = torch.rand(b, hq, mq, mk, generator=gen) < 0.5
    count, indices = block_lists_from_mask(mask)
    junk = torch.randint(0, mk, indices.shape, generator=gen, dtype=torch.int32)
    padded = torch.arange(mk) >= count[..., None]
    indices = torch.where(padded, junk, indices)
    return q, k, v, mask, count, indices


def dense_masked(q, k, v, mask, bq, bk, scale=None):
    """Dense SDPA on the expanded token mask; rows that see no key are 0."""
    token_mask = expand_block_mask(mask, bq, bk, q.shape[2])  # [B, Hq, N, N]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=token_mask, scale=scale, enable_gqa=True
    )
    return torch.where(token_mask.any(-1, keepdim=True), out, torch.zeros_like(out))


@pytest.mark.parametrize("density", ["zero", "random", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_ref_matches_dense_fp32(shape, density):
    *_, bq, bk = shape
    q, k, v, mask, count, indices = make_inputs(shape, density)
    out = block_sparse_attention_ref(q, k, v, count, indices, bq, bk)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = dense_masked(q, k, v, mask, bq, bk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if density == "zero":
        assert torch.count_nonzero(out) == 0
    if density == "full":
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, causal, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("density", ["zero", "random", "full"])
@pytest.mark.parametrize("shape", some_shapes(0, 3, 4, 6))
def test_ref_lse(shape, density):
    b, hq, hkv, n, d, bq, bk = shape
    q, k, v, mask, count, indices = make_inputs(shape, density, seed=1)
    scale = 0.3
    out, lse = block_sparse_attention_ref(
        q, k, v, count, indices, bq, bk, scale=scale, return_lse=True
    )
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, n)
    k_rep = k.repeat_interleave(hq // hkv, dim=1)  # test-side only
    scores = torch.einsum("bhtd,bhsd->bhts", q, k_rep) * scale
    token_mask = expand_block_mask(mask, bq, bk, n)
    expected = scores.masked_fill(~token_mask, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, expected, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(out).any()
    expected_out = dense_masked(q, k, v, mask, bq, bk, scale)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", some_shapes(2, 4, 5, 7))
def test_ref_low_precision(shape, dtype):
    *_, bq, bk = shape
    q, k, v, mask, count, indices = make_inputs(shape, "random", dtype=dtype, seed=2)
    truth = dense_masked(q.float(), k.float(), v.float(), mask, bq, bk)
    out = block_sparse_attention_ref(q, k, v, count, indices, bq, bk)
    assert out.dtype == dtype
    torch_lowp = dense_masked(q, k, v, mask, bq, bk)
    err = (out.float() - truth).abs().max().item()
    torch_err = (torch_lowp.float() - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel err {err:.3e} vs torch {dtype} err {torch_err:.3e}"


@pytest.mark.parametrize("chunk_elements", [1, 64 * 64 * 8, 1 << 30])
@pytest.mark.parametrize("shape", some_shapes(4, 5, 6))
def test_ref_runs_of_query_blocks(shape, chunk_elements):
    # One query block per run, runs of a few blocks with different counts, and every block in
    # one run give the same rows; query blocks that keep nothing sit between kept ones.
    b, hq, hkv, n, d, bq, bk = shape
    q, k, v, mask, _, _ = make_inputs(shape, "random", seed=3)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's [B, N, H, D] buffer, as a view
    mask[:, :, 1::3] = False
    count, indices = block_lists_from_mask(mask)
    out, lse = block_sparse_attention_ref(
        q, k, v, count, indices, bq, bk, return_lse=True, chunk_elements=chunk_elements
    )
    torch.testing.assert_close(out, dense_masked(q, k, v, mask, bq, bk), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous() and lse.is_contiguous()
    assert torch.isneginf(lse[:, :, bq : 2 * bq]).all()


def test_ref_empty_rows_inside_a_kept_block():
    # Query block 1 keeps only key block 1 of 2 at N=100 with blocks of 64: rows 64..99 see
    # keys 64..row. Query block 0 keeps only key block 1: every row there sees nothing.
    q, k, v = (torch.randn(1, 1, 100, 16) for _ in range(3))
    mask = torch.tensor([[[[False, True], [False, True]]]])
    count, indices = block_lists_from_mask(mask)
    out, lse = block_sparse_attention_ref(q, k, v, count, indices, 64, 64, return_lse=True)
    assert torch.count_nonzero(out[:, :, :64]) == 0
    assert torch.isneginf(lse[:, :, :64]).all() and torch.isfinite(lse[:, :, 64:]).all()
    torch.testing.assert_close(out, dense_masked(q, k, v, mask, 64, 64), atol=1e-5, rtol=1e-5)


def test_lists_roundtrip_and_geometry():
    mask = torch.rand(2, 3, 5, 9) < 0.4
    count, indices = block_lists_from_mask(mask)
    assert count.dtype == torch.int32 and indices.dtype == torch.int32
    assert torch.equal(block_mask_from_lists(count, indices), mask)
    # geometry against a brute-force token check, with a partial last block and bq != bk
    n, bq, bk = 70, 16, 12
    causal, full = block_geometry(n, bq, bk)
    pos = torch.arange(n)
    tril = pos[None, :] <= pos[:, None]
    for i in range(causal.shape[0]):
        for j in range(causal.shape[1]):
            pair = tril[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            assert causal[i, j] == pair.any() and full[i, j] == pair.all()


def three_heads(x):
    return x[:, :1].expand(-1, 3, -1, -1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "k": a["k"][:, :, :-1]}, "k and v must be"),
        (lambda a: {**a, "kv_count": a["kv_count"][..., :-1]}, "kv_count must be"),
        (lambda a: {**a, "kv_indices": a["kv_indices"].long()}, "int32"),
        (lambda a: {**a, "block_k": 32}, "kv_indices must be"),
        (lambda a: {**a, "k": three_heads(a["k"]), "v": three_heads(a["v"])}, "multiple of kv"),
    ],
)
def test_ref_rejects_bad_inputs(change, message):
    q, k, v, _, count, indices = make_inputs((1, 4, 2, 100, 16, 64, 64), "random")
    args = dict(q=q, k=k, v=v, kv_count=count, kv_indices=indices, block_q=64, block_k=64)
    with pytest.raises(ValueError, match=message):
        block_sparse_attention_ref(**change(args))
