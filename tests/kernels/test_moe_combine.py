"""The MoE combine kernel vs its reference, and the reference vs the definition.

Like the other kernel files, the kernel tests run on CUDA directly, or, without CUDA, in a fresh
Python under TRITON_INTERPRET=1 (`test_interpreter_suite`) on small CPU shapes in fp32/fp16.
"""

from __future__ import annotations

import interpreter_suite
import pytest
import torch
from interpreter_suite import DEVICE, kernel_test
from rbs_bench.kernels.moe_combine import _launch, moe_combine, moe_combine_ref


def routed(n, k, hidden, dtype, device="cpu", seed=0):
    """y [n*k, hidden] in a random 'expert' order, pos [n, k] its inverse, w [n, k]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n * k, hidden, generator=g)
    perm = torch.randperm(n * k, generator=g)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(n * k)
    w = torch.rand(n, k, generator=g)
    return y.to(device, dtype), pos.view(n, k).to(device), w.to(device, dtype)


@pytest.mark.parametrize("n,k,hidden", [(1, 1, 7), (37, 3, 100), (130, 8, 64)])
def test_reference_is_the_weighted_sum_of_each_tokens_rows(n, k, hidden):
    y, pos, w = routed(n, k, hidden, torch.float64)
    want = torch.stack([sum(w[t, j] * y[pos[t, j]] for j in range(k)) for t in range(n)])
    torch.testing.assert_close(moe_combine_ref(y, pos, w), want)


def test_bad_shapes_are_one_line():
    y, pos, w = routed(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="pos has 8 entries for 6 rows"):
        moe_combine_ref(y[:6], pos, w)
    padded = torch.cat([y, torch.full_like(y[:3], float("nan"))])  # rows pos never names
    torch.testing.assert_close(moe_combine_ref(padded, pos, w), moe_combine_ref(y, pos, w))
    with pytest.raises(ValueError, match=r"y must be \[S, H\]"):
        moe_combine_ref(y[None], pos, w)


def test_the_op_runs_the_reference_on_the_cpu_and_compiles():
    y, pos, w = routed(33, 4, 48, torch.float32)
    torch.testing.assert_close(moe_combine(y, pos, w), moe_combine_ref(y, pos, w))
    fake = torch.library.opcheck(moe_combine, (y, pos, w))
    assert all(v == "SUCCESS" for v in fake.values()), fake


@kernel_test
@pytest.mark.parametrize(
    "n,k,hidden,dtype",
    [
        (1, 1, 16, torch.float32),
        (17, 8, 100, torch.float32),  # hidden not a power of two, tokens not a tile multiple
        (129, 2, 64, torch.float16),
        (40, 4, 600, torch.float16),  # two hidden tiles
    ],
)
def test_kernel_matches_reference(n, k, hidden, dtype):
    y, pos, w = routed(n, k, hidden, dtype, DEVICE)
    got = _launch(y, pos, w)
    want = moe_combine_ref(y, pos, w)
    exact = moe_combine_ref(y.double(), pos, w.double())
    # both accumulate in fp32 and round once: the kernel is at most as far from fp64 as the
    # reference plus one rounding step of the output dtype
    tol = (want.double() - exact).abs().max().item() + torch.finfo(dtype).eps * exact.abs().max()
    assert (got.double() - exact).abs().max().item() <= tol
    assert got.dtype == dtype and got.shape == (n, hidden)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_at_model_size_in_bf16():
    y, pos, w = routed(16384, 8, 2048, torch.bfloat16, "cuda")
    got, want = moe_combine(y, pos, w), moe_combine_ref(y, pos, w)
    exact = moe_combine_ref(y.double(), pos, w.double())
    ref_err = (want.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * ref_err + 1e-6


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel_matches", at_least=4, timeout=600)
