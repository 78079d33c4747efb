"""Block-mass reduction vs dense causal softmax, and the Triton kernel vs its reference.

The reference is checked against a dense [N, N] softmax built in the test with the block mask summed
by hand. Like test_rbs_select.py, the kernel tests run on CUDA directly, or, on a machine without
CUDA, in a fresh Python with TRITON_INTERPRET=1 (`test_interpreter_suite`) on small CPU shapes.
"""

from __future__ import annotations

import math

import interpreter_suite
import pytest
import torch
from interpreter_suite import CUDA, DEVICE, kernel_test, qk
from rbs_bench.kernels.block_mass import (
    block_mass,
    block_mass_ref,
    causal_softmax_chunks,
    kept_block_mass,
    kept_block_mass_ref,
)
from rbs_bench.kernels.block_sparse_attn import block_lists_from_mask
from rbs_bench.kernels.triton_util import INTERPRET


def dense_block_mass(q, k, block, scale=None):
    """[B, Hq, M, M] from the full [N, N] softmax: the definition, for small N only."""
    b, hq, n, d = q.shape
    kk = k.float().repeat_interleave(hq // k.shape[1], 1)
    z = q.float() @ kk.transpose(-1, -2) * (scale or 1 / math.sqrt(d))
    z = z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    p = z.softmax(-1)
    m = math.ceil(n / block)
    out = torch.zeros(b, hq, m, m)
    for i in range(m):
        for j in range(m):
            out[:, :, i, j] = p[:, :, i * block : (i + 1) * block, j * block : (j + 1) * block].sum(
                (-1, -2)
            )
    return out


@pytest.mark.parametrize(
    "n,block,hq,hkv,chunk",
    [
        (1, 16, 1, 1, 1024),
        (127, 32, 2, 1, 1024),
        (128, 32, 4, 2, 40),  # chunk rounds up to whole blocks
        (129, 32, 4, 4, 32),
        (300, 64, 4, 1, 100),
        (257, 128, 2, 2, 1024),
    ],
)
def test_reference_matches_dense_softmax(n, block, hq, hkv, chunk):
    q, k = qk(hq, hkv, n, 16, seed=n)
    got = block_mass_ref(q, k, block, chunk=chunk)
    want = dense_block_mass(q, k, block)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # runs sized by the logits' budget: one query block per run, a few, all of them
    for elements in (1, 4 * hq * block * block, 1 << 30):
        by_budget = block_mass_ref(q, k, block, chunk_elements=elements)
        torch.testing.assert_close(by_budget, want, atol=1e-4, rtol=1e-5)
    m = got.shape[-1]
    rows = torch.tensor([min(block, n - i * block) for i in range(m)], dtype=torch.float32)
    torch.testing.assert_close(got.sum(-1), rows.expand_as(got.sum(-1)), atol=1e-3, rtol=1e-5)
    assert (got.triu(1) == 0).all()  # no key block after the query block


def test_scale_is_the_softmax_temperature():
    q, k = qk(2, 1, 100, 16)
    torch.testing.assert_close(
        block_mass_ref(q, k, 32, scale=0.5),
        dense_block_mass(q, k, 32, scale=0.5),
        atol=1e-4,
        rtol=0,
    )


def test_chunks_yield_every_row_once():
    q, k = qk(2, 2, 70, 8)
    spans = [(t0, t1, p.shape) for t0, t1, p in causal_softmax_chunks(q, k, chunk=32)]
    assert [(a, b) for a, b, _ in spans] == [(0, 32), (32, 64), (64, 70)]
    assert spans[-1][2] == (1, 2, 6, 70)


def test_bad_shapes_fail_with_one_line():
    q, k = qk(3, 2, 10, 8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        block_mass_ref(q, k, 4)
    with pytest.raises(ValueError, match="block_size"):
        block_mass_ref(*qk(2, 1, 10, 8), 0)


@kernel_test
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize(
    "n,block,hq,hkv,d,dtype",
    [
        (1, 16, 1, 1, 16, torch.float32),
        (129, 32, 4, 2, 16, torch.float32),
        (77, 24, 2, 2, 16, torch.float32),  # block size not a power of two
        (100, 32, 2, 1, 16, torch.float16),
        (150, 24, 4, 2, 24, torch.float16),  # neither block nor head dim a power of two
    ],
)
def test_kernel_matches_reference(n, block, hq, hkv, d, dtype, split):
    q, k = qk(hq, hkv, n, d, seed=n, device=DEVICE, dtype=dtype)
    got = block_mass(q, k, block, split=split)
    want = block_mass_ref(q, k, block)  # fp32 from the same (rounded) inputs
    torch.testing.assert_close(got, want, atol=2e-3 * block, rtol=1e-3)
    assert (got.triu(1) == 0).all()
    rows = torch.tensor([min(block, n - i * block) for i in range(got.shape[-1])], device=DEVICE)
    torch.testing.assert_close(got.sum(-1), rows.float().expand_as(got.sum(-1)), atol=1e-3, rtol=0)


def random_lists(b, h, m, share, seed, device="cpu"):
    """(count, indices) of a random causal block selection: each row keeps its diagonal and a
    `share` of the blocks before it."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, h, m, m, generator=g) < share) & torch.ones(m, m, dtype=torch.bool).tril()
    mask |= torch.eye(m, dtype=torch.bool)
    count, index = block_lists_from_mask(mask)
    return count.to(device), index.to(device), mask


def test_kept_mass_reference_is_the_block_mass_on_the_mask():
    q, k = qk(4, 2, 300, 16, seed=3)
    count, index, mask = random_lists(1, 4, 5, 0.4, seed=1)
    got = kept_block_mass_ref(q, k, count, index, 64)
    want = (dense_block_mass(q, k, 64) * mask).sum(-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize(
    "n,block,hq,hkv,d,dtype,heads_of_lists",
    [
        (129, 32, 4, 2, 16, torch.float32, 4),
        (77, 24, 2, 2, 16, torch.float32, 1),  # one list for every head
        (150, 24, 4, 2, 24, torch.float16, 4),  # neither block nor head dim a power of two
        (200, 32, 2, 1, 16, torch.float16, 2),
    ],
)
def test_kept_mass_kernel_matches_reference(n, block, hq, hkv, d, dtype, heads_of_lists):
    q, k = qk(hq, hkv, n, d, seed=n, device=DEVICE, dtype=dtype)
    m = -(-n // block)
    count, index, _ = random_lists(1, heads_of_lists, m, 0.3, seed=n, device=DEVICE)
    got = kept_block_mass(q, k, count, index, block)
    want = kept_block_mass_ref(q, k, count, index, block)
    torch.testing.assert_close(got, want, atol=2e-3 * block, rtol=1e-3)
    full, idx, _ = random_lists(1, 1, m, 1.0, seed=0, device=DEVICE)  # every causal block
    rows = torch.tensor([min(block, n - i * block) for i in range(m)], device=DEVICE).float()
    torch.testing.assert_close(
        kept_block_mass(q, k, full, idx, block), rows.expand(1, hq, m), atol=1e-3, rtol=0
    )


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel_matches", at_least=14, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [8192, 32768])
def test_gpu_kernel_bf16_long(n):
    from rbs_bench import synthetic

    data = synthetic.generate(1, 8, 2, n, 128, seed=1, device="cuda", dtype=torch.bfloat16)
    got = block_mass(data.q, data.k, 128)
    want = block_mass_ref(data.q, data.k, 128)
    torch.testing.assert_close(got, want, atol=0.05, rtol=2e-3)
    torch.testing.assert_close(got.sum(-1)[..., :-1], torch.full_like(got.sum(-1)[..., :-1], 128.0))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
def test_gpu_kept_mass_bf16_long():
    from rbs_bench import synthetic

    data = synthetic.generate(1, 8, 2, 16384, 128, seed=2, device="cuda", dtype=torch.bfloat16)
    count, index, mask = random_lists(1, 8, 128, 0.05, seed=3, device="cuda")
    got = kept_block_mass(data.q, data.k, count, index, 128)
    want = (block_mass(data.q, data.k, 128) * mask.cuda()).sum(-1)
    torch.testing.assert_close(got, want, atol=0.05, rtol=2e-3)
