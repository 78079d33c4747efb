"""Quest's Triton selection path against its PyTorch reference (kernels/quest_select.py).

Scores are compared with a tolerance. The ranking kernel reads the same scores as `top_fraction`,
so on one scores tensor the two must agree exactly; end to end (kernel scores vs reference scores)
selections are compared as sets per (b, h, query block), with the candidates excluded and counted
whose reference score is within EPS of the scores ranked around the top-k boundary (a near tie
may rank either way). Kernel tests run on CUDA, or on CPU under Triton's interpreter in a fresh
Python with TRITON_INTERPRET=1 (`test_interpreter_suite`), small shapes.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import interpreter_suite
import pytest
import torch
from conftest import assert_same_sets, structured_qk, within
from interpreter_suite import CUDA, DEVICE, check_layout, kernel_test, lists_to_mask
from rbs_bench.kernels.block_masks import compact_mask, forced_mask
from rbs_bench.kernels.quest_select import (
    _launch_scores,
    box_scores,
    box_scores_ref,
    box_stats,
    box_stats_ref,
    quest_select,
    quest_select_ref,
    top_counts,
    top_fraction,
    top_fraction_select,
)
from rbs_bench.kernels.triton_util import INTERPRET

from rbs_bench import methods

EPS = 1e-3


def boundary(scores: torch.Tensor, ratio: float, forced: torch.Tensor, eps: float) -> torch.Tensor:
    """bool [B, H, M, M]: candidates (not forced) within eps of the scores around the top-k cut."""
    m = scores.shape[-1]
    idx = torch.arange(m, device=scores.device)
    cand = idx[None, :] < idx[:, None]
    top = top_counts(m, ratio, scores.device).long()[:, None]  # [M, 1]
    ranked = scores.masked_fill(~cand, -math.inf).sort(dim=-1, descending=True).values
    kth = ranked.gather(-1, (top - 1).clamp(min=0).expand(*scores.shape[:-1], 1))
    nxt = ranked.gather(-1, top.clamp(max=m - 1).expand(*scores.shape[:-1], 1))
    cut = (top < cand.sum(-1, keepdim=True)) & (kth - nxt < eps)  # a near tie across the cut
    return within(scores, (kth, nxt), eps) & cut & cand & ~forced


# (B, Hq, Hkv, N, D, block, dtype, launch options): partial last blocks, several key tiles
SCORE_CASES = [
    (1, 2, 1, 200, 16, 16, torch.float32, {"block_k": 16}),
    (2, 2, 2, 129, 32, 16, torch.float16, {"block_k": 16}),
    (1, 1, 1, 200, 16, 64, torch.float32, {}),
]


@kernel_test
@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: f"N{c[3]}-bs{c[5]}-{str(c[6])[6:]}")
def test_scores_match_ref(case):
    b, hq, hkv, n, d, bs, dtype, opts = case
    q, k = structured_qk(b, hq, hkv, n, d, seed=n, dtype=dtype, device=DEVICE)
    kmin, kmax = box_stats(k, bs)
    kmin0, kmax0 = box_stats_ref(k, bs)
    assert torch.equal(kmin.float(), kmin0) and torch.equal(kmax.float(), kmax0)
    m = kmin.shape[2]
    got = torch.full((b, hq, m, m), -math.inf, device=DEVICE)
    _launch_scores(q, kmin, kmax, bs, got, 1, m, num_warps=4, num_stages=1, **opts)
    want = box_scores_ref(q, kmin0, kmax0, bs)
    low = torch.ones(m, m, dtype=torch.bool, device=DEVICE).tril(-1)
    torch.testing.assert_close(got[..., low], want[..., low], atol=1e-4, rtol=1e-5)
    assert bool((got[..., ~low] == -math.inf).all())  # nothing at or above the diagonal
    if not opts:
        torch.testing.assert_close(box_scores(q, kmin, kmax, bs), got)


@kernel_test
@pytest.mark.parametrize("ratio,forced", [(0.3, (0, 1, 0))])
def test_top_fraction_select_matches_ref_exactly(ratio, forced):
    g = torch.Generator().manual_seed(int(ratio * 10))
    scores = torch.randn(2, 1, 11, 11, generator=g)
    scores[1, 0, 10, :6] = 0.5  # ties: lower ids first
    scores[1, 0, 9, :5] = -0.0  # signed zeros rank as equals
    scores[1, 0, 9, 5:] = 0.0
    scores = scores.to(DEVICE)
    count, idx = top_fraction_select(scores, ratio, *forced)
    check_layout(count, idx)
    cand = torch.ones(11, 11, dtype=torch.bool, device=DEVICE).tril(-1)
    keep = top_fraction(scores, cand, ratio) | forced_mask(11, *forced, DEVICE)
    count0, idx0 = compact_mask(keep)
    assert torch.equal(count, count0) and torch.equal(idx, idx0)


@kernel_test
@pytest.mark.parametrize("ratio", [0.2])
def test_select_matches_ref(ratio):
    q, k = structured_qk(1, 2, 1, 400, 16, seed=3, device=DEVICE)
    kmin, kmax = box_stats_ref(k, 32)
    forced = (2, 2, 1)
    count, idx = quest_select(q, kmin, kmax, 32, ratio, *forced)
    check_layout(count, idx)
    count0, idx0 = quest_select_ref(q, kmin, kmax, 32, ratio, *forced)
    m = kmin.shape[2]
    near = boundary(box_scores_ref(q, kmin, kmax, 32), ratio, forced_mask(m, *forced, DEVICE), EPS)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)
    if not near.any():
        assert torch.equal(count, count0) and torch.equal(idx, idx0)


@kernel_test
def test_method_impls_agree():
    q, k = structured_qk(1, 2, 1, 300, 16, seed=4, dtype=torch.float16, device=DEVICE)
    fields = {"block_size": 32, "ratio": 0.2, "window_blocks": 2}
    got = methods.build("quest", impl="triton", **fields).select(q, k)
    want = methods.build("quest", impl="torch", **fields).select(q, k)
    check_layout(got.kv_count, got.kv_indices)
    m = got.kv_count.shape[-1]
    kmin, kmax = box_stats_ref(k, 32)
    forced = forced_mask(m, 2, 2, 2, DEVICE)
    near = boundary(box_scores_ref(q, kmin, kmax, 32), 0.2, forced, EPS)
    assert_same_sets(got.mask(), want.mask(), near)
    assert 0 < got.density() < 1


# ---------------------------------------------------------------------- without the interpreter


def test_box_stats_match_ref():
    k = torch.randn(2, 3, 300, 8).to(torch.bfloat16)
    for bs in (1, 64, 128, 300, 512):
        kmin, kmax = box_stats(k, bs)
        kmin0, kmax0 = box_stats_ref(k, bs)
        assert kmin.dtype == torch.bfloat16
        assert torch.equal(kmin.float(), kmin0) and torch.equal(kmax.float(), kmax0)


def test_top_counts():
    assert top_counts(31, 0.1).tolist()[:4] == [0, 1, 1, 1] and top_counts(31, 0.1)[30] == 3
    assert top_counts(5, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert top_counts(5, 0.0).tolist() == [0, 1, 1, 1, 1]


@pytest.mark.skipif(INTERPRET or CUDA, reason="checks the CPU error without the interpreter")
def test_triton_impl_on_cpu_needs_interpreter():
    q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 1, 256, 16)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        methods.build("quest", impl="triton").select(q, k)
    assert methods.build("quest").select(q, k).density() == 1.0  # auto: the reference on CPU


def test_impl_is_validated():
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton; got 'cuda'"):
        methods.build("quest", impl="cuda")
    sel = methods.build("quest")
    assert sel.impl == "auto" and dataclasses.replace(sel, impl="torch").impl == "torch"


@pytest.mark.skipif(INTERPRET, reason="runs once, outside the interpreter suite")
def test_kernels_import_without_triton():
    """Both baselines' kernel modules (this file's and xattn's) import and fall back without it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from rbs_bench.kernels.quest_select import quest_select, box_stats\n"
        "from rbs_bench.kernels.xattn_select import xattn_select\n"
        "from rbs_bench import methods\n"
        "q, k = torch.randn(1, 2, 300, 16), torch.randn(1, 1, 300, 16)\n"
        "for name in ('quest', 'xattn'):\n"
        "    print(methods.build(name, block_size=32).select(q, k).density() > 0)\n"
        "for call in (lambda: quest_select(q, *box_stats(k, 32), 32, 0.1, 2, 4, 2),\n"
        "             lambda: xattn_select(q, k, 64, 16, 0.9)):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines() == [
        "True",
        "True",
        "quest_select needs Triton, which is not installed; use quest_select_ref",
        "xattn_select needs Triton, which is not installed; use xattn_select_ref",
    ]


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-m", "not gpu", at_least=8)


# ------------------------------------------------------------------------------- GPU, bf16, large


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [16384, 65536])
def test_gpu_triton_matches_torch_bf16(n):
    from rbs_bench import synthetic

    data = synthetic.generate(1, 8, 2, n, 128, seed=1, device="cuda", dtype=torch.bfloat16)
    q, k = data.q, data.k
    kmin, kmax = box_stats(k, 128)
    got_scores = box_scores(q, kmin, kmax, 128)
    want_scores = box_scores_ref(q, *box_stats_ref(k, 128), 128)
    m = kmin.shape[2]
    low = torch.ones(m, m, dtype=torch.bool, device="cuda").tril(-1)
    err = (got_scores - want_scores)[..., low].abs().max().item()
    assert err < 1e-3 * want_scores[..., low].abs().max().item()
    forced = forced_mask(m, 2, 4, 2, "cuda")
    for ratio in (0.05, 0.2):
        sel = methods.build("quest", ratio=ratio)
        got = dataclasses.replace(sel, impl="triton").select(q, k)
        want = dataclasses.replace(sel, impl="torch").select(q, k)
        check_layout(got.kv_count, got.kv_indices)
        near = boundary(want_scores, ratio, forced, max(EPS, 4 * err))
        assert_same_sets(got.mask(), want.mask(), near, f"ratio {ratio}")
        assert abs(got.density() - want.density()) < 1e-3
