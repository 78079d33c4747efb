"""Block-FP8 linear layers: the references against an independent fp64 computation, the Triton
kernels against the references.

The references are checked on the CPU against a computation written here block by block and
row by row (explicit loops over weight blocks and activation groups, fp64 products), and against
the quantisation's own error bound. The kernel tests run on a CUDA GPU with fp8 tensor cores
(capability 8.9 or newer), or on the CPU in a fresh Python with TRITON_INTERPRET=1
(`test_interpreter_suite`, fp32/fp16 inputs, small shapes). Triton's interpreter multiplies e4m3
tiles exactly but rounds fp32 -> e4m3 casts with ties away from zero and without carrying into the
exponent; the kernels therefore round to the e4m3 grid themselves when interpreted
(`_e4m3_rne`), which `test_e4m3_rounding_matches_torch` checks value by value against torch's
cast (the GPU's own cast rounds to nearest even, as torch's does).

Tolerance: the kernel must be far closer to the reference than the reference is to the
unquantised product: per row, ||kernel - ref|| <= 2 ||round(ref) - ref|| + 0.05 ||ref - truth||,
with round() the output dtype's rounding of the fp32 reference and truth the fp64 product of the
unquantised activations and the dequantised weight. The kernels quantise exactly as the
reference does (IEEE division, `test_kernel_act_quant_matches_reference`). On a GPU the bound
adds the tensor cores' accumulation, `ACCUMULATION` x ||(|x| @ |W|^T)|| per row: under the
interpreter the e4m3 products are exact, on a GPU they are not (see `ACCUMULATION`).
"""

from __future__ import annotations

import math

import interpreter_suite
import pytest
import torch
from interpreter_suite import CUDA, DEVICE, kernel_test
from rbs_bench.kernels import fp8_gemm
from rbs_bench.kernels.fp8_gemm import (
    FP8_DTYPE,
    act_quant_ref,
    dequantize_weight_ref,
    fp8_act_quant,
    fp8_batched_linear,
    fp8_batched_linear_ref,
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)
from rbs_bench.kernels.triton_util import INTERPRET

FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)
# The fp8 tensor cores add each k = 32 step of a product into an accumulator that keeps about 14
# bits, and the kernels (and cuBLAS's block-scaled product) promote it to fp32 once per 128-wide K
# group, after four steps. One rounding of the running sum per step puts a product at most about
# 4 x 2^-13 = 2^-11 of sum_k |a_k w_k| from the exact sum of its quantised terms. The interpreter
# multiplies e4m3 tiles exactly, so the term is zero there.
ACCUMULATION = 2.0**-11 if DEVICE == "cuda" else 0.0
fp8_kernel_test = pytest.mark.skipif(
    DEVICE == "cuda" and not FP8_GPU, reason="fp8 tensor cores need capability 8.9 or newer"
)


def quantized_weight(shape, block, seed=0, device="cpu"):
    """(e4m3 weight [..., N, K], fp32 scales per block) of a random weight, quantised per block
    as checkpoints are (block max -> 448)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    w = torch.randn(*shape, generator=gen) * 0.05
    w[..., : n // 3, :] *= 8  # blocks with different ranges
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    pad = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    amax = pad.abs().reshape(*lead, nb, bn, kb, bk).amax((-3, -1))
    s = amax.clamp_min(1e-12) / 448.0
    full = s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    wq = (w / full).clamp(-448, 448).to(FP8_DTYPE)
    return wq.to(device), s.float().to(device)


def activations(m, k, seed=1, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    if m > 2:
        x[1] *= 50  # a row with a large range, one with a tiny one
        x[2] *= 1e-3
    if k > 5:
        x[:, 5] *= 20  # an outlier channel, as activations have
    return x.to(device, dtype)


# ---------------------------------------------------------------- references (CPU, independent)


def loop_linear(x, wq, s, block, act_scale=None):
    """fp64 y = dequant(x) @ dequant(W).T, one weight block and one activation group at a time."""
    m, k = x.shape
    n = wq.shape[0]
    bn, bk = block if block is not None else (n, k)
    group = bk if block is not None else 128
    w = torch.zeros(n, k, dtype=torch.float64)
    for i in range(math.ceil(n / bn)):
        for j in range(math.ceil(k / bk)):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scale = float(s.reshape(-1)[0]) if block is None else float(s[i, j])
            w[rows, cols] = wq[rows, cols].double() * scale
    xd = torch.zeros(m, k, dtype=torch.float64)
    for r in range(m):
        for g in range(math.ceil(k / group)):
            cols = slice(g * group, (g + 1) * group)
            v = x[r, cols].float()
            if act_scale is None:
                scale = max(float(v.abs().max()), 1e-10) / 448.0
            else:
                scale = float(act_scale)
            q = torch.clamp(v / scale, -448, 448).to(FP8_DTYPE)
            xd[r, cols] = q.double() * scale
    return xd @ w.T


@pytest.mark.parametrize(
    "m, n, k, block",
    [(1, 16, 128, (128, 128)), (7, 300, 384, (128, 128)), (5, 130, 200, (128, 128)),
     (9, 96, 256, (32, 64)), (4, 40, 300, None)],
)  # fmt: skip
def test_reference_matches_blockwise_loops(m, n, k, block):
    wq, s = quantized_weight((n, k), block or (n, k), seed=n)
    if block is None:
        s = s.reshape(())
    x = activations(m, k, seed=k)
    ref = fp8_linear_ref(x, wq, s, block, out_dtype=torch.float32)
    want = loop_linear(x, wq, s, block)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_reference_static_activation_scale():
    wq, s = quantized_weight((64, 256), (128, 128))
    x = activations(6, 256)
    scale = torch.tensor(0.05)
    ref = fp8_linear_ref(x, wq, s, (128, 128), activation_scale=scale, out_dtype=torch.float32)
    want = loop_linear(x, wq, s, (128, 128), act_scale=0.05)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_reference_exact_on_the_grid():
    """Activations that are e4m3 values times a per-group scale whose group maximum is 448 times
    it quantise losslessly: the reference is then the exact product (to fp32 rounding)."""
    gen = torch.Generator().manual_seed(3)
    m, k = 5, 256
    grid = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8).view(FP8_DTYPE)
    grid = grid.float().nan_to_num(0.0)
    grid[:, ::128] = 448.0  # each group's maximum
    scales = torch.rand(m, 2, generator=gen) * 0.1 + 0.01
    x = grid * scales.repeat_interleave(128, 1)
    q, s = act_quant_ref(x, 128)
    torch.testing.assert_close(s, scales, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), grid)
    wq, ws = quantized_weight((48, k), (128, 128))
    exact = x.double() @ dequantize_weight_ref(wq, ws, (128, 128)).double().T
    got = fp8_linear_ref(x, wq, ws, (128, 128), out_dtype=torch.float32)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max())


def test_reference_error_within_the_e4m3_bound():
    """|ref - unquantised| <= 2^-4 (|x| @ |W|^T): e4m3 keeps 3 fraction bits (half an ulp is at
    most 2^-4 relative), and only the activations are quantised against the dequantised W."""
    wq, s = quantized_weight((200, 384), (128, 128))
    x = activations(50, 384)
    w = dequantize_weight_ref(wq, s, (128, 128)).double()
    truth = x.double() @ w.T
    bound = 2.0**-4 * (x.double().abs() @ w.abs().T)
    err = (fp8_linear_ref(x, wq, s, (128, 128), out_dtype=torch.float32).double() - truth).abs()
    assert bool((err <= bound + 1e-6).all()), float((err - bound).max())


def test_grouped_and_batched_references_match_the_linear_one():
    e, n, k = 5, 96, 256
    wq, s = quantized_weight((e, n, k), (128, 128))
    counts = [3, 0, 7, 0, 4]  # empty experts, then 2 rows past the last expert
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = activations(sum(counts) + 2, k, dtype=torch.float16)
    got = fp8_grouped_linear_ref(x, wq, s, offsets, (128, 128))
    start = 0
    for i, c in enumerate(counts):
        want = fp8_linear_ref(x[start : start + c], wq[i], s[i], (128, 128))
        assert torch.equal(got[start : start + c], want)
        start += c
    assert bool((got[start:] == 0).all())
    ids = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    ids = torch.cat([ids, torch.tensor([e, e + 3])])  # ids of no expert here
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
    batched = fp8_batched_linear_ref(x[perm], wq, s, ids[perm], (128, 128))
    assert torch.equal(batched, got[perm])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda w, s, x: (x, w.float(), s), "float8_e4m3fn"),
        (lambda w, s, x: (x, w, s[:, :1]), "weight_scale_inv must be"),
        (lambda w, s, x: (x[:, :100], w, s), "last dim"),
        (lambda w, s, x: (x.to(torch.int32), w, s), "bfloat16, float16 or float32"),
        (lambda w, s, x: (x, w, s.double()), "float32"),
    ],
)
def test_bad_inputs_one_line(make, message):
    wq, s = quantized_weight((64, 256), (128, 128))
    x = activations(3, 256)
    with pytest.raises(ValueError, match=message):
        fp8_linear_ref(*make(wq, s, x), (128, 128))
    with pytest.raises(ValueError, match=message):
        fp8_linear(*make(wq, s, x), (128, 128))


def test_bad_grouped_inputs_one_line():
    wq, s = quantized_weight((4, 64, 256), (128, 128))
    x = activations(6, 256)
    with pytest.raises(ValueError, match="offsets must be"):
        fp8_grouped_linear(x, wq, s, torch.tensor([1, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_ids must be"):
        fp8_batched_linear(x, wq, s, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_size must be"):
        fp8_grouped_linear(x, wq, s, torch.tensor([1, 2, 3, 6]), (128, 100))


# ---------------------------------------------------------------- kernels vs references


def exact_products(x, w, rows=None):
    """fp64 (truth, magnitude) [M, N]: x @ w.T and |x| @ |w|.T of the dequantised weight w
    [N, K]; or, w [E, N, K], each expert's over its rows (rows[e]: a slice or an index tensor;
    other rows zero)."""
    xd = x.double()
    if rows is None:
        wd = w.double()
        return xd @ wd.T, xd.abs() @ wd.abs().T
    truth = torch.zeros(x.shape[0], w.shape[-2], dtype=torch.float64, device=x.device)
    magnitude = torch.zeros_like(truth)
    for e, r in enumerate(rows):
        wd = w[e].double()
        truth[r] = xd[r] @ wd.T
        magnitude[r] = xd[r].abs() @ wd.abs().T
    return truth, magnitude


def assert_rows_close(got, ref32, truth, magnitude=None):
    """Per row: ||got - ref|| <= 2 ||round(ref) - ref|| + 0.05 ||ref - truth|| (+ fp32 slack),
    plus on a GPU the accumulation term ACCUMULATION x ||magnitude|| (|x| @ |W|^T, where given);
    a non-finite value in got fails the row (NaN compares false), one in ref or truth the test."""
    ref, truth_ = ref32.double(), truth.double()
    assert bool(torch.isfinite(ref).all() and torch.isfinite(truth_).all()), "reference not finite"
    err = (got.double() - ref).norm(dim=-1)
    rounding = (ref32.to(got.dtype).double() - ref).norm(dim=-1)
    tol = 2 * rounding + 0.05 * (ref - truth_).norm(dim=-1) + 1e-6 * ref.norm(dim=-1) + 1e-30
    if magnitude is not None:
        tol = tol + ACCUMULATION * magnitude.double().norm(dim=-1)
    bad = ~(err <= tol)
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} rows off; worst err {float((err / tol).max()):.3g}x tol"
    )


def check_linear(m, n, k, block, dtype, fused=False, static=None, seed=0, out_dtype=None):
    dev = DEVICE
    wq, s = quantized_weight((n, k), block or (n, k), seed=seed, device=dev)
    if block is None:
        s = s.reshape(())
    x = activations(m, k, seed=seed + 1, dtype=dtype, device=dev)
    scale = None if static is None else torch.tensor(static, device=dev)
    out_dtype = out_dtype or dtype
    if fused:
        got = fp8_gemm._launch(x, wq, s, block, None, scale, out_dtype, fused=True)
    else:
        got = fp8_linear(x, wq, s, block, scale, out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    ref32 = fp8_linear_ref(x, wq, s, block, scale, torch.float32)
    assert_rows_close(got, ref32, *exact_products(x, dequantize_weight_ref(wq, s, block)))
    return got


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize("m", [1, 127, 129, 1000])
def test_kernel_linear_matches_reference(m):
    check_linear(m, 300, 384, (128, 128), torch.float16, seed=m)


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize(
    "m, n, k, block, dtype, fused, static",
    [
        (129, 130, 200, (128, 128), torch.float32, False, None),  # K tail: a partial last block
        (65, 96, 256, (32, 64), torch.float16, False, None),  # other blocks, group 64
        (70, 150, 256, (48, 128), torch.float16, False, None),  # a scale per column of a tile
        (33, 40, 300, None, torch.float32, False, None),  # per-tensor weight
        (130, 260, 256, (128, 128), torch.float16, False, 0.02),  # static activation scale
        (129, 300, 384, (128, 128), torch.float16, True, None),  # quantised inside the product
        (127, 130, 200, (128, 128), torch.float32, True, None),
    ],
)
def test_kernel_linear_variants(m, n, k, block, dtype, fused, static):
    check_linear(m, n, k, block, dtype, fused=fused, static=static, seed=n + k)


@kernel_test
@fp8_kernel_test
def test_kernel_linear_leading_dims_and_out_dtype():
    wq, s = quantized_weight((64, 256), (128, 128), device=DEVICE)
    x = activations(2 * 3 * 7, 256, device=DEVICE, dtype=torch.float16).view(2, 3, 7, 256)
    got = fp8_linear(x, wq, s, (128, 128), out_dtype=torch.float32)
    assert got.shape == (2, 3, 7, 64) and got.dtype == torch.float32
    want = fp8_linear(x.reshape(-1, 256), wq, s, (128, 128), out_dtype=torch.float32)
    assert torch.equal(got.reshape(-1, 64), want)


@kernel_test
@fp8_kernel_test
def test_kernel_act_quant_matches_reference():
    x = activations(70, 300, dtype=torch.float16, device=DEVICE)
    q, s = fp8_act_quant(x, 128)
    q_ref, s_ref = act_quant_ref(x, 128)
    # IEEE division in the kernel, as in torch: the same scales and the same bytes, exactly
    assert torch.equal(s.T, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@kernel_test
@fp8_kernel_test
def test_e4m3_rounding_matches_torch():
    """Every e4m3 value, every midpoint between neighbours (ties), values beyond 448, tiny ones
    and a spread of random ones: the kernel's quantised values equal torch's cast, exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = codes[codes.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(4000, generator=gen) * s for s in (1e-3, 1.0, 100.0)])
    extra = torch.tensor([0.0, -0.0, 448.5, 460.0, -1e6, 1e-9, 2.0**-10, 3 * 2.0**-11])
    x = torch.cat([grid, mids, rand, extra])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 128)).view(-1, 128)
    q, _ = fp8_act_quant(x.to(DEVICE), 128, torch.tensor(1.0, device=DEVICE))
    want = x.clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(q.cpu().float(), want.float())


def expert_slices(offsets):
    """Each expert's rows of the sorted layout, as slices, from the cumulative row ends."""
    ends = offsets.tolist()
    return [slice(lo, hi) for lo, hi in zip([0, *ends[:-1]], ends)]


def routed(counts, tail, k, dtype, seed):
    x = activations(sum(counts) + tail, k, seed=seed, dtype=dtype, device=DEVICE)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    return x, offsets


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize(
    "counts, tail, n, k, dtype",
    [
        ([3, 0, 40, 0, 1, 129], 0, 96, 256, torch.float16),  # empty experts, partial tiles
        ([0, 0, 200, 0], 5, 130, 200, torch.float32),  # one expert takes every row; a tail
        ([1], 0, 40, 128, torch.float16),  # one row, one expert
        ([0, 0, 0], 3, 64, 128, torch.float32),  # no expert gets a row: all zeros
        ([37, 64, 1, 0, 90, 33, 7, 2], 0, 64, 384, torch.float16),
    ],
)
def test_kernel_grouped_matches_reference(counts, tail, n, k, dtype):
    e = len(counts)
    wq, s = quantized_weight((e, n, k), (128, 128), seed=n, device=DEVICE)
    x, offsets = routed(counts, tail, k, dtype, seed=k)
    got = fp8_grouped_linear(x, wq, s, offsets, (128, 128))
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    ref32 = fp8_grouped_linear_ref(x.float(), wq, s, offsets, (128, 128))
    rows = expert_slices(offsets)
    w = dequantize_weight_ref(wq, s, (128, 128))
    assert_rows_close(got, ref32, *exact_products(x, w, rows))
    assert bool((got[sum(counts) :] == 0).all()), "rows past the last expert must be zeros"


@kernel_test
@fp8_kernel_test
def test_kernel_grouped_fused_and_int64_offsets():
    counts = [50, 0, 7, 80]
    wq, s = quantized_weight((4, 72, 256), (128, 128), device=DEVICE)
    x, offsets = routed(counts, 2, 256, torch.float16, seed=5)
    want = fp8_grouped_linear(x, wq, s, offsets, (128, 128))
    fused = fp8_gemm._launch(x, wq, s, (128, 128), offsets.long(), fused=True)
    ref32 = fp8_grouped_linear_ref(x.float(), wq, s, offsets, (128, 128))
    err = lambda y: float((y.float() - ref32).norm() / ref32.norm())  # noqa: E731
    assert err(fused) <= 2 * err(want) + 1e-6


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize(
    "counts, tail, n, k",
    [
        ([3, 0, 40, 0, 1, 129], 2, 128, 256),  # empty experts, partial tiles, a tail
        ([0, 0, 0], 3, 128, 128),  # no expert gets a row: all zeros
        ([37, 64, 1, 0, 90, 33, 7, 2], 0, 256, 384),
    ],
)
def test_kernel_tma_form_matches_the_pointer_kernel(counts, tail, n, k):
    """The persistent TMA form (forced) against the pointer kernel and the reference, grouped
    and 2-d: its row tiles start at each expert's rows and read past them, so uneven experts,
    empty ones and rows past the last are the awkward cases."""
    wq, s = quantized_weight((len(counts), n, k), (128, 128), seed=n + k, device=DEVICE)
    x, offsets = routed(counts, tail, k, torch.float16, seed=k)
    ref32 = fp8_grouped_linear_ref(x.float(), wq, s, offsets, (128, 128))
    tma = fp8_gemm._launch(x, wq, s, (128, 128), offsets, tma=True)
    ptr = fp8_gemm._launch(x, wq, s, (128, 128), offsets, tma=False)
    err = lambda y: float((y.float() - ref32).norm() / ref32.norm().clamp_min(1e-30))  # noqa: E731
    assert err(tma) <= 2 * err(ptr) + 1e-6, (err(tma), err(ptr))
    start = sum(counts)
    assert bool((tma[start:] == 0).all()), "rows past the last expert must be zeros"
    flat = fp8_gemm._launch(x, wq[0], s[0], (128, 128), tma=True)
    ref2 = fp8_linear_ref(x, wq[0], s[0], (128, 128), out_dtype=torch.float32)
    ptr2 = fp8_gemm._launch(x, wq[0], s[0], (128, 128), tma=False)
    assert float((flat.float() - ref2).norm()) <= 2 * float((ptr2.float() - ref2).norm()) + 1e-6


@kernel_test
@fp8_kernel_test
def test_kernel_tma_form_refuses_what_it_cannot_compute():
    wq, s = quantized_weight((72, 256), (128, 128), device=DEVICE)  # N not a multiple of the tile
    x = activations(5, 256, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="TMA form needs"):
        fp8_gemm._launch(x, wq, s, (128, 128), tma=True)
    with pytest.raises(ValueError, match="TMA form needs"):  # a TMA launch setting, too
        fp8_gemm._launch(x, wq, s, (128, 128), config=fp8_gemm.TMA_INTERPRET_CONFIG)
    want = fp8_linear_ref(x, wq, s, (128, 128), out_dtype=torch.float32)
    got = fp8_gemm._launch(x, wq, s, (128, 128))  # auto: the pointer kernel
    assert_rows_close(got, want, *exact_products(x, dequantize_weight_ref(wq, s, (128, 128))))


@kernel_test
@fp8_kernel_test
def test_kernel_batched_matches_reference():
    e, n, k = 6, 64, 256
    wq, s = quantized_weight((e, n, k), (128, 128), device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, e + 2, (150,), generator=gen)  # ids e and e + 1: no expert here
    ids[:20] = 3  # one popular expert
    x = activations(150, k, dtype=torch.float16, device=DEVICE)
    got = fp8_batched_linear(x, wq, s, ids.to(DEVICE), (128, 128))
    ref32 = fp8_batched_linear_ref(x.float(), wq, s, ids.to(DEVICE), (128, 128))
    rows = [(ids == i).nonzero().flatten().to(DEVICE) for i in range(e)]
    w = dequantize_weight_ref(wq, s, (128, 128))
    assert_rows_close(got, ref32, *exact_products(x, w, rows))
    assert bool((got[(ids >= e).to(DEVICE)] == 0).all())


@kernel_test
@fp8_kernel_test
def test_custom_ops_are_opaque_to_compile():
    """The fake implementations agree with the real ones (torch.library's fake-tensor check; its
    schema check cannot run on e4m3 inputs) and a region compiled with fullgraph=True runs the
    ops without a graph break."""
    wq, s = quantized_weight((4, 64, 128), (128, 128), device=DEVICE)
    x, offsets = routed([3, 0, 5, 2], 1, 128, torch.float16, seed=2)
    torch.library.opcheck(
        torch.ops.rbs_bench.fp8_grouped_linear.default,
        (x, wq, s, offsets, 128, 128),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    torch.library.opcheck(
        torch.ops.rbs_bench.fp8_linear.default,
        (x, wq[0], s[0], 128, 128, torch.float16, None),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )

    def layer(x):
        return fp8_linear(x, wq[1], s[1]) + fp8_grouped_linear(x, wq, s, offsets)

    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel or rounding or custom_ops", at_least=20)


# ---------------------------------------------------------------- GPU, bf16, model shapes


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("m", [1, 127, 129, 1000, 4099])
@pytest.mark.parametrize("n, k", [(4096, 2048), (512, 2048), (2048, 4096), (1536, 2048)])
def test_gpu_linear_bf16_model_shapes(m, n, k):
    check_linear(m, n, k, (128, 128), torch.bfloat16, seed=m + n)
    check_linear(m, n, k, (128, 128), torch.bfloat16, fused=True, seed=m + n)


def test_cublas_takes_only_the_shapes_it_computes_exactly():
    ok = fp8_gemm.cublas_shape_ok
    assert ok(4096, 2048, (128, 128), None) and ok(512, 4096, [128, 128], None)
    assert not ok(2048, 768, (128, 128), None)  # K / 128 = 6: cuBLAS returned inf
    assert not ok(1536 + 128, 2048, (128, 128), None)  # N / 128 not a multiple of 4
    assert not ok(4096, 2048, (64, 128), None) and not ok(4096, 2048, None, None)
    assert not ok(4096, 2048, (128, 128), torch.tensor(0.1))  # a static activation scale


@pytest.mark.parametrize("m", [1, 5, 8])
def test_cublas_operands_rows_padded_to_four(monkeypatch, m):
    """What `cublas_linear` and `cublas_quantised` hand `torch._scaled_mm` (stood in for on the
    CPU by the product it computes): the e4m3 rows padded with zero rows to a multiple of 4, their
    scales as the [M, K / 128] view of the group-major [K / 128, M] storage (strides (1, M)), the
    weight's scales transposed; the product of the real rows is `fp8_linear_ref`'s."""
    seen = []

    def scaled_mm(a, w_t, a_s, w_s, out_dtype):
        seen.append((tuple(a.shape), a_s.stride(), tuple(w_s.shape)))
        deq = a.float() * a_s.repeat_interleave(128, 1)
        w = w_t.t().float() * w_s.t().repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (deq @ w.t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm, raising=False)
    monkeypatch.setattr(
        fp8_gemm, "fp8_act_quant", lambda x, g: (lambda q, s: (q, s.t().contiguous()))(
            *act_quant_ref(x, g)
        ),
    )  # fmt: skip
    wq, s = quantized_weight((256, 384), (128, 128))
    x = activations(m, 384, dtype=torch.float32)
    got = fp8_gemm.cublas_linear(x, wq, s, torch.float32)
    rows = m + (-m % 4)
    assert seen == [((rows, 384), (1, rows), (3, 2))]
    assert got.shape == (m, 256)
    torch.testing.assert_close(got, fp8_linear_ref(x, wq, s, (128, 128)), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("m", [1, 129, 4099])
@pytest.mark.parametrize("n, k", [(4096, 2048), (2048, 4096), (1536, 2048)])
def test_gpu_cublas_linear_on_hopper(m, n, k):
    """On Hopper the model's q/k/v/o shapes take cuBLAS's block-scaled product (rows padded to
    a multiple of 4), within the same bound of the reference as the Triton kernel."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled FP8 recipe needs Hopper")
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    wq = torch.empty(n, k, device="cuda", dtype=fp8_gemm.FP8_DTYPE)
    assert fp8_gemm._use_cublas(x, wq, (128, 128), None, torch.bfloat16)
    got = check_linear(m, n, k, (128, 128), torch.bfloat16, seed=m + n)
    wq, s = quantized_weight((n, k), (128, 128), seed=m + n, device="cuda")
    xb = activations(m, k, seed=m + n + 1, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(fp8_gemm.cublas_linear(xb, wq, s, torch.bfloat16), got)
    # the Triton product these shapes no longer take stays within the same bound
    ref32 = fp8_linear_ref(xb, wq, s, (128, 128), None, torch.float32)
    truth = exact_products(xb, dequantize_weight_ref(wq, s, (128, 128)))
    assert_rows_close(fp8_gemm._launch(xb, wq, s, (128, 128)), ref32, *truth)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("tokens", [1, 129, 1000])
@pytest.mark.parametrize("n, k", [(1536, 2048), (2048, 768)])
@pytest.mark.parametrize("tma", ["1", "0"])
def test_gpu_grouped_bf16_experts(tokens, n, k, tma, monkeypatch):
    """128 experts, top-8 routing of `tokens` tokens (most experts get a few rows or none), in
    the persistent TMA form (on Hopper; the pointer kernel elsewhere) and in the pointer kernel."""
    monkeypatch.setenv("RBS_BENCH_FP8_TMA", tma)
    e, top = 128, 8
    wq, s = quantized_weight((e, n, k), (128, 128), seed=tokens, device="cuda")
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(tokens)]).flatten()
    counts = torch.bincount(ids, minlength=e).tolist()
    x, offsets = routed(counts, 0, k, torch.bfloat16, seed=tokens)
    got = fp8_grouped_linear(x, wq, s, offsets, (128, 128))
    ref32 = fp8_grouped_linear_ref(x.float(), wq, s, offsets, (128, 128))
    rows = expert_slices(offsets)
    w = dequantize_weight_ref(wq, s, (128, 128))
    assert_rows_close(got, ref32, *exact_products(x, w, rows))


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize(
    "counts, tail",
    [
        ([5, 0, 3, 1, 0, 2], 0),  # odd counts: each expert's product spills into the next's rows
        ([4, 7, 0, 0], 3),  # rows past offsets[-1] are zeros, though the last expert spills there
        ([0, 0, 9], 0),  # the last expert spills past the rows: padded on its own
        ([1], 0),
    ],
)
def test_gpu_cublas_grouped_linear_on_hopper(counts, tail):
    """The experts' product one expert at a time on cuBLAS: within the reference bound, rows of
    no expert zero, and the same values as each expert's rows through `cublas_linear` alone."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled FP8 recipe needs Hopper")
    n, k = 1536, 2048
    wq, s = quantized_weight((len(counts), n, k), (128, 128), seed=len(counts), device="cuda")
    x, offsets = routed(counts, tail, k, torch.bfloat16, seed=sum(counts))
    got = fp8_gemm.cublas_grouped_linear(x, wq, s, offsets, torch.bfloat16)
    assert got.shape == (x.shape[0], n) and got.is_contiguous()
    ref32 = fp8_grouped_linear_ref(x.float(), wq, s, offsets, (128, 128))
    rows = expert_slices(offsets)
    for i, r in enumerate(rows):
        if r.stop > r.start:
            alone = fp8_gemm.cublas_linear(x[r], wq[i], s[i], torch.bfloat16)
            assert torch.equal(got[r], alone), i
    assert torch.count_nonzero(got[sum(counts) :]) == 0
    w = dequantize_weight_ref(wq, s, (128, 128))
    assert_rows_close(got, ref32, *exact_products(x, w, rows))


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
def test_gpu_the_experts_product_takes_cublas_only_for_a_prefill(monkeypatch):
    """128 experts: a prefill's rows (>= CUBLAS_GROUPED_MIN_ROWS per expert on average) go to
    the per-expert cuBLAS loop on Hopper, a decode step's 8 rows to the grouped Triton kernel."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled FP8 recipe needs Hopper")
    e = 128
    wq = torch.empty(e, 1536, 2048, device="cuda", dtype=fp8_gemm.FP8_DTYPE)
    big = torch.empty(
        fp8_gemm.CUBLAS_GROUPED_MIN_ROWS * e, 2048, device="cuda", dtype=torch.bfloat16
    )
    assert fp8_gemm._use_cublas_grouped(big, wq, (128, 128))
    assert not fp8_gemm._use_cublas_grouped(big[:8], wq, (128, 128))
    assert not fp8_gemm._use_cublas_grouped(big, wq[:, :, :768], (128, 128))  # K = 768
    monkeypatch.setenv("RBS_BENCH_FP8_CUBLAS_GROUPED", "0")
    assert not fp8_gemm._use_cublas_grouped(big, wq, (128, 128))
