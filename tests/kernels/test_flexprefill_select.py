"""FlexPrefill's Triton selection path against its reference (kernels/flexprefill_select.py).

The compose kernel must match its torch composition exactly. End to end, selections are compared
as sets per (b, h, query block) with the blocks excluded (and counted) that rounding may flip:
column / offset blocks whose pooled mass is within EPS of the last kept one, pooled pairs whose
probability is within EPS of the coverage boundary or whose running sum there is within EPS of
the target, and every block of a head whose token budget or query-aware decision sits within EPS
of its threshold. Kernel tests (`test_triton_*`) run on CUDA, or on CPU under Triton's interpreter
in a fresh Python with TRITON_INTERPRET=1 (`test_interpreter_suite`), small shapes.
"""

from __future__ import annotations

import dataclasses
import math

import interpreter_suite
import pytest
import torch
from conftest import assert_same_sets, structured_qk
from interpreter_suite import CUDA, DEVICE, check_layout, kernel_test, lists_to_mask
from rbs_bench.kernels.block_masks import compact_mask
from rbs_bench.kernels.flexprefill_select import (
    block_means,
    compose_blocks,
    flexprefill_estimate_ref,
    flexprefill_select,
    flexprefill_select_ref,
    query_aware_blocks,
    query_aware_blocks_ref,
    supported,
)
from rbs_bench.kernels.triton_util import INTERPRET
from rbs_bench.kernels.vertical_slash_attn import vertical_slash_estimate_ref

from rbs_bench import methods

EPS = 1e-5


def boundary_ties(vals: torch.Tensor, count: torch.Tensor, tol) -> torch.Tensor:
    """bool like vals (sorted descending on the last dim): entries within tol of the last kept
    value (rank count - 1) when the first dropped one (rank count) is within tol of it too."""
    m = vals.shape[-1]
    last = vals.gather(-1, (count - 1).clamp(0, m - 1))
    nxt = vals.gather(-1, count.clamp(0, m - 1))
    tie = ((last - nxt).abs() <= tol) & (count < m) & (count > 0)
    return tie & (((vals - last).abs() <= tol) | ((vals - nxt).abs() <= tol))


def coverage_boundary(p: torch.Tensor, target, eps: float, tie_eps: float = 1e-4):
    """bool like p (rows on the last dim): entries whose keep decision rounding may flip, i.e.
    whose running sum before them (largest first) is within eps * target of the target, or that
    tie (within tie_eps, relative) with the last kept and first dropped entries."""
    target = torch.as_tensor(target, dtype=torch.float64, device=p.device).expand(p.shape[:-1])
    vals, order = p.double().sort(dim=-1, descending=True, stable=True)
    before = vals.cumsum(-1) - vals
    near = (before - target[..., None]).abs() <= eps * target[..., None]
    count = (before < target[..., None]).sum(-1, keepdim=True).clamp(min=1)
    last = vals.gather(-1, (count - 1).clamp(max=vals.shape[-1] - 1))
    near |= boundary_ties(vals, count, tie_eps * last)
    return torch.zeros_like(near).scatter(-1, order, near)


def allowed_differences(q, k, fields, scale=None):
    """bool [B, H, M, M]: block pairs whose decision rounding may flip (see the docstring)."""
    sel = methods.build("flexprefill", impl="torch", **fields)
    bs, n = sel.block_size, q.shape[2]
    m = math.ceil(n / bs)
    est = flexprefill_estimate_ref(q, k, *sel._rule(), scale)
    b, hq = est.query_aware.shape
    vert, slash = vertical_slash_estimate_ref(q, k, bs, scale)
    tokens = torch.stack([vert, slash]).double() / bs  # [2, B, H, N]
    # heads whose token budget may flip (the running sum at the count within EPS of gamma, and
    # one token more or less changes count // bs) or whose query-aware test may flip
    cum = tokens.sort(-1, descending=True).values.cumsum(-1)
    count = (cum < sel.gamma).sum(-1, keepdim=True)  # running sums below gamma
    at = cum.gather(-1, count.clamp(max=n - 1))[..., 0]
    before = torch.where(count > 0, cum.gather(-1, (count - 1).clamp(min=0)), 0.0)[..., 0]
    near_sum = ((at - sel.gamma).abs() <= EPS) | ((before - sel.gamma).abs() <= EPS)
    count = count[..., 0] + 1
    near_budget = (near_sum & ((count % bs == 0) | (count % bs == bs - 1))).any(0)
    near_head = near_budget | ((est.distance - sel.tau).abs() <= 1e-4)
    # line blocks near the top-n boundary
    near = torch.zeros(b, hq, m, m, dtype=torch.bool, device=q.device)
    i = torch.arange(m, device=q.device)
    diff = (i[:, None] - i[None, :]).clamp(min=0)
    for mass, count, is_col in (
        (est.vertical, est.n_vertical, True),
        (est.slash, est.n_slash, False),
    ):
        mass = mass.double().clone()
        mass[..., 0] = math.inf  # forced
        vals, order = mass.sort(dim=-1, descending=True, stable=True)
        count = count.clamp(min=1, max=m)[..., None]
        ties = boundary_ties(vals, count, 1e-4 * vals.gather(-1, count.clamp(max=m - 1)))
        near_line = torch.zeros_like(ties).scatter(-1, order, ties)
        near |= near_line[:, :, None, :] if is_col else near_line[..., diff]
    qa = est.query_aware.nonzero(as_tuple=True)
    if qa[0].numel():
        group = hq // k.shape[1]
        q_bar = block_means(q, bs)[qa]
        k_bar = block_means(k, bs)[qa[0], qa[1] // group]
        scale_ = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        logits = torch.einsum("rid,rjd->rij", q_bar.double(), k_bar.double()) * scale_
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1).flatten(1)
        near[qa] |= coverage_boundary(p, sel.gamma * m, EPS).view(-1, m, m)
    near |= near_head[:, :, None, None]
    return near & torch.ones(m, m, dtype=torch.bool, device=q.device).tril()


# ------------------------------------------------------------------------------------ kernels


@kernel_test
def test_triton_compose_matches_torch():
    gen = torch.Generator().manual_seed(0)
    b, h, m = 2, 3, 21
    keep_v = torch.rand(b, h, m, generator=gen) < 0.2
    keep_s = torch.rand(b, h, m, generator=gen) < 0.2
    qa_row = torch.tensor([[-1, 0, -1], [1, -1, -1]], dtype=torch.int32)
    qa_mask = torch.rand(2, m, m, generator=gen) < 0.3
    dev = [t.to(DEVICE) for t in (keep_v, keep_s, qa_row, qa_mask)]
    count, idx = compose_blocks(*dev)
    check_layout(count, idx)
    i = torch.arange(m)
    diff = i[:, None] - i[None, :]
    want = keep_v[:, :, None, :] | (keep_s[..., diff.clamp(min=0)] & (diff >= 0))
    want[0, 1] |= qa_mask[0]
    want[1, 0] |= qa_mask[1]
    want &= torch.ones(m, m, dtype=torch.bool).tril()
    want_count, want_idx = compact_mask(want)
    assert torch.equal(count.cpu(), want_count) and torch.equal(idx.cpu(), want_idx)


@kernel_test
def test_triton_query_aware_blocks_match_ref():
    q, k = structured_qk(1, 4, 2, 600, 16, seed=1, kind="tempered", device=DEVICE)
    heads = (torch.tensor([0, 0, 0], device=DEVICE), torch.tensor([0, 2, 3], device=DEVICE))
    m = math.ceil(600 / 32)
    for gamma in (0.7,):
        got = query_aware_blocks(q, k, heads, gamma, 32, scratch_bytes=1)  # a head at a time
        want = query_aware_blocks_ref(q, k, heads, gamma, 32)
        assert got.shape == (3, m, m) and got.dtype == torch.bool
        q_bar = block_means(q, 32)[heads]
        k_bar = block_means(k, 32)[heads[0], heads[1] // 2]
        logits = torch.einsum("rid,rjd->rij", q_bar.double(), k_bar.double()) / 4
        causal = torch.ones(m, m, dtype=torch.bool, device=DEVICE).tril()
        p = torch.softmax(logits.masked_fill(~causal, -math.inf), -1).flatten(1)
        near = coverage_boundary(p, gamma * m, EPS).view(-1, m, m)
        assert_same_sets(got, want, near, f"gamma {gamma}", share=0.05, floor=8, pairs=near.numel())
        assert not (got & ~causal).any()


CASES = [  # (fields, (b, hq, hkv, n, d)): query-aware and vertical-slash heads
    ({"min_budget": 0, "block_size": 32, "tau": 0.2}, (1, 4, 2, 400, 16)),
    ({"min_budget": 64, "max_budget": 200, "block_size": 64, "tau": 0.4}, (1, 4, 2, 450, 16)),
]


@kernel_test
@pytest.mark.parametrize("fields,shape", CASES)
def test_triton_select_matches_ref(fields, shape):
    q, k = structured_qk(*shape, seed=shape[3], kind="tempered", device=DEVICE)
    rule = methods.build("flexprefill", **fields)._rule()
    count, idx, est = flexprefill_select(q, k, *rule)
    check_layout(count, idx)
    want, est0 = flexprefill_select_ref(q, k, *rule)
    torch.testing.assert_close(est.vertical, est0.vertical, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(est.slash, est0.slash, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(est.distance, est0.distance, atol=1e-5, rtol=1e-5)
    assert torch.equal(est.n_vertical, est0.n_vertical) and torch.equal(est.n_slash, est0.n_slash)
    assert torch.equal(est.query_aware, est0.query_aware)
    assert est0.query_aware.any() and not est0.query_aware.all()
    m = want.shape[-1]
    want &= torch.ones(m, m, dtype=torch.bool, device=DEVICE).tril()
    near = allowed_differences(q, k, fields)
    assert_same_sets(lists_to_mask(count, idx), want, near, share=0.05, floor=8, pairs=near.numel())
    assert 0 < int(count.sum()) < want.shape[0] * want.shape[1] * m * (m + 1) // 2


@kernel_test
def test_triton_method_impls_agree():
    q, k = structured_qk(
        1, 2, 1, 200, 16, seed=7, dtype=torch.float16, kind="tempered", device=DEVICE
    )
    fields = {"min_budget": 0, "block_size": 16, "tau": 0.3}
    got = methods.build("flexprefill", impl="triton", **fields).select(q, k)
    want = methods.build("flexprefill", impl="torch", **fields).select(q, k)
    check_layout(got.kv_count, got.kv_indices)
    near = allowed_differences(q, k, fields)
    assert_same_sets(got.mask(), want.mask(), near, share=0.05, floor=8, pairs=near.numel())
    assert 0 < got.density() < 1


def test_supported_geometry():
    assert supported(128, 131072, 128) and supported(16, 100, 64)
    assert not supported(256, 4096, 128)  # more last queries than the estimate tile holds
    assert not supported(128, 128 * 65537, 128)


@pytest.mark.skipif(INTERPRET or CUDA, reason="checks the CPU error without the interpreter")
def test_triton_impl_on_cpu_needs_interpreter():
    q, k = torch.randn(1, 2, 2048, 16), torch.randn(1, 1, 2048, 16)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        methods.build("flexprefill", impl="triton").select(q, k)
    assert methods.build("flexprefill").impl == "auto"
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton; got 'gpu'"):
        methods.build("flexprefill", impl="gpu")


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-m", "not gpu", "-k", "test_triton_", at_least=5)


# ------------------------------------------------------------------------ GPU, bf16, large

gpu_test = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")


def _synthetic(n, hq=8, hkv=2, d=128, seed=1):
    from rbs_bench import synthetic

    data = synthetic.generate(1, hq, hkv, n, d, seed=seed, device="cuda", dtype=torch.bfloat16)
    return data.q, data.k


@pytest.mark.gpu
@gpu_test
@pytest.mark.parametrize("n", [16384, 65536])
@pytest.mark.parametrize("tau", [0.1, 1.0])  # tau 1: every head query-aware (sqrt JSD < 0.84)
def test_gpu_triton_matches_torch_bf16(n, tau):
    q, k = _synthetic(n)
    sel = methods.build("flexprefill", tau=tau)
    got = sel.select(q, k)  # auto: the Triton path
    want = dataclasses.replace(sel, impl="torch").select(q, k)
    check_layout(got.kv_count, got.kv_indices)
    near = allowed_differences(q, k, {"tau": tau})
    assert_same_sets(
        got.mask(), want.mask(), near, f"N {n} tau {tau}", share=0.05, floor=8, pairs=near.numel()
    )
    assert abs(got.density() - want.density()) < 1e-3


@pytest.mark.gpu
@gpu_test
@pytest.mark.parametrize("tau", [0.1, 1.0])
def test_gpu_workspace_at_128k(tau):
    """The Triton selector's device memory beyond its output lists stays within 256 MiB at 128K,
    32 query / 4 KV heads, also when every head is query-aware."""
    q, k = _synthetic(131072, hq=32, hkv=4)
    sel = methods.build("flexprefill", tau=tau, impl="triton")
    sel.select(q, k)  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = sel.select(q, k)
    torch.cuda.synchronize()
    lists = sum(t.numel() * t.element_size() for t in (out.kv_count, out.kv_indices))
    workspace = torch.cuda.max_memory_allocated() - base - lists
    assert workspace <= 256 * 2**20, f"workspace {workspace / 2**20:.0f} MiB"
