"""XAttention's Triton selection path against its PyTorch reference (kernels/xattn_select.py).

The mass is compared with a tolerance; selections as sets per (b, h, query block), with the
candidates excluded (and counted) whose cumulative mass before them sits within EPS of the row's
requirement, or whose mass is within EPS of the masses ranked around the crossing (the order may
flip there). EPS is relative to the row total. Kernel tests run on CUDA, or on CPU under Triton's
interpreter in a fresh Python with TRITON_INTERPRET=1 (`test_interpreter_suite`), small shapes.
"""

from __future__ import annotations

import dataclasses
import math

import interpreter_suite
import pytest
import torch
from conftest import assert_same_sets, structured_qk, within
from interpreter_suite import CUDA, DEVICE, check_layout, kernel_test, lists_to_mask
from rbs_bench.kernels.triton_util import INTERPRET
from rbs_bench.kernels.xattn_select import (
    _launch_mass,
    antidiagonal_mass,
    antidiagonal_mass_ref,
    cumulative_keep,
    cumulative_select,
    supported,
    xattn_select,
    xattn_select_ref,
)

from rbs_bench import methods

EPS = 1e-4


def boundary(mass: torch.Tensor, tau: float, eps: float = EPS) -> torch.Tensor:
    """bool [B, H, M, M]: candidates whose keep decision rounding may flip (see the docstring)."""
    m = mass.shape[-1]
    i = torch.arange(m, device=mass.device)[:, None]
    j = torch.arange(m, device=mass.device)[None, :]
    forced = ((j == 0) | (j == i)) & (j <= i)
    cand = (j > 0) & (j < i)
    v = mass.double().masked_fill(j > i, 0.0)
    total = v.sum(-1, keepdim=True)
    required = tau * total
    ranked, order = v.masked_fill(~cand, -1.0).sort(dim=-1, descending=True, stable=True)
    gain = ranked.clamp_min(0.0)
    before = v.masked_fill(~forced, 0.0).sum(-1, keepdim=True)
    before = before + torch.nn.functional.pad(gain.cumsum(-1)[..., :-1], (1, 0))
    near_ranked = ((before - required).abs() < eps * total) & (ranked >= 0)
    # masses ranked just before and after the crossing: a near tie there may swap the order
    crossing = ((before < required) & (ranked >= 0)).sum(-1, keepdim=True)  # kept candidates
    lo = ranked.gather(-1, crossing.clamp(max=m - 1))
    hi = ranked.gather(-1, (crossing - 1).clamp(min=0))
    inside = (crossing > 0) & (crossing < cand.sum(-1, keepdim=True))  # a kept and a dropped one
    tie = within(v, (lo, hi), eps * total)
    near = torch.zeros_like(near_ranked).scatter(-1, order, near_ranked)
    return (near | (tie & inside & ((hi - lo) < eps * total))) & cand


# (B, Hq, Hkv, N, D, block, stride, dtype, launch options): partial last blocks (N % stride),
# several row and column tiles, and heads in several scratch groups
MASS_CASES = [
    (1, 2, 1, 200, 16, 64, 8, torch.float32, {"block_r": 16, "block_c": 16}),
    (1, 2, 2, 250, 16, 32, 16, torch.float16, {"block_r": 16, "block_c": 16, "scratch_bytes": 1}),
    (1, 1, 1, 129, 32, 128, 16, torch.float32, {}),
    (2, 2, 1, 100, 16, 16, 16, torch.float32, {}),
]


def _mass_id(c):
    b, hq, hkv, n, d, bs, s, dt, _ = c
    return f"B{b}-H{hq}/{hkv}-N{n}-D{d}-bs{bs}-S{s}-{str(dt)[6:]}"


@kernel_test
@pytest.mark.parametrize("case", MASS_CASES, ids=[_mass_id(c) for c in MASS_CASES])
def test_mass_matches_ref(case):
    b, hq, hkv, n, d, bs, stride, dtype, opts = case
    q, k = structured_qk(b, hq, hkv, n, d, seed=n + hq, dtype=dtype, device=DEVICE)
    got = _launch_mass(q, k, bs, stride, None, num_warps=4, num_stages=1, **opts)
    want = antidiagonal_mass_ref(q, k, bs, stride)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@kernel_test
def test_mass_scale_and_public_launcher():
    q, k = structured_qk(1, 2, 1, 200, 16, seed=5, device=DEVICE)
    torch.testing.assert_close(
        antidiagonal_mass(q, k, 32, 8, scale=0.05),
        antidiagonal_mass_ref(q, k, 32, 8, scale=0.05),
        atol=2e-5,
        rtol=1e-5,
    )


@kernel_test
@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_cumulative_select_matches_ref(tau):
    g = torch.Generator().manual_seed(int(tau * 10))
    mass = torch.rand(1, 2, 9, 9, generator=g) ** 3 + 0.02  # skewed masses
    mass[0, 1, 8, 1:5] = 0.25  # ties: lower ids first
    mass[0, 1, 7] = 0.0  # an all-zero row
    mass = mass.tril().to(DEVICE)
    count, idx = cumulative_select(mass, tau)
    check_layout(count, idx)
    near = boundary(mass, tau)
    assert_same_sets(
        lists_to_mask(count, idx), cumulative_keep(mass, tau), near, f"tau {tau}", first=1
    )


@kernel_test
@pytest.mark.parametrize("tau,stride", [(0.9, 16)])
def test_select_matches_ref(tau, stride):
    q, k = structured_qk(1, 2, 1, 250, 16, seed=7, device=DEVICE)
    count, idx = xattn_select(q, k, 32, stride, tau)
    check_layout(count, idx)
    count0, idx0 = xattn_select_ref(q, k, 32, stride, tau)
    near = boundary(antidiagonal_mass_ref(q, k, 32, stride), tau)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near, first=1)
    if not near.any():
        assert torch.equal(count, count0) and torch.equal(idx, idx0)


@kernel_test
def test_method_impls_agree():
    q, k = structured_qk(1, 2, 1, 250, 16, seed=3, dtype=torch.float16, device=DEVICE)
    fields = {"block_size": 32, "stride": 8, "tau": 0.8}
    got = methods.build("xattn", impl="triton", **fields).select(q, k)
    want = methods.build("xattn", impl="torch", **fields).select(q, k)
    check_layout(got.kv_count, got.kv_indices)
    near = boundary(antidiagonal_mass_ref(q, k, 32, 8), 0.8)
    assert_same_sets(got.mask(), want.mask(), near, first=1)
    assert 0 < got.density() < 1


# ---------------------------------------------------------------------- without the interpreter


def test_supported_geometry():
    assert supported(128, 16, 131072) and supported(128, 8, 1) and supported(32, 16, 100)
    assert not supported(48, 16, 1000)  # 3 reshaped rows per block: not a power of two
    assert not supported(2048, 8, 1000)  # 256 rows per block: more than one row tile
    assert not supported(128, 16, 128 * 65537)  # more blocks than the ranking key holds


@pytest.mark.skipif(INTERPRET or CUDA, reason="checks the CPU error without the interpreter")
def test_triton_impl_on_cpu_needs_interpreter():
    q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 1, 256, 16)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        methods.build("xattn", impl="triton").select(q, k)
    assert methods.build("xattn").select(q, k).density() == 1.0  # auto: the reference on CPU


def test_impl_is_validated():
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton; got 'cuda'"):
        methods.build("xattn", impl="cuda")
    assert methods.build("xattn").impl == "auto"
    if CUDA or INTERPRET:
        with pytest.raises(ValueError, match="impl='triton' needs block_size / stride"):
            q = torch.randn(1, 1, 100, 16, device=DEVICE)
            methods.build("xattn", impl="triton", block_size=48).select(q, q)


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-m", "not gpu", at_least=10)


# ------------------------------------------------------------------------------- GPU, bf16, large


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,stride", [(16384, 16), (32768, 8)])
def test_gpu_triton_matches_torch_bf16(n, stride):
    from rbs_bench import synthetic

    data = synthetic.generate(1, 8, 2, n, 128, seed=1, device="cuda", dtype=torch.bfloat16)
    q, k = data.q, data.k
    mass = antidiagonal_mass(q, k, 128, stride)
    want_mass = antidiagonal_mass_ref(q, k, 128, stride)
    torch.testing.assert_close(mass, want_mass, atol=1e-4, rtol=1e-4)
    for tau in (0.5, 0.9):
        sel = methods.build("xattn", tau=tau, stride=stride)
        got = dataclasses.replace(sel, impl="triton").select(q, k)
        want = dataclasses.replace(sel, impl="torch").select(q, k)
        check_layout(got.kv_count, got.kv_indices)
        near = boundary(want_mass, tau)
        assert_same_sets(
            got.mask(), want.mask(), near, f"tau {tau} ({int(near.sum())} near)", first=1
        )
        assert abs(got.density() - want.density()) < 1e-3
        assert math.isfinite(got.density())
