"""The FP8 experts in four passes (`kernels/fp8_moe.py`): the row layout, the reference against a
token-by-token computation, and the kernels against the reference.

The reference is checked on the CPU against each (token, expert) pair computed alone with
`fp8_linear_ref` and transformers' gate. The kernel tests run on a GPU with fp8 tensor cores, or
on the CPU in a fresh Python under TRITON_INTERPRET=1 (`test_interpreter_suite`; fp32/fp16).

Tolerance, per token: ||kernel - ref|| <= 2 ||round(ref) - ref|| + 0.05 ||ref - truth||, where
truth is the fp64 computation without any quantisation (the dequantised weights, unquantised
activations): the kernels quantise the same values as the reference, and a last-bit difference
in the gate (the two exp implementations) may move one e4m3 value of the down product's input to
its neighbour, a small fraction of the quantisation's own error. On a GPU the tensor cores'
accumulation (`test_fp8_gemm.ACCUMULATION`) moves gate_up's products by far more than a last
bit, and every gate value it carries across an e4m3 midpoint moves by 6%: the whole output is
then no longer within 5% of the quantisation's error of the reference's. So the kernels are also
checked stage by stage, the only check on a GPU (`check_stages`): gate_up's products against the
reference's on the same rows, then the output against the reference's down, gate and sum of the
kernel's own gate_up products, each within the bound plus the accumulation term.
"""

from __future__ import annotations

import dataclasses

import interpreter_suite
import pytest
import torch
from interpreter_suite import DEVICE, kernel_test
from rbs_bench.kernels import fp8_moe
from rbs_bench.kernels.fp8_gemm import (
    act_quant_ref,
    dequantize_weight_ref,
    fp8_act_quant,
    fp8_grouped_linear_ref,
    fp8_linear_ref,
)
from rbs_bench.kernels.fp8_moe import (
    PAD_ROWS,
    expert_rows,
    expert_rows_ref,
    expert_spans,
    expert_spans_later,
    fp8_moe_experts,
    fp8_moe_experts_ref,
    place_scales,
    scatter_quant_ref,
    silu_gate_ref,
)
from rbs_bench.kernels.moe_combine import moe_combine_ref
from rbs_bench.kernels.triton_util import INTERPRET
from test_fp8_gemm import (
    ACCUMULATION,
    FP8_GPU,
    activations,
    assert_rows_close,
    exact_products,
    expert_slices,
    fp8_kernel_test,
    quantized_weight,
)


def routes(n, k, experts, seed=0, empty=(), device="cpu"):
    """top_k_index [N, k] (distinct experts per token, none from `empty`) and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, experts, generator=gen)
    scores[:, list(empty)] = -1.0
    weights, index = scores.topk(k, dim=-1)
    return index.to(device), torch.softmax(weights, -1).to(device)


def moe(n, k, experts, hidden, inter, dtype, seed=0, empty=(), device="cpu", x_scale=1.0):
    gu, gu_s = quantized_weight((experts, 2 * inter, hidden), (128, 128), seed, device)
    dn, dn_s = quantized_weight((experts, hidden, inter), (128, 128), seed + 1, device)
    x = activations(n, hidden, seed + 2, dtype, device) * x_scale
    index, weights = routes(n, k, experts, seed + 3, empty, device)
    return x, index, weights, gu, gu_s, dn, dn_s


def truth_of(x, index, weights, gu, gu_s, dn, dn_s):
    """fp64 without quantisation: dequantised weights, unquantised activations."""
    wg = dequantize_weight_ref(gu, gu_s, (128, 128)).double()
    wd = dequantize_weight_ref(dn, dn_s, (128, 128)).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = wg[e] @ x[t].double()
            gate, up = h.chunk(2)
            out[t] += float(weights[t, j]) * (wd[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def assert_same_layout(got, want):
    """Every tensor of the two `ExpertRows` equal, dtype and shape too, and so their spans."""
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert a.dtype == b.dtype and a.shape == b.shape, field.name
        assert torch.equal(a, b), field.name
    assert expert_spans_later(got)() == expert_spans(want)


# ---------------------------------------------------------------- layout and reference (CPU)


@pytest.mark.parametrize(
    "n, k, experts, empty", [(1, 1, 3, ()), (37, 3, 5, (2,)), (130, 8, 16, (0, 15))]
)
def test_expert_rows_pad_each_expert_and_invert_the_sort(n, k, experts, empty):
    index, _ = routes(n, k, experts, seed=n, empty=empty)
    layout = expert_rows(index, experts)
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    ends = layout.ends.long()
    padded = torch.diff(ends, prepend=ends.new_zeros(1))
    assert bool((padded % PAD_ROWS == 0).all()) and bool((padded >= counts).all())
    assert bool((padded - counts < PAD_ROWS).all())
    assert layout.rows == n * k + (PAD_ROWS - 1) * experts
    for t in range(n):  # every (token, slot) lands in its expert's rows and reads its token
        for j in range(k):
            r, e = int(layout.pos[t, j]), int(index[t, j])
            assert int(ends[e]) - int(padded[e]) <= r < int(ends[e])
            assert int(layout.src[r]) == t
    assert int((layout.src >= 0).sum()) == n * k  # every other row is padding
    assert sorted(layout.pos.reshape(-1).tolist()) == sorted(
        torch.nonzero(layout.src >= 0).reshape(-1).tolist()
    )
    for r in range(layout.rows):  # first / count: the block a row belongs to
        e = int(torch.searchsorted(ends, torch.tensor(r), right=True))
        first = int(ends[e - 1]) if 0 < e <= experts else (0 if e == 0 else int(ends[-1]))
        count = int(padded[e]) if e < experts else layout.rows - int(ends[-1])
        assert (int(layout.first[r]), int(layout.count[r])) == (first, count)


def test_spans_read_later_off_cuda_are_the_spans():
    index, _ = routes(29, 4, 6, seed=2, empty=(3,))
    layout = expert_rows_ref(index, 6)
    spans = expert_spans(layout)
    assert expert_spans_later(layout)() == spans
    assert [first for first, _ in spans] == [0, *layout.ends.tolist()[:-1]]
    assert sum(count for _, count in spans) == int(layout.ends[-1])


def test_pass_one_reference_lays_scales_out_as_the_products_read_them():
    """`scatter_quant_ref`: row r holds its token quantised (a zero token where src is -1), and
    its scales (`place_scales`) lie where the products read them: [G, count] per expert at
    G * first (the cuBLAS loop's view) or group-major [G, R] (the Triton product's)."""
    index, _ = routes(11, 3, 5, seed=4, empty=(1,))
    layout = expert_rows(index, 5)
    x = activations(11, 300, seed=3)
    tq, ts = act_quant_ref(torch.cat([x, torch.zeros(1, 300)]), 128)  # [N + 1, K], [N + 1, G]
    src = torch.where(layout.src >= 0, layout.src, 11).long()
    groups, r = ts.shape[1], layout.rows
    for blocked in (False, True):
        xq, xs = scatter_quant_ref(x, layout, blocked)
        assert torch.equal(xq.view(torch.uint8), tq[src].view(torch.uint8))
        if not blocked:
            assert torch.equal(xs.view(groups, r), ts[src].t())
            continue
        for first, count in set(zip(layout.first.tolist(), layout.count.tolist())):
            block = xs.as_strided((count, groups), (1, count), groups * first)
            assert torch.equal(block, ts[src[first : first + count]])


def test_reference_is_each_pair_through_its_expert():
    x, index, weights, gu, gu_s, dn, dn_s = moe(9, 3, 4, 256, 128, torch.float32, empty=(1,))
    got = fp8_moe_experts_ref(x, index, weights, gu, gu_s, dn, dn_s)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = fp8_linear_ref(x[t : t + 1], gu[e], gu_s[e], (128, 128))
            y = fp8_linear_ref(silu_gate_ref(h), dn[e], dn_s[e], (128, 128))
            want[t] += weights[t, j] * y[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32 summation order


def test_the_op_runs_the_reference_on_the_cpu_and_is_opaque_to_compile():
    args = moe(20, 2, 4, 128, 128, torch.float32)
    fn = torch.compile(fp8_moe_experts, backend="eager", fullgraph=True)
    want = fp8_moe_experts(*args)
    if not INTERPRET:  # interpreted, the op runs the kernels
        assert torch.equal(want, fp8_moe_experts_ref(*args))
    assert torch.equal(fn(*args), want)


def scaled_mm_fp32(a, b, scale_a, scale_b, out_dtype, out):
    """torch._scaled_mm's block-scaled recipe in fp32, from the views it is given (a stand-in
    where there is no Hopper GPU)."""
    sa = scale_a.repeat_interleave(128, 1)  # [m, K]
    sb = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)  # [K, N]
    out.copy_((a.float() * sa) @ (b.float() * sb))
    return out


def test_the_cublas_loop_gives_each_expert_its_rows_and_scales(monkeypatch):
    """`_cublas_products` on the CPU, with torch._scaled_mm computing the block-scaled recipe in
    fp32 from the views it is given: every expert's rows (4 experts, one empty) come out as
    its dequantised weight times its rows dequantised with their blocked scales ([G, count] per
    expert), and the rows past the last expert are zeros."""

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_fp32)
    counts, groups, n = [8, 0, 4, 12], 2, 256
    spans = [(sum(counts[:e]), c) for e, c in enumerate(counts)]
    rows = sum(counts) + 6  # spare rows past the last expert
    gen = torch.Generator().manual_seed(0)
    xq = (torch.randn(rows, 128 * groups, generator=gen) * 64).to(torch.float8_e4m3fn)
    xs = torch.rand(groups * rows, generator=gen) + 0.5
    weight, w_s = quantized_weight((len(counts), n, 128 * groups), (128, 128), 1, "cpu")
    got = fp8_moe._cublas_products(xq, xs, weight, w_s, spans, torch.float32)
    for e, (first, count) in enumerate(spans):
        scales = xs[groups * first : groups * (first + count)].view(groups, count)
        x = xq[first : first + count].float() * scales.t().repeat_interleave(128, 1)
        want = x @ dequantize_weight_ref(weight[e], w_s[e], (128, 128)).t()
        torch.testing.assert_close(got[first : first + count], want)
    assert bool((got[sum(counts) :] == 0).all())


def test_launch_threads_come_from_the_environment(monkeypatch):
    """RBS_BENCH_FP8_LAUNCH_THREADS sets how many host threads launch the per-expert calls
    (`LAUNCH_THREADS` without it); anything but a whole number >= 1 stops with its name."""
    monkeypatch.delenv("RBS_BENCH_FP8_LAUNCH_THREADS", raising=False)
    assert fp8_moe.launch_threads() == fp8_moe.LAUNCH_THREADS
    monkeypatch.setenv("RBS_BENCH_FP8_LAUNCH_THREADS", "3")
    assert fp8_moe.launch_threads() == 3
    for bad in ("0", "-1", "two", ""):
        monkeypatch.setenv("RBS_BENCH_FP8_LAUNCH_THREADS", bad)
        with pytest.raises(ValueError, match="RBS_BENCH_FP8_LAUNCH_THREADS must be a whole number"):
            fp8_moe.launch_threads()


def test_launch_shares_off_cuda_launch_everything_once_in_order():
    """Off CUDA there are no streams to share out: one launch of all the work, in order."""
    calls = []
    fp8_moe.launch_shares(list(range(5)), calls.append, torch.device("cpu"), 4)
    assert calls == [[0, 1, 2, 3, 4]]


def test_bad_inputs_one_line():
    x, index, weights, gu, gu_s, dn, dn_s = moe(6, 2, 4, 128, 128, torch.float32)
    with pytest.raises(ValueError, match=r"top_k_index and top_k_weights must be \[N, k\]"):
        fp8_moe_experts(x, index[:3], weights, gu, gu_s, dn, dn_s)
    with pytest.raises(ValueError, match=r"down \[E, H, I\]"):
        fp8_moe_experts(x, index, weights, gu, gu_s, dn[:, :64], dn_s)
    with pytest.raises(ValueError, match="e4m3 weights"):
        fp8_moe_experts(x, index, weights, gu.float(), gu_s, dn, dn_s)
    with pytest.raises(ValueError, match=r"blocks of \[bn, 128\]"):
        fp8_moe_experts(x, index, weights, gu, gu_s, dn, dn_s, (128, 64))


# ---------------------------------------------------------------- kernels vs reference


def assert_tokens_close(got, ref, truth, slack=0.0):
    """`test_fp8_gemm.assert_rows_close`'s rule per token, plus `slack` per token: a non-finite
    value in got fails the token (NaN compares false), one in ref or truth the test."""
    ref64 = ref.double()
    assert bool(torch.isfinite(ref64).all() and torch.isfinite(truth).all()), "reference not finite"
    err = (got.double() - ref64).norm(dim=-1)
    rounding = (ref.float().to(got.dtype).double() - ref64).norm(dim=-1)
    tol = 2 * rounding + 0.05 * (ref64 - truth).norm(dim=-1) + 1e-6 * ref64.norm(dim=-1) + 1e-30
    tol = tol + slack
    bad = ~(err <= tol)
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} tokens off; worst {float((err / tol).max()):.3g}x tol"
    )


@kernel_test
@pytest.mark.parametrize(
    "n, k, experts, empty, chunk, scan",
    [
        (1, 1, 3, (), 128, 1024),  # one slot
        (37, 3, 5, (2,), 16, 2),  # 7 chunks, a scan of 4 steps, a partial last chunk
        (130, 8, 16, (0, 15), 32, 4),  # empty first and last experts
        (64, 2, 7, (), 128, 1024),  # slots fill their one chunk exactly
        (300, 8, 128, (5, 127), 64, 8),  # the model's 128 experts, 38 chunks
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_kernel_expert_rows_equal_the_reference(
    n, k, experts, empty, chunk, scan, index_dtype, monkeypatch
):
    """The counting sort's layout equals the reference's sort, tensor for tensor, over chunk and
    scan sizes that split the slots into several chunks and an expert's scan into several steps."""
    monkeypatch.setattr(fp8_moe, "ROWS_CHUNK", chunk)
    monkeypatch.setattr(fp8_moe, "ROWS_SCAN", scan)
    index, _ = routes(n, k, experts, seed=n + 1, empty=empty, device=DEVICE)
    assert_same_layout(expert_rows(index.to(index_dtype), experts), expert_rows_ref(index, experts))


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize(
    "n, k, experts, hidden, inter, dtype, empty, x_scale",
    [
        (1, 1, 3, 128, 128, torch.float32, (), 1.0),  # one row
        # a partial K group in down, an empty expert; fp16: at full scale the 50x row's
        # silu(gate) * up passed 65,504 and was inf in the kernel and the reference alike
        (37, 3, 5, 256, 192, torch.float16, (2,), 0.2),
        (70, 4, 6, 384, 128, torch.float32, (0, 5), 1.0),  # empty first and last experts
    ],
)
def test_kernel_matches_reference(n, k, experts, hidden, inter, dtype, empty, x_scale):
    args = moe(n, k, experts, hidden, inter, dtype, n, empty, DEVICE, x_scale)
    got = fp8_moe_experts(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    ref = fp8_moe_experts_ref(*args)
    if DEVICE != "cuda":
        cpu = [a.cpu() for a in args]
        assert_tokens_close(got.cpu(), ref.cpu(), truth_of(*cpu))
    check_stages(got, *args)


def check_stages(got, x, index, weights, gu, gu_s, dn, dn_s):
    """The kernels' output stage by stage (the module docstring says why): gate_up's products h
    on the Triton path, as `fp8_moe_experts` computes them for these row counts, against the
    reference's; then got against the reference's down, gate and weighted sum of that h."""
    layout = expert_rows(index, gu.shape[0])
    assert not fp8_moe._use_cublas(index.numel(), x, gu, dn, (128, 128))
    xq, xs = fp8_moe.scatter_quant(x, layout, blocked=False)
    h = fp8_moe._triton_products(xq, xs, gu, gu_s.float(), layout, (128, 128), x.dtype)
    live = layout.src >= 0
    rows_x = torch.where(live[:, None], x[layout.src.long().clamp_min(0)], 0)
    experts = expert_slices(layout.ends)
    h_ref = fp8_grouped_linear_ref(rows_x.float(), gu, gu_s, layout.ends)
    wg = dequantize_weight_ref(gu, gu_s, (128, 128))
    truth, magnitude = exact_products(rows_x, wg, experts)
    assert_rows_close(h[live], h_ref[live], truth[live], magnitude[live])
    a = silu_gate_ref(h)
    tail = moe_combine_ref(
        fp8_grouped_linear_ref(a, dn, dn_s, layout.ends), layout.pos, weights.to(x.dtype)
    )
    wd = dequantize_weight_ref(dn, dn_s, (128, 128))
    y, y_mag = exact_products(a, wd, experts)
    w = weights.double()[..., None]
    pos = layout.pos.long()
    truth_out, mag_out = (w * y[pos]).sum(1), (w * y_mag[pos]).sum(1)
    slack = ACCUMULATION * mag_out.norm(dim=-1)
    assert_tokens_close(got.cpu(), tail.cpu(), truth_out.cpu(), slack.cpu())


@kernel_test
@fp8_kernel_test
def test_kernel_quantisation_passes_equal_act_quant():
    """Pass 1 writes each row as `fp8_act_quant` quantises its token; pass 3 the quantised gate
    of the reference, in both scale layouts."""
    x, index, *_ = moe(23, 3, 4, 256, 128, torch.float16, device=DEVICE)
    layout = expert_rows(index, 4)
    live = layout.src >= 0
    want_q, want_s = act_quant_ref(x[layout.src[live].long()], 128)
    for blocked in (False, True):
        xq, xs = fp8_moe.scatter_quant(x, layout, blocked)
        assert torch.equal(xq[live].float(), want_q.float())
        assert bool((xq[~live].float() == 0).all())
        rows = torch.arange(layout.rows, device=x.device)
        groups = torch.arange(2, device=x.device)[:, None]
        if blocked:  # expert blocks [G, count] at G * first: (G - 1) * first + row + g * count
            where = layout.first.long() + rows + groups * layout.count.long()
        else:
            where = groups * layout.rows + rows
        torch.testing.assert_close(xs[where].T[live], want_s, rtol=1e-6, atol=0)
    for dtype in (torch.float16, torch.bfloat16):  # bf16: rounded by bits in the interpreter
        h = activations(layout.rows, 256, dtype=dtype, device=DEVICE)
        aq, _ = fp8_moe.gated_quant(h, layout, blocked=False)
        ref_q, _ = act_quant_ref(silu_gate_ref(h), 128)
        mismatch = int((aq.float() != ref_q.float()).sum())
        # a gate one unit of h's dtype apart moves its e4m3 value
        assert mismatch <= aq.numel() // 200, (dtype, mismatch)


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize(
    "n, k, experts, hidden, dtype, empty",
    [
        # N never a multiple of SCATTER_ROWS, token 3 (where there is one) all zeros
        (1, 1, 3, 128, torch.float32, ()),  # one token, two empty experts, one group
        (37, 3, 5, 200, torch.float16, (2,)),  # a partial group, K not a multiple of 16
        (45, 8, 16, 131, torch.float32, (0, 3, 15)),  # odd K, empty first and last experts
        (70, 4, 6, 384, torch.float16, (0, 1, 5)),  # three groups (not a power of 2)
        (0, 2, 3, 256, torch.float32, ()),  # no tokens: every row is padding
    ],
)
def test_kernel_pass_one_writes_each_row_as_its_token_quantised(
    n, k, experts, hidden, dtype, empty
):
    """`scatter_quant`: row r holds exactly `fp8_act_quant`'s bytes and scales of token src[r]
    (the same arithmetic, the same kernel helpers), a padding row those of a zero token, in both
    scale layouts; and the values of `scatter_quant_ref`."""
    x = activations(n, hidden, seed=n, dtype=dtype, device=DEVICE)
    if n > 3:
        x[3] = 0  # a zero token: the same values as a padding row
    index, _ = routes(n, k, experts, seed=n, empty=empty, device=DEVICE)
    layout = expert_rows(index, experts)
    tq, ts = fp8_act_quant(torch.cat([x, x.new_zeros(1, hidden)]))  # [N + 1, K], [G, N + 1]
    src = torch.where(layout.src >= 0, layout.src, n).long()
    for blocked in (False, True):
        xq, xs = fp8_moe.scatter_quant(x, layout, blocked)
        assert torch.equal(xq.view(torch.uint8), tq[src].view(torch.uint8))
        want_q, want_s = scatter_quant_ref(x, layout, blocked)
        assert torch.equal(xs, place_scales(ts.t()[src], layout, blocked))
        assert torch.equal(xq.float(), want_q.float())  # torch's cast may round to -0
        torch.testing.assert_close(xs, want_s, rtol=1e-6, atol=0)


@kernel_test
@fp8_kernel_test
def test_the_bench_stages_chain_to_the_block(monkeypatch):
    """`bench.fp8_gemm.experts_stages` times the block's cuBLAS path stage by stage: run in
    order, its stages compute the block itself (the last one returns `fp8_moe_experts`'s output,
    bit for bit). Forced onto the cuBLAS path at a small size; without a Hopper GPU cuBLAS's
    product is its recipe in fp32 (`scaled_mm_fp32`)."""
    from rbs_bench.bench import fp8_gemm as bench

    monkeypatch.setattr(fp8_moe, "_use_cublas", lambda *args: True)
    if DEVICE != "cuda":
        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_fp32)
        monkeypatch.setattr(fp8_moe, "_weight_scale_layout", lambda device, kb: "plain")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # as the layers; fp16 overflows
    args = moe(24, 2, 4, 512, 256, dtype, device=DEVICE)
    stages = bench.experts_stages(args)
    assert tuple(stages) == bench.STAGES
    results = {name: fn() for name, fn in stages.items()}
    assert torch.equal(results["combine"], fp8_moe_experts(*args, (128, 128)))
    spans = results["rows"]
    assert sum(count for _, count in spans) >= 24 * 2 and spans[0][0] == 0


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel", at_least=4)


# ---------------------------------------------------------------- GPU: the model's shapes


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("n", [1, 129, 4099])
def test_gpu_the_models_experts_on_both_backends(n, monkeypatch):
    """Qwen3-30B-A3B's experts (H 2048, I 768, 128 experts, top 8) in bf16, on cuBLAS (where the
    rows make a prefill) and on Triton: each is no farther from the reference run in bf16 (the
    same roundings of h and the gate) than that reference is from the one run in fp32. The two bf16
    orders of the same arithmetic differ by a last bit of h now and then, which moves a gate
    value's e4m3 rounding; the fp32 reference differs from bf16 in every gate value."""
    args = moe(n, 8, 128, 2048, 768, torch.bfloat16, seed=n, device="cuda")
    ref = fp8_moe_experts_ref(*args).float()
    ref32 = fp8_moe_experts_ref(*[a.float() if a.dtype == torch.bfloat16 else a for a in args])
    outs = {}
    for grouped in ("1", "0"):
        monkeypatch.setenv("RBS_BENCH_FP8_CUBLAS_GROUPED", grouped)
        outs[grouped] = fp8_moe_experts(*args).float()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    errs = {name: rel(got, ref) for name, got in outs.items()}
    spread = rel(ref, ref32)
    print(f"against the bf16 reference (cuBLAS 1, Triton 0): {errs}; bf16 vs fp32 {spread:.4g}")
    assert max(errs.values()) <= spread, (errs, spread)  # measured 0.27-0.49x on an H100


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
def test_gpu_pass_one_at_128k_tokens():
    """Pass 1 on a 128K-token chunk of Qwen3-30B-A3B (H 2048, 128 experts, top 8, bf16: a
    million rows): `expert_rows` equals `expert_rows_ref`, and `scatter_quant` writes each row
    as `fp8_act_quant` quantises its token, bit for bit, in both scale layouts. Prints each
    kernel's time."""
    from triton.testing import do_bench

    n, hidden = 131072, 2048
    x = activations(n, hidden, seed=5, dtype=torch.bfloat16, device="cuda")
    index, _ = routes(n, 8, 128, seed=5, device="cuda")
    layout = expert_rows(index, 128)
    assert_same_layout(layout, expert_rows_ref(index, 128))
    tq, ts = fp8_act_quant(torch.cat([x, x.new_zeros(1, hidden)]))
    src = torch.where(layout.src >= 0, layout.src, n).long()
    for blocked in (False, True):
        xq, xs = fp8_moe.scatter_quant(x, layout, blocked)
        assert torch.equal(xq.view(torch.uint8), tq[src].view(torch.uint8))
        assert torch.equal(xs, place_scales(ts.t()[src], layout, blocked))
        del xq, xs
    ms_rows = do_bench(lambda: expert_rows(index, 128))
    ms_rows_ref = do_bench(lambda: expert_rows_ref(index, 128))
    ms_pass = do_bench(lambda: fp8_moe.scatter_quant(x, layout, True))
    print(
        f"pass 1 at 128K tokens: expert_rows {ms_rows:.3f} ms (reference {ms_rows_ref:.3f}), "
        f"scatter_quant {ms_pass:.3f} ms"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
def test_gpu_cublas_reads_the_down_products_scales():
    """K = 768 (6 scale columns): a layout cuBLAS reads correctly is found on Hopper, and the
    product through it equals the Triton product's values."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled recipe needs Hopper")
    name = fp8_moe._weight_scale_layout(torch.device("cuda"), 6)
    print("cuBLAS scale layout for K = 768:", name)
    assert name is not None


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
def test_gpu_launch_threads_give_the_same_block_bit_for_bit(monkeypatch):
    """Qwen3-30B-A3B's experts at 4099 tokens, forced onto the cuBLAS path, in inference mode as
    a prefill runs them: the block's bytes are the same whether 1, 2 or 4 host threads launch its
    per-expert calls. `launch_shares` runs each piece of work once: share i is work[i::n], in
    order, on a stream of its own; share 0 in the caller's thread, the others in pool threads,
    each in the caller's inference mode."""
    import threading

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled recipe needs Hopper")
    monkeypatch.setattr(fp8_moe, "_use_cublas", lambda *args: True)
    args = moe(4099, 8, 128, 2048, 768, torch.bfloat16, seed=7, device="cuda")
    outs = {}
    for threads in ("1", "2", "4"):
        monkeypatch.setenv("RBS_BENCH_FP8_LAUNCH_THREADS", threads)
        with torch.inference_mode():
            outs[threads] = fp8_moe_experts(*args)
    assert torch.equal(outs["1"], outs["2"]) and torch.equal(outs["1"], outs["4"])

    seen, lock = [], threading.Lock()

    def launch(share):
        stream = torch.cuda.current_stream().stream_id
        with lock:
            seen.append((threading.get_ident(), stream, torch.is_inference_mode_enabled(), share))

    with torch.inference_mode():
        fp8_moe.launch_shares(list(range(10)), launch, torch.device("cuda"), 3)
    by_share = {tuple(share): (thread, stream, mode) for thread, stream, mode, share in seen}
    assert sorted(by_share) == [tuple(range(i, 10, 3)) for i in range(3)]
    assert len({stream for _, stream, _ in by_share.values()}) == 3
    assert all(mode for *_, mode in by_share.values())
    threads = [thread for thread, *_ in by_share.values()]
    assert by_share[tuple(range(0, 10, 3))][0] == threading.get_ident()
    assert threads.count(threading.get_ident()) == 1  # the other shares ran in pool threads
