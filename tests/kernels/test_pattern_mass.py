"""Kept mass of token patterns: the reference against a hand-built token mask and against the
chunked PyTorch pass of baselines/minference.py, and the Triton kernel against the reference.

Like test_block_mass.py, the kernel tests run on CUDA directly, or, on a machine without CUDA, in a
fresh Python with TRITON_INTERPRET=1 (`test_interpreter_suite`) on small CPU shapes.
"""

from __future__ import annotations

import math

import interpreter_suite
import pytest
import torch
from interpreter_suite import CUDA, DEVICE, kernel_test, qk
from rbs_bench.kernels.pattern_mass import pattern_kept_mass, pattern_kept_mass_ref
from rbs_bench.kernels.triton_util import INTERPRET
from rbs_bench.kernels.vertical_slash_attn import membership, vertical_slash_token_mask


def ids(b, h, n, width, seed):
    """int [B, H, width] random positions < n, a quarter of them padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, n, (b, h, width), generator=g)
    return out.masked_fill(torch.rand(b, h, width, generator=g) < 0.25, -1)


def masks(b, h, n, patterns, seed=0):
    """(on_cols, on_diags) bool [P, B, H, N] of random columns and diagonals, each pattern with
    the diagonal 0 (every query sees itself) and a few more."""
    cols, diags = [], []
    for p in range(patterns):
        c = ids(b, h, n, max(1, n // 8), seed + 2 * p)
        zero = torch.zeros(b, h, 1, dtype=torch.long)
        d = torch.cat([zero, ids(b, h, n, 3, seed + 2 * p + 1)], -1)
        cols.append(membership(c, n))
        diags.append(membership(d, n))
    return torch.stack(cols), torch.stack(diags), c, d


def test_reference_is_the_softmax_on_the_token_mask():
    q, k = qk(4, 2, 70, 16, seed=1)
    on_cols, on_diags, c, d = masks(1, 4, 70, 1, seed=3)
    got = pattern_kept_mass_ref(q, k, on_cols, on_diags)
    z = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(16)
    z = z.masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(1), -math.inf)
    want = (z.softmax(-1) * vertical_slash_token_mask(c, d, 70)).sum((-1, -2))
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-5)


def test_reference_agrees_with_the_chunked_pass():
    from rbs_bench.baselines.minference import pattern_mass

    class Pattern:  # what pattern_mass reads of a VerticalSlashPattern
        def __init__(self, columns, diagonals):
            self.columns, self.diagonals = columns, diagonals

    q, k = qk(2, 1, 90, 16, seed=2, b=2)
    got_c, got_d, pats = [], [], []
    for p in range(3):
        c, d = ids(2, 2, 90, 12, 10 + p), ids(2, 2, 90, 4, 20 + p)
        pats.append(Pattern(c, d))
        got_c.append(membership(c, 90))
        got_d.append(membership(d, 90))
    want = torch.stack(pattern_mass(q, k, None, pats, chunk=32))
    got = pattern_kept_mass_ref(q, k, torch.stack(got_c), torch.stack(got_d))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_bad_masks_fail_with_one_line():
    q, k = qk(2, 1, 10, 8)
    good = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"on_cols must be \[P, 1, 2, 10\]"):
        pattern_kept_mass_ref(q, k, good[..., :9], good)
    with pytest.raises(ValueError, match="as many patterns"):
        pattern_kept_mass_ref(q, k, good, torch.cat([good, good]))


@kernel_test
@pytest.mark.parametrize(
    "b,n,hq,hkv,d,patterns,dtype",
    [
        (1, 1, 1, 1, 16, 1, torch.float32),  # one token
        (1, 50, 2, 1, 16, 1, torch.float32),  # shorter than a tile
        (2, 129, 4, 2, 16, 3, torch.float32),  # a tile and a row past two
        (1, 150, 2, 2, 24, 2, torch.float16),  # head dim not a power of two
        (1, 200, 4, 1, 32, 1, torch.float16),
    ],
)
def test_kernel_matches_reference(b, n, hq, hkv, d, patterns, dtype):
    q, k = qk(hq, hkv, n, d, seed=n, device=DEVICE, dtype=dtype, b=b)
    on_cols, on_diags, _, _ = masks(b, hq, n, patterns, seed=n)
    on_cols, on_diags = on_cols.to(DEVICE), on_diags.to(DEVICE)
    got = pattern_kept_mass(q, k, on_cols, on_diags)
    want = pattern_kept_mass_ref(q, k, on_cols, on_diags)  # fp32 from the same (rounded) inputs
    # each row's mass is at most 1: the inputs' rounding unit per row bounds the kernel's own
    # rounding (fp16 / bf16 products are exact in the dot and accumulate in fp32)
    tol = n * (1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps)
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-4)
    # every diagonal keeps each query's whole softmax (N); no column and no diagonal keeps 0
    every = torch.ones_like(on_diags[:1])
    none = torch.zeros_like(on_cols[:1])
    full = pattern_kept_mass(q, k, none, every)
    torch.testing.assert_close(full, torch.full_like(full, float(n)), atol=1e-5 * n, rtol=1e-4)
    assert (pattern_kept_mass(q, k, none, none) == 0).all()


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel_matches", at_least=5, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
def test_gpu_kernel_agrees_with_the_chunked_pass_at_16k_bf16():
    from rbs_bench.baselines.minference import MInference, pattern_mass

    n = 16384
    q, k = qk(4, 2, n, 64, seed=5, device="cuda", dtype=torch.bfloat16)
    pattern = MInference(vertical_size=200, slash_size=400).select(q, k)
    got = pattern_mass(q, k, None, [pattern], triton_path=True)[0]
    want = pattern_mass(q, k, None, [pattern], triton_path=False)[0]
    # both read the same bf16 inputs; they differ only in summation order and exp2 vs exp
    torch.testing.assert_close(got, want, atol=1e-4 * n, rtol=1e-3)
