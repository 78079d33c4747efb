"""The FlexAttention executor: BlockMask construction on CPU, numerics on the GPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rbs_bench.kernels.block_sparse_attn import (
    block_geometry,
    block_lists_from_mask,
    block_mask_from_lists,
    expand_block_mask,
)
from rbs_bench.kernels.flex_attn import block_mask_from_selection, flex_block_sparse_attention


def random_selection(b, h, n, bq, bk, p, seed=0, device="cpu"):
    """A random block mask (upper blocks included) and its lists with junk padding."""
    gen = torch.Generator().manual_seed(seed)
    mq, mk = math.ceil(n / bq), math.ceil(n / bk)
    mask = torch.rand(b, h, mq, mk, generator=gen) < p
    count, indices = block_lists_from_mask(mask)
    junk = torch.randint(0, mk, indices.shape, generator=gen, dtype=torch.int32)
    indices = torch.where(torch.arange(mk) >= count[..., None], junk, indices)
    return mask.to(device), count.to(device), indices.to(device)


@pytest.mark.parametrize(
    "n, bq, bk", [(1, 128, 128), (129, 64, 64), (1000, 128, 128), (1025, 64, 128), (700, 128, 64)]
)
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_block_mask_reproduces_selection(n, bq, bk, p):
    mask, count, indices = random_selection(2, 3, n, bq, bk, p)
    bm = block_mask_from_selection(count, indices, bq, bk, n)
    causal, full = block_geometry(n, bq, bk)
    assert bm.BLOCK_SIZE == (bq, bk) and tuple(bm.seq_lengths) == (n, n)
    assert torch.equal(bm.to_dense().bool(), mask & causal)

    # Canonical split: partial = kept diagonal pairs (need the causal mask_mod), full = the rest.
    partial = block_mask_from_lists(bm.kv_num_blocks, bm.kv_indices)
    full_kept = block_mask_from_lists(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert torch.equal(partial, mask & causal & ~full)
    assert torch.equal(full_kept, mask & full)
    # Token level, as flex applies it: mask_mod inside partial blocks, nothing inside full ones.
    q_idx = torch.arange(n)[:, None]
    kv_idx = torch.arange(n)[None, :]
    by_flex = expand_block_mask(partial, bq, bk, n) & bm.mask_mod(0, 0, q_idx, kv_idx)
    pos = torch.arange(n)
    by_flex |= full_kept[:, :, pos // bq][:, :, :, pos // bk]
    assert torch.equal(by_flex, expand_block_mask(mask, bq, bk, n))
    # Ids are ascending within each list.
    lists = [(bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)]
    for cnt, idx in lists:
        slots = torch.arange(idx.shape[-1])
        live = slots[1:] < cnt[..., None]
        assert bool(((idx[..., 1:] > idx[..., :-1]) | ~live).all())


def test_flex_refuses_cpu():
    q = torch.randn(1, 2, 64, 16)
    _, count, indices = random_selection(1, 2, 64, 64, 64, 1.0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        flex_block_sparse_attention(q, q, q, count, indices, 64, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "n, bq, bk", [(1000, 128, 128), (4096, 128, 128), (4096, 64, 64), (1000, 64, 128)]
)
def test_flex_matches_dense_bf16(n, bq, bk):
    b, hq, hkv, d = 1, 8, 2, 128
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, h, n, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv)
    )
    mask, count, indices = random_selection(b, hq, n, bq, bk, 0.3, device="cuda")
    token_mask = expand_block_mask(mask, bq, bk, n)
    seen = token_mask.any(-1, keepdim=True)

    def dense(dtype):
        out = F.scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=token_mask, enable_gqa=True
        )
        return torch.where(seen, out, torch.zeros_like(out)).float()

    truth = dense(torch.float32)
    out = flex_block_sparse_attention(q, k, v, count, indices, bq, bk)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.float() - truth).abs().max().item()
    torch_err = (dense(torch.bfloat16) - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"flex err {err:.3e} vs torch bf16 err {torch_err:.3e}"
