"""The fused selection kernels against their PyTorch references, and the methods' two impls.

Selections are compared as sets per (b, h, query block); a block whose reference score sits within
EPS of its branch threshold (log space) is excluded and counted. EPS is 1e-3, or twice the score
error that rounding the centred centroids to fp16 (what the kernel's dot product reads) causes in
the PyTorch reference, if larger.

Triton's CPU interpreter is chosen when triton decorates functions, its own library included, so
TRITON_INTERPRET=1 must be set before triton is imported, and other test modules import it first.
On a machine without CUDA, `test_interpreter_suite` therefore runs this file again in a fresh
Python with TRITON_INTERPRET=1; there the kernel tests run on CPU tensors. With CUDA they run on
the GPU directly.
"""

from __future__ import annotations

import math
import subprocess
import sys

import interpreter_suite
import pytest
import torch
from conftest import assert_same_sets, structured_qk, within
from interpreter_suite import CUDA, DEVICE, check_layout, kernel_test, lists_to_mask
from rbs_bench.kernels.block_masks import candidate_mask, forced_mask
from rbs_bench.kernels.block_scores import block_scores_ref
from rbs_bench.kernels.block_stats import block_stats, block_stats_ref, rescue_beta, rescue_beta_ref
from rbs_bench.kernels.rbs_select import _launch, centred_centroids, rbs_select, rbs_select_ref
from rbs_bench.kernels.triton_util import INTERPRET, triton_available

from rbs_bench import methods

EPS = 1e-3
FLOATS = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def boundary(q, centroid, uplift, bs, alphas, branches, forced, scale=None):
    """bool [B, H, M, M]: candidates within eps of a branch threshold (not forced); and eps."""
    use = {"both": (True, True), "base": (True, False), "rescue": (False, True)}[branches]
    uplifts = [u for u, on in zip((None, uplift), use) if on]
    alphas = [a for a, on in zip(alphas, use) if on]
    scores = block_scores_ref(q, centroid, uplifts, bs, scale)
    m = centroid.shape[2]
    cand = candidate_mask(m, q.device)
    eps = EPS
    if q.dtype != torch.float32:  # the kernel's dot product reads fp16 centred centroids
        mean, res = centred_centroids(centroid, torch.float16)
        rounded = block_scores_ref(q, mean[:, :, None] + res.float(), uplifts, bs, scale)
        for s, r in zip(scores, rounded):
            err = (s - r).abs().masked_fill(~cand, 0).max().item()
            eps = max(eps, 2 * err)
    near = torch.zeros(*scores[0].shape, dtype=torch.bool, device=q.device)
    for s, alpha in zip(scores, alphas):
        row_max = s.masked_fill(~cand, -math.inf).amax(-1, keepdim=True)
        thr = row_max + (math.log(alpha) if alpha > 0 else -math.inf)
        near |= cand & within(s, (thr,), eps)
    return near & ~forced, eps


# --------------------------------------------------------------------------------- block_stats


@kernel_test
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "n,bs,d", [(1, 32, 64), (127, 64, 64), (128, 64, 128), (129, 64, 64), (1000, 128, 128)]
)
def test_block_stats_matches_ref(n, bs, d, dtype):
    k = structured_qk(2, 2, 2, n, d, seed=n, dtype=dtype, kind="needles", device=DEVICE)[1]
    c, r = block_stats(k, bs)
    c0, r0 = block_stats_ref(k, bs)
    assert c.dtype == r.dtype == torch.float32
    assert c.shape == c0.shape and r.shape == r0.shape
    torch.testing.assert_close(c, c0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r, r0, atol=1e-4, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("m", [1, 2, 7, 11, 100] + ([1000] if DEVICE == "cuda" else []))
def test_rescue_beta_matches_ref(m):
    g = torch.Generator().manual_seed(m)
    r = (torch.rand(2, 3, m, generator=g) * 3).to(DEVICE)
    r[1, 2] = 2.0  # a degenerate head: q90 == q50, beta = 0
    beta = rescue_beta(r)
    torch.testing.assert_close(beta, rescue_beta_ref(r), atol=1e-6, rtol=0)
    assert not beta[1, 2].any()
    ramp = torch.arange(11.0, device=DEVICE).view(1, 1, 11)  # q50 = 5, q90 = 9
    torch.testing.assert_close(rescue_beta(ramp)[0, 0], ((ramp[0, 0] - 5) / 4).clamp(0, 1))


# ---------------------------------------------------------------------------------- rbs_select

# (B, Hq, Hkv, N, D, block, dtype, branches, alpha_base, alpha_rescue, sink, window, last_q)
CASES = [
    (1, 2, 2, 1, 64, 32, torch.float32, "both", 0.22, 0.18, 2, 4, 2),
    (1, 4, 1, 127, 128, 32, torch.float16, "both", 0.22, 0.18, 1, 1, 0),
    (1, 8, 1, 128, 64, 64, torch.float32, "base", 0.22, 0.18, 2, 4, 2),
    (1, 8, 2, 129, 128, 32, torch.float32, "rescue", 0.22, 0.18, 0, 1, 0),
    (1, 4, 1, 1000, 64, 64, torch.float32, "both", 0.22, 0.18, 2, 4, 2),
    (1, 8, 1, 640, 128, 64, torch.float16, "both", 0.5, 0.05, 1, 2, 1),
    (1, 2, 2, 1000, 64, 32, torch.float16, "both", 0.6, 0.3, 1, 1, 0),
    (1, 1, 1, 1000, 64, 32, torch.float32, "rescue", 0.9, 0.9, 0, 0, 0),
    (2, 2, 1, 300, 64, 32, torch.float32, "both", 0.0, 5.0, 0, 1, 0),
    (1, 2, 1, 500, 64, 48, torch.float32, "base", 0.3, 0.18, 1, 2, 1),
    (1, 2, 1, 700, 64, 32, torch.float32, "both", 1e-30, 0.18, 1, 2, 1),  # exact scores only
]


def _case_id(c):
    b, hq, hkv, n, d, bs, dt, br, *_ = c
    return f"B{b}-H{hq}/{hkv}-N{n}-D{d}-bs{bs}-{str(dt)[6:]}-{br}"


def _inputs(case, seed):
    b, hq, hkv, n, d, bs, dtype, branches, ab, ar, sink, win, last = case
    q, k = structured_qk(b, hq, hkv, n, d, seed, dtype=dtype, kind="needles", device=DEVICE)
    c, r = block_stats_ref(k, bs)
    uplift = r * rescue_beta_ref(r)
    args = (q, c, uplift, bs, ab, ar, sink, win, last)
    forced = forced_mask(c.shape[2], sink, win, last, q.device)
    near, _ = boundary(q, c, uplift, bs, (ab, ar), branches, forced)
    return args, branches, near


@kernel_test
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_rbs_select_matches_ref(case):
    args, branches, near = _inputs(case, seed=case[3] + case[1])
    count, idx = rbs_select(*args, branches=branches)
    check_layout(count, idx)
    count0, idx0 = rbs_select_ref(*args, branches=branches)
    check_layout(count0, idx0)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)
    if not near.any():
        assert torch.equal(count, count0) and torch.equal(idx, idx0)


@kernel_test
def test_rbs_select_multi_tile_rows():
    """Rows longer than one key tile: per-tile maxima, the row buffer and the cross-tile offsets."""
    case = (1, 1, 1, 600, 64, 16, torch.float32, "both", 0.22, 0.18, 2, 4, 2)  # M = 38, 3 tiles
    args, branches, near = _inputs(case, seed=7)
    count, idx = _launch(*args, None, branches, block_k=16)
    check_layout(count, idx)
    count0, idx0 = rbs_select_ref(*args, branches=branches)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)


@kernel_test
@pytest.mark.parametrize("branches", ["both", "base", "rescue"])
def test_rbs_select_two_pass_scores_few_blocks_exactly(branches):
    """On structured inputs pass two scores a minority of the candidates and the selection
    stays the reference's; one pass scores them all."""
    from rbs_bench import synthetic

    data = synthetic.generate(1, 2, 1, 4096, 64, seed=13, device=DEVICE)
    bs, sink, win, last = 64, 1, 2, 1
    c, r = block_stats_ref(data.k, bs)
    uplift = r * rescue_beta_ref(r)
    args = (data.q, c, uplift, bs, 0.22, 0.18, sink, win, last)
    forced = forced_mask(c.shape[2], sink, win, last, data.q.device)
    near, _ = boundary(data.q, c, uplift, bs, (0.22, 0.18), branches, forced)
    count0, idx0 = rbs_select_ref(*args, branches=branches)
    stats = {}
    for two_pass in (True, False):
        stats[two_pass] = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        count, idx = _launch(
            *args, None, branches, block_k=16, two_pass=two_pass, stats=stats[two_pass]
        )
        check_layout(count, idx)
        assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)
    candidates, exact, bounded = stats[True].tolist()
    m = c.shape[2]
    assert candidates == 2 * sum(range(sink + win, m - last))  # the scored rows' candidates
    assert 0 < exact < candidates / 2 and bounded == 0
    assert stats[False].tolist() == [candidates, candidates, 0]


@kernel_test
@pytest.mark.parametrize("family", ["synthetic", "needles"])
def test_rescue_bound_skips_tiles_and_keeps_the_same_blocks(family):
    """Rescue scores taken from their bounds where a tile lies below the running threshold: on
    structured inputs some tiles are skipped, and the kept blocks are exactly those of the
    launch that scores every tile."""
    from rbs_bench import synthetic

    data = synthetic.generate(
        1, 2, 1, 4096, 64, structure=synthetic.FAMILIES[family], seed=17, device=DEVICE
    )
    c, r = block_stats_ref(data.k, 64)
    args = (data.q, c, r * rescue_beta_ref(r), 64, 0.22, 0.18, 1, 2, 1)
    got = {}
    for bound in (False, True):
        stats = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        count, idx = _launch(*args, None, "both", block_k=16, rescue_bound=bound, stats=stats)
        got[bound] = (count, idx, stats.tolist())
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    candidates, exact, bounded = got[True][2]
    assert got[False][2] == [candidates, candidates, 0]
    assert 0 < bounded < candidates / 2  # only uplifted blocks (about half) can be bounded


# the selector variant with asynchronous wgmma (an inlined row, no register cap, two programs per
# SM, one stage), the mean-centroid offset and the special-function unit's log2
INLINED_UNCAPPED = dict(
    call=False, maxnreg=None, per_sm=2, num_stages=1, offset="mean", fast_log=True
)


@kernel_test
@pytest.mark.parametrize(
    "opts",
    [
        dict(two_pass=False),
        dict(fast=True),
        dict(share=False),
        dict(share=False, two_pass=False),
        dict(per_sm=1),
        dict(call=False),
        dict(offset="mean"),
        dict(offset="mean", fast=True),
        dict(fast_log=True),
        INLINED_UNCAPPED,
        dict(rescue_bound=True),
        dict(rescue_bound=True, fast=True),
        dict(rescue_bound=True, offset="mean", fast_log=True),
    ],
    ids=[
        "one-pass",
        "one-pass-fast",
        "no-share",
        "no-share-one-pass",
        "one-program",
        "inlined",
        "mean-offset",
        "mean-offset-fast",
        "fast-log",
        "inlined-uncapped-fast-log",
        "rescue-bound",
        "rescue-bound-fast",
        "rescue-bound-mean-offset-fast-log",
    ],
)
def test_rbs_select_launch_options(opts):
    """One exact pass, one offset per row, no zero-uplift sharing, a single persistent program,
    the row inlined, the mean-centroid offset, the approximate log2 of each block's sum (the
    interpreter keeps the exact one), and those together uncapped."""
    case = (1, 2, 1, 600, 64, 16, torch.float16, "both", 0.22, 0.18, 2, 4, 2)  # M = 38, 3 tiles
    args, branches, near = _inputs(case, seed=5)
    count, idx = _launch(*args, None, branches, block_k=16, **opts)
    check_layout(count, idx)
    count0, idx0 = rbs_select_ref(*args, branches=branches)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)


@kernel_test
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(two_pass=False), dict(fast=True), dict(fast=True, offset="mean")],
    ids=["two-pass", "one-pass", "fast", "fast-mean-offset"],
)
@pytest.mark.parametrize("branches", ["both", "rescue"])
def test_rbs_select_huge_logits(branches, opts):
    """Scores far above the row's offset (fp32 overflow: the exact redo) and far below it."""
    case = (1, 2, 1, 640, 64, 64, torch.float32, branches, 0.22, 0.18, 1, 1, 0)
    (q, c, u, bs, *rest), _, _ = _inputs(case, seed=9)
    v = torch.randn(64, generator=torch.Generator().manual_seed(9))
    v = v / v.norm()
    q = q + 3 * v.to(q.device)  # every query leans to v; block 5 along it, block 7 against it
    c = c.clone()
    c[:, :, 5] += 10 * v.to(c.device)
    c[:, :, 7] -= 10 * v.to(c.device)
    args = (q, c, u, bs, *rest)
    scale = 4.0  # logits in the hundreds
    scores = block_scores_ref(q, c, [None], bs, scale)[0] * math.log2(math.e)
    block0 = (q.float() @ c[0, 0, 0] * scale * math.log2(math.e)).view(1, 2, -1, bs).amax(-1)
    gap = (scores - block0[..., None]).masked_fill(~candidate_mask(c.shape[2], q.device), 0)
    assert gap.amax() > 150 and gap.amin() < -150  # beyond fp32's range around the row offset
    count, idx = _launch(*args, scale, branches, **opts)
    check_layout(count, idx)
    count0, idx0 = rbs_select_ref(*args, scale=scale, branches=branches)
    forced = forced_mask(c.shape[2], 1, 1, 0, q.device)
    near, _ = boundary(q, c, u, bs, (0.22, 0.18), branches, forced, scale=scale)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)


@kernel_test
def test_rbs_select_scale_and_bad_input():
    case = (1, 2, 1, 640, 64, 64, torch.float32, "both", 0.22, 0.18, 2, 4, 2)
    args, _, _ = _inputs(case, seed=3)
    q, c, u, bs, *rest = args
    count, idx = rbs_select(*args, scale=0.05)
    count0, idx0 = rbs_select_ref(*args, scale=0.05)
    forced = forced_mask(c.shape[2], 2, 4, 2, q.device)
    near, _ = boundary(q, c, u, bs, (0.22, 0.18), "both", forced, scale=0.05)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near)
    with pytest.raises(ValueError, match="branches must be one of"):
        rbs_select(*args, branches="neither")
    with pytest.raises(ValueError, match="needs uplift_rescue"):
        rbs_select(q, c, None, bs, *rest)
    with pytest.raises(ValueError, match="centroid must be"):
        rbs_select(q, c[:, :, :-1], u, bs, *rest)
    count, _ = rbs_select(q, c, None, bs, *rest, branches="base")  # base needs no uplift
    assert count.shape == q.shape[:2] + (c.shape[2],)


# --------------------------------------------------------------- the methods' impl="triton" path


@kernel_test
@pytest.mark.parametrize("name", ["rbs", "centroid", "full_l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_methods_triton_matches_torch(name, dtype):
    q, k = structured_qk(1, 4, 2, 777, 64, seed=11, dtype=dtype, kind="needles", device=DEVICE)
    fields = {"block_size": 64}
    got = methods.build(name, impl="triton", **fields).select(q, k)
    want = methods.build(name, impl="torch", **fields).select(q, k)
    assert got.kv_indices.shape == want.kv_indices.shape
    check_layout(got.kv_count, got.kv_indices)
    sel = methods.build(name, **fields)
    c, r = block_stats_ref(k, 64)
    uplift = r * rescue_beta_ref(r) if name == "rbs" else r
    alphas = (sel.alpha_base, sel.alpha_rescue) if name == "rbs" else (sel.alpha, sel.alpha)
    branches = {"rbs": "both", "centroid": "base", "full_l2": "rescue"}[name]
    forced = forced_mask(c.shape[2], sel.sink_blocks, sel.window_blocks, sel.last_q_blocks)
    near, _ = boundary(q, c, uplift, 64, alphas, branches, forced.to(q.device))
    assert_same_sets(got.mask(), want.mask(), near, name)
    assert 0 < got.density() < 1


# ---------------------------------------------------------------------- without the interpreter


@pytest.mark.skipif(INTERPRET or CUDA, reason="checks the CPU error without the interpreter")
def test_triton_impl_on_cpu_needs_interpreter():
    q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 1, 256, 16)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        methods.build("rbs", impl="triton").select(q, k)
    if triton_available():
        with pytest.raises(ValueError, match="block_stats needs CUDA tensors"):
            block_stats(k, 64)
    # auto falls back to the PyTorch path on CPU
    assert methods.build("rbs").select(q, k).density() == 1.0


def test_impl_is_validated():
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton; got 'cuda'"):
        methods.build("centroid", impl="cuda")
    assert methods.build("rbs").impl == "auto"


def test_kernels_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from rbs_bench.kernels.rbs_select import rbs_select\n"
        "from rbs_bench import methods\n"
        "q, k = torch.randn(1, 2, 300, 16), torch.randn(1, 1, 300, 16)\n"
        "print(methods.build('rbs', block_size=64).select(q, k).density())\n"
        "try:\n"
        "    rbs_select(q, torch.zeros(1, 1, 5, 16), None, 64, 0.2, 0.2, 2, 4, 2)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert float(lines[0]) == 1.0
    assert lines[1] == "rbs_select needs Triton, which is not installed; use rbs_select_ref"


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-m", "not gpu", at_least=20)


# ------------------------------------------------------------------------------- GPU, bf16, large


def _gpu_qk(n: int, family: str, seed: int):
    """bf16 q [1, 8, n, 128] and k [1, 2, n, 128] on the GPU of one synthetic input family."""
    from rbs_bench import synthetic

    data = synthetic.generate(
        1, 8, 2, n, 128, structure=synthetic.FAMILIES[family], seed=seed, device="cuda",
        dtype=torch.bfloat16,
    )  # fmt: skip
    return data.q, data.k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "n, family", [(16384, "synthetic"), (65536, "synthetic"), (16384, "needles")]
)
def test_gpu_triton_matches_torch_bf16(n, family):
    q, k = _gpu_qk(n, family, seed=1)
    c, r = block_stats(k, 128)
    c0, r0 = block_stats_ref(k, 128)
    torch.testing.assert_close(c, c0, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(r, r0, atol=1e-3, rtol=1e-5)
    for name in ("rbs", "centroid", "full_l2"):
        sel = methods.build(name)
        got = methods.build(name, impl="triton").select(q, k)
        want = methods.build(name, impl="torch").select(q, k)
        check_layout(got.kv_count, got.kv_indices)
        uplift = r0 * rescue_beta_ref(r0) if name == "rbs" else r0
        alphas = (sel.alpha_base, sel.alpha_rescue) if name == "rbs" else (sel.alpha, sel.alpha)
        branches = {"rbs": "both", "centroid": "base", "full_l2": "rescue"}[name]
        forced = forced_mask(c0.shape[2], 2, 4, 2, q.device)
        near, eps = boundary(q, c0, uplift, 128, alphas, branches, forced)
        assert_same_sets(got.mask(), want.mask(), near, f"{name} (eps {eps:.1e})")
        assert abs(got.density() - want.density()) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "opts",
    [dict(fast_log=True), INLINED_UNCAPPED, dict(rescue_bound=True)],
    ids=["fast-log", "inlined", "rescue-bound"],
)
@pytest.mark.parametrize("n, family", [(16384, "synthetic"), (32768, "needles")])
def test_gpu_selector_variants_match_torch_bf16(opts, n, family):
    """The launch variants the benchmark times select what the reference selects (blocks within
    the fp16 dot's error of a threshold excepted)."""
    q, k = _gpu_qk(n, family, seed=2)
    c, r = block_stats_ref(k, 128)
    u = r * rescue_beta_ref(r)
    args = (q, c, u, 128, 0.22, 0.18, 2, 4, 2)
    count, idx = _launch(*args, None, "both", **opts)
    check_layout(count, idx)
    count0, idx0 = rbs_select_ref(*args)
    forced = forced_mask(c.shape[2], 2, 4, 2, q.device)
    near, eps = boundary(q, c, u, 128, (0.22, 0.18), "both", forced)
    assert_same_sets(lists_to_mask(count, idx), lists_to_mask(count0, idx0), near, f"eps {eps:.1e}")
