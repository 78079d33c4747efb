"""The router top-k kernel vs its reference, and the reference vs the router's definition.

Like the other kernel files, the kernel tests run on CUDA directly, or, without CUDA, in a fresh
Python under TRITON_INTERPRET=1 (`test_interpreter_suite`) on small CPU shapes in fp32/fp16.
"""

from __future__ import annotations

import interpreter_suite
import pytest
import torch
from interpreter_suite import DEVICE, kernel_test
from rbs_bench.kernels.router_topk import _launch, router_topk, router_topk_ref


def logits(n, experts, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, experts, generator=g) * 2).to(device, dtype)


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_is_the_routers_definition(normalize):
    """Per token, by hand: the k most probable experts of softmax(logits), largest first, their
    probabilities (over their own sum when normalised)."""
    x = logits(7, 10, torch.float64)
    w, idx = router_topk_ref(x, 3, normalize)
    for t in range(7):
        p = torch.exp(x[t] - x[t].max())
        p = p / p.sum()
        order = sorted(range(10), key=lambda e: -float(p[e]))[:3]
        assert idx[t].tolist() == order
        want = p[order] / (p[order].sum() if normalize else 1.0)
        torch.testing.assert_close(w[t], want)


def test_bad_inputs_are_one_line():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        router_topk_ref(logits(3, 4), 5, True)
    with pytest.raises(ValueError, match=r"logits must be \[N, E\]"):
        router_topk_ref(logits(3, 4)[None], 2, True)


def test_the_op_runs_the_reference_on_the_cpu_and_compiles():
    x = logits(33, 16)
    got, want = router_topk(x, 4, True), router_topk_ref(x, 4, True)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    fake = torch.library.opcheck(router_topk, (x, 4, True))
    assert all(v == "SUCCESS" for v in fake.values()), fake


def check(got, want, x):
    """The experts of the reference up to the order of equal logits (fp16 logits tie; the kernel
    takes the lower id, torch.topk leaves it open): distinct ids per token whose probabilities
    are the reference's, slot by slot; weights within two units of the output dtype's rounding
    (the kernel's exp and sums round differently from torch's in fp32)."""
    p = torch.softmax(x.double(), -1)
    assert torch.equal(p.gather(1, got[1]), p.gather(1, want[1]))
    assert bool((got[1].sort(-1).values.diff(dim=-1) > 0).all())
    assert got[0].dtype == x.dtype
    err = (got[0].double() - want[0].double()).abs().max().item()
    assert err <= 2 * torch.finfo(x.dtype).eps, err


@kernel_test
@pytest.mark.parametrize(
    "n,experts,top_k,normalize,dtype",
    [
        (1, 4, 1, True, torch.float32),
        (37, 128, 8, True, torch.float32),  # Qwen3-30B-A3B's router, rows not a tile multiple
        (65, 60, 4, False, torch.float16),  # experts not a power of two, k not normalised
        (130, 128, 8, True, torch.float16),
        (9, 5, 5, True, torch.float32),  # every expert chosen
    ],
)
def test_kernel_matches_reference(n, experts, top_k, normalize, dtype):
    x = logits(n, experts, dtype, DEVICE, seed=n)
    check(_launch(x, top_k, normalize), router_topk_ref(x, top_k, normalize), x)


@kernel_test
def test_kernel_breaks_ties_towards_the_lower_expert():
    x = torch.zeros(3, 8, device=DEVICE)
    x[:, 5] = 1.0
    w, idx = _launch(x, 3, True)
    assert idx.tolist() == [[5, 0, 1]] * 3
    assert torch.allclose(w.sum(-1), torch.ones(3, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_at_model_size_in_bf16():
    x = logits(131072, 128, torch.bfloat16, "cuda", seed=1)
    check(router_topk(x, 8, True), router_topk_ref(x, 8, True), x)


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel_", at_least=6, timeout=600)
