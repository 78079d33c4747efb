"""Check and time the block-FP8 linear kernels on the FP8 checkpoints' layer shapes.

    python -m rbs_bench.bench.fp8_gemm --out DIR               # checks, then 8K-128K tokens
    python -m rbs_bench.bench.fp8_gemm --out DIR --tokens 131072 --time-budget-s 300

Shapes: Qwen3-30B-A3B-Instruct-2507-FP8's layers (the text layers of Qwen3-VL-30B-A3B-Thinking-FP8
have the same): q 2048 -> 4096, k and v 2048 -> 512, the three as one product (qkv, 2048 ->
5120, as the compiled layers run them), o 4096 -> 2048 (`fp8_linear`, one row per token), and
the experts' gate_up 2048 -> 1536 and down 768 -> 2048 (`fp8_grouped_linear`, 128 experts, top-8
routing drawn uniformly per token: 8 rows per token, sorted by expert), weights e4m3 with fp32
scales per 128 x 128 block, bf16 activations.

Checks (`kind=check`): each kernel (the default, activations quantised by their own pass, and
`fused`, quantised inside the product) against `fp8_linear_ref` / `fp8_grouped_linear_ref` on the
same inputs, on every row at 1, 129 and 4099 tokens and on 2048 sampled rows (the first and last
included) at the largest token count, per row: ||kernel - ref|| <= 2 ||round(ref) - ref|| +
0.05 ||ref - exact|| (round: to bf16; exact: the fp64 product of the unquantised activations and
the dequantised weight), the rule of tests/kernels/test_fp8_gemm.py. `ratio` is the worst row's
error over its tolerance (a pass is <= 1).

Times (`kind=time`), `triton.testing.do_bench` medians: the FP8 product as a layer calls it
(quantisation pass + product; cuBLAS's block-scaled GEMM on Hopper where `cublas_shape_ok`, see
kernels/fp8_gemm.py), the quantisation pass alone, the Triton product alone on quantised inputs,
the fused kernel, and for the shapes cuBLAS takes its block-scaled product with and without the
quantisation (`fp8_cublas_block`, `fp8_cublas_block_gemm`); against bf16 cuBLAS (`F.linear`
with the dequantised weight) and, for the experts, PyTorch's grouped GEMM (`F.grouped_mm` /
`torch._grouped_mm`, the weight as transformers passes it, a transposed [E, K, N] view) on the
same rows, and where cuBLAS takes the experts' shape its per-expert loop
(`fp8_cublas_grouped`, `cublas_grouped_linear`) beside the grouped Triton product
(`fp8_triton`); the whole experts block (`fp8_moe_experts`) and, where its products run on
cuBLAS, the block with its per-expert calls launched from 1, 2 and 4 host threads
(`fp8_threads<n>`; the default count is `fp8`) and each of its stages alone (`stage_*`: the
row layout, the rows quantised, gate_up, the gate with down's quantisation, down with its
weight scales laid out as cuBLAS reads them, the weighted sum); where the Triton products run
in the persistent TMA form (Hopper), the pointer kernel beside it (`fp8_gemm_pointer`, and
`fp8_triton_pointer` for the block); for the plain layers also cuBLAS's fp8 product with one
scale per tensor (`torch._scaled_mm`, `fp8_cublas_tensorwise`): a ceiling for the rate, not the
same function. TFLOP/s count 2 M N K.

Rows go to DIR/fp8_gemm_<gpu>.csv as they finish; a rerun skips the rows already there, and
--time-budget-s stops starting new ones. A failing variant is recorded as a row with its error.
The summary table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from rbs_bench.errors import positive_seconds
from rbs_bench.kernels import fp8_gemm as fk

# name: (N, K); v is k's shape; qkv: q, k and v as one product (`models.fp8.fuse_linears`)
LINEAR = {"q": (4096, 2048), "k": (512, 2048), "qkv": (5120, 2048), "o": (2048, 4096)}
EXPERTS = {"gate_up": (1536, 2048), "down": (2048, 768)}
NUM_EXPERTS, TOP_K, BLOCK = 128, 8, (128, 128)
LAUNCH_THREADS = (1, 2, 4)  # host threads launching the experts' cuBLAS calls, timed beside
CHECK_TOKENS = (1, 129, 4099)
SAMPLE_ROWS = 2048
DEVICE = "cuda"


def quantized_weight(shape, seed, device=None):
    """(e4m3 weight, fp32 scales per 128 x 128 block) of a random weight [..., N, K]."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(*shape, generator=gen, device=device) * 0.02
    *lead, n, k = shape
    blocks = w.reshape(*lead, n // 128, 128, k // 128, 128)
    s = blocks.abs().amax((-3, -1)).clamp_min(1e-12) / fk.FP8_MAX
    q = (blocks / s[..., :, None, :, None]).clamp(-fk.FP8_MAX, fk.FP8_MAX).to(fk.FP8_DTYPE)
    return q.reshape(shape), s.float()


def activations(rows, k, seed, device=None):
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, device=device)
    x[:, :: max(1, k // 16)] *= 8  # outlier channels, as real activations have
    return x.to(torch.bfloat16)


def routed_offsets(tokens, seed, device=None):
    """int32 cumulative row ends [E] of `tokens` tokens routed top-8 of 128 uniformly."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen, device=device).topk(TOP_K).indices
    counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
    return counts.cumsum(0).to(torch.int32)


def row_errors(got, ref32, exact) -> float:
    """Worst per-row error over its tolerance (<= 1 passes)."""
    ref, ex = ref32.double(), exact.double()
    err = (got.double() - ref).norm(dim=-1)
    rounding = (ref32.to(got.dtype).double() - ref).norm(dim=-1)
    tol = 2 * rounding + 0.05 * (ref - ex).norm(dim=-1) + 1e-30
    return float((err / tol).max())


def sample_rows(rows: int, seed: int, device=None) -> torch.Tensor:
    device = device or DEVICE
    if rows <= SAMPLE_ROWS:
        return torch.arange(rows, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pick = torch.randperm(rows, generator=gen, device=device)[: SAMPLE_ROWS - 2]
    ends = torch.tensor([0, rows - 1], device=device)
    return torch.cat([ends, pick]).unique()


def check_linear(name, tokens, variant) -> dict:
    n, k = LINEAR[name]
    wq, s = quantized_weight((n, k), seed=n + k)
    x = activations(tokens, k, seed=tokens)
    if variant == "cublas":
        got = fk.cublas_linear(x, wq, s, torch.bfloat16)
    else:
        got = fk._launch(x, wq, s, BLOCK, fused=variant == "fused")
    rows = sample_rows(tokens, seed=1)
    ref = fk.fp8_linear_ref(x[rows], wq, s, BLOCK, out_dtype=torch.float32)
    exact = x[rows].double() @ fk.dequantize_weight_ref(wq, s, BLOCK).double().T
    return {"ratio": row_errors(got[rows], ref, exact), "rows_checked": int(rows.numel())}


def check_grouped(name, tokens, variant) -> dict:
    n, k = EXPERTS[name]
    wq, s = quantized_weight((NUM_EXPERTS, n, k), seed=n + k)
    offsets = routed_offsets(tokens, seed=tokens)
    x = activations(tokens * TOP_K, k, seed=tokens)
    if variant == "cublas":
        got = fk.cublas_grouped_linear(x, wq, s, offsets, torch.bfloat16)
    else:
        got = fk._launch(x, wq, s, BLOCK, offsets, fused=variant == "fused")
    rows = sample_rows(x.shape[0], seed=2)
    ids = torch.searchsorted(offsets, rows.to(torch.int32), right=True)
    ref = fk.fp8_batched_linear_ref(x[rows].float(), wq, s, ids, BLOCK)
    exact = torch.zeros(rows.numel(), n, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        sel = ids == e
        w = fk.dequantize_weight_ref(wq[e], s[e], BLOCK).double()
        exact[sel] = x[rows][sel].double() @ w.T
    return {"ratio": row_errors(got[rows], ref, exact), "rows_checked": int(rows.numel())}


def do_bench(fn, rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def grouped_mm():
    """PyTorch's bf16 grouped GEMM (F.grouped_mm from torch 2.10, else torch._grouped_mm)."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def bench_tuned(fn, rep_ms: int, runs_on: str = "") -> tuple[float, str]:
    """(median ms, what ran: `runs_on` where the product is not the autotuned pointer kernel,
    else the autotuner's configuration for this call's shape)."""
    fn()  # tunes on the first call of a shape
    if runs_on:
        return do_bench(fn, rep_ms), runs_on
    tuned = fk._tuned_gemm(fk.tuning_space(torch.device(DEVICE)), 128)
    return do_bench(fn, rep_ms), str(getattr(tuned, "best_config", ""))


def runs_on(x, wq, cublas: bool) -> str:
    """What a layer's FP8 product runs on when it is not the autotuned pointer kernel: cuBLAS,
    or the TMA form with its one launch setting ("" for the pointer kernel)."""
    if cublas:
        return "cuBLAS"
    return f"TMA form {fk.TMA_CONFIG}" if _tma_applies(x, wq) else ""


def time_linear(name, tokens, rep_ms) -> dict:
    n, k = LINEAR[name]
    wq, s = quantized_weight((n, k), seed=n + k)
    x = activations(tokens, k, seed=tokens)
    w_bf16 = fk.dequantize_weight_ref(wq, s, BLOCK).to(torch.bfloat16)
    quantized = fk.fp8_act_quant(x, 128)
    ms, configs = {}, {}
    cublas = fk._use_cublas(x, wq, BLOCK, None, x.dtype)
    ms["fp8"], configs["config"] = bench_tuned(
        lambda: fk.fp8_linear(x, wq, s, BLOCK), rep_ms, runs_on(x, wq, cublas)
    )
    ms["fp8_quant"] = do_bench(lambda: fk.fp8_act_quant(x, 128), rep_ms)
    ms["fp8_gemm"] = do_bench(lambda: fk._launch(x, wq, s, BLOCK, quantized=quantized), rep_ms)
    if _tma_applies(quantized[0], wq):
        ms["fp8_gemm_pointer"] = do_bench(
            lambda: fk._launch(x, wq, s, BLOCK, quantized=quantized, tma=False), rep_ms
        )
    ms["fp8_fused"], configs["config_fused"] = bench_tuned(
        lambda: fk._launch(x, wq, s, BLOCK, fused=True), rep_ms
    )
    ms["bf16_cublas"] = do_bench(lambda: F.linear(x, w_bf16), rep_ms)
    if fk.cublas_shape_ok(n, k, BLOCK, None):  # what fp8_linear runs on Hopper for this shape
        ms["fp8_cublas_block"] = do_bench(lambda: fk.cublas_linear(x, wq, s, x.dtype), rep_ms)
        ms["fp8_cublas_block_gemm"] = do_bench(
            lambda: torch._scaled_mm(
                quantized[0], wq.t(), quantized[1].t(), s.t(), out_dtype=torch.bfloat16
            ),
            rep_ms,
        )
    ceiling = scaled_mm_ceiling(quantized[0], wq)
    if ceiling is not None:
        ms["fp8_cublas_tensorwise"] = do_bench(ceiling, rep_ms)
    ms |= producer_times(name, x, quantized, wq, s, rep_ms)
    if "attention_fp8" in ms:  # the row says which attention it timed
        configs |= {f"attention_{key}": v for key, v in ATTENTION.items()}
    return _time_row(ms, 2.0 * tokens * n * k, "bf16_cublas") | configs


# The attention feeding o in `producer_times`: the FP8 checkpoints' heads (32 query, 4 key/value,
# dim 128), blocks of 128, and a causal selection keeping this fraction of each row's blocks
ATTENTION = {"q_heads": 32, "kv_heads": 4, "head_dim": 128, "block": 128, "density": 0.05}


def producer_times(name, x, quantized, wq, s, rep_ms) -> dict:
    """Where the FP8 layers' producers quantise their inputs (`models.fastpath`): for qkv, the
    input RMSNorm writing e4m3 rows (`fp8_norm.rmsnorm_quant`, `ms_norm_fp8`) against the
    compiled bf16 norm the other layers run (`ms_norm_bf16`); for o, the sparse attention
    writing its output quantised (`ms_attention_fp8`, `block_sparse_attention` with
    `out_scales`) against writing it in bf16 (`ms_attention_bf16`), at `ATTENTION`'s shape and
    density (the row's `attention_<key>` columns); and for both the product of the quantised
    rows alone (`ms_fp8_quantised`, `fp8_linear_quantised`). {} for the other layers."""
    if name not in ("qkv", "o"):
        return {}
    a, a_s = quantized
    ms = {"fp8_quantised": do_bench(lambda: fk.fp8_linear_quantised(a, a_s, wq, s), rep_ms)}
    if name == "qkv":
        from rbs_bench.kernels import fp8_norm

        w = 1 + 0.1 * torch.randn(x.shape[1], device=x.device, dtype=x.dtype)
        norm = torch.compile(fp8_norm.rmsnorm_ref, dynamic=False)
        ms["norm_bf16"] = do_bench(lambda: norm(x, w, 1e-6), rep_ms)
        ms["norm_fp8"] = do_bench(lambda: fp8_norm.rmsnorm_quant(x, w, 1e-6), rep_ms)
        return ms
    bf16, fp8 = attention_outputs(x.shape[0], rep_ms)
    return ms | {"attention_bf16": bf16, "attention_fp8": fp8}


def attention_outputs(tokens: int, rep_ms: int) -> tuple[float, float]:
    """ms of `block_sparse_attention` over `tokens` tokens (`ATTENTION`) writing its output into
    a model's [1, N, H, D] bf16 buffer, and writing it quantised (e4m3 and scales) instead."""
    from rbs_bench.kernels.block_sparse_attn import block_lists_from_mask, block_sparse_attention

    hq, hkv, d, block = (ATTENTION[k] for k in ("q_heads", "kv_heads", "head_dim", "block"))
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    q, k, v = (
        torch.randn(1, h, tokens, d, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        for h in (hq, hkv, hkv)
    )
    m = math.ceil(tokens / block)
    i = torch.arange(m, device=DEVICE)
    causal = i[None, :] <= i[:, None]
    forced = (i[None, :] == 0) | (i[:, None] - i[None, :] <= 1)  # the sink, the diagonal band
    keep = torch.rand(1, hq, m, m, generator=gen, device=DEVICE) < ATTENTION["density"]
    count, indices = block_lists_from_mask((keep | forced) & causal)
    del keep
    out = torch.empty(1, tokens, hq, d, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    out8 = torch.empty(1, tokens, hq, d, device=DEVICE, dtype=fk.FP8_DTYPE).transpose(1, 2)
    scales = torch.empty(hq, tokens, device=DEVICE, dtype=torch.float32)
    lists = (count, indices, block, block)
    bf16 = do_bench(lambda: block_sparse_attention(q, k, v, *lists, out=out), rep_ms)
    fp8 = do_bench(
        lambda: block_sparse_attention(q, k, v, *lists, out=out8, out_scales=scales), rep_ms
    )
    return bf16, fp8


def scaled_mm_ceiling(xq, wq):
    """cuBLAS's fp8 product of the same operands with one scale per tensor (`torch._scaled_mm`):
    not the block-scaled function, the rate the tensor cores reach on this shape. None where
    this torch or GPU has none."""
    fn = getattr(torch, "_scaled_mm", None)
    if fn is None:
        return None
    one = torch.ones((), device=xq.device)

    def run():
        return fn(xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        run()
    except (RuntimeError, TypeError) as e:
        print(f"torch._scaled_mm unavailable here: {str(e).splitlines()[0][:200]}", flush=True)
        return None
    return run


def time_grouped(name, tokens, rep_ms) -> dict:
    n, k = EXPERTS[name]
    wq, s = quantized_weight((NUM_EXPERTS, n, k), seed=n + k)
    offsets = routed_offsets(tokens, seed=tokens)
    x = activations(tokens * TOP_K, k, seed=tokens)
    quantized = fk.fp8_act_quant(x, 128)
    ms, configs = {}, {}
    cublas = fk._use_cublas_grouped(x, wq, BLOCK)
    ms["fp8"], configs["config"] = bench_tuned(
        lambda: fk.fp8_grouped_linear(x, wq, s, offsets, BLOCK), rep_ms, runs_on(x, wq, cublas)
    )
    ms["fp8_quant"] = do_bench(lambda: fk.fp8_act_quant(x, 128), rep_ms)
    ms["fp8_gemm"] = do_bench(
        lambda: fk._launch(x, wq, s, BLOCK, offsets, quantized=quantized), rep_ms
    )
    if _tma_applies(quantized[0], wq):
        ms["fp8_gemm_pointer"] = do_bench(
            lambda: fk._launch(x, wq, s, BLOCK, offsets, quantized=quantized, tma=False), rep_ms
        )
    ms["fp8_fused"], configs["config_fused"] = bench_tuned(
        lambda: fk._launch(x, wq, s, BLOCK, offsets, fused=True), rep_ms
    )
    if fk.cublas_shape_ok(n, k, BLOCK, None) and fp8_gpu(9, 0):
        ms["fp8_triton"] = do_bench(lambda: fk._launch(x, wq, s, BLOCK, offsets), rep_ms)
        ms["fp8_cublas_grouped"] = do_bench(
            lambda: fk.cublas_grouped_linear(x, wq, s, offsets, x.dtype), rep_ms
        )
    gmm = grouped_mm()
    if gmm is not None:
        w_t = fk.dequantize_weight_ref(wq, s, BLOCK).to(torch.bfloat16).transpose(-2, -1)
        ms["bf16_grouped_mm"] = do_bench(lambda: gmm(x, w_t, offs=offsets), rep_ms)
    base = "bf16_grouped_mm" if gmm is not None else None
    return _time_row(ms, 2.0 * x.shape[0] * n * k, base) | configs


def routes(tokens, seed, device=None):
    """(top_k_index [T, 8], softmax weights [T, 8] bf16) of `tokens` tokens routed top-8 of 128
    uniformly."""
    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    scores, index = torch.rand(tokens, NUM_EXPERTS, generator=gen, device=device).topk(TOP_K)
    return index, torch.softmax(scores, -1).to(torch.bfloat16)


def experts_inputs(tokens):
    (gu, gu_s), (dn, dn_s) = (
        quantized_weight((NUM_EXPERTS, *EXPERTS[name]), seed=sum(EXPERTS[name]))
        for name in ("gate_up", "down")
    )
    index, weights = routes(tokens, seed=tokens)
    x = activations(tokens, EXPERTS["gate_up"][1], seed=tokens)
    return x, index, weights, gu, gu_s, dn, dn_s


def experts_unfused(x, index, weights, gu, gu_s, dn, dn_s, grouped=None):
    """The experts block as a layer ran it before `fp8_moe`: a bf16 gather, each grouped product
    quantising its own input, the gate in bf16, the weighted sum (`grouped`: bf16 grouped_mm on
    the dequantised weights instead)."""
    from rbs_bench.kernels.fp8_moe import silu_gate_ref
    from rbs_bench.kernels.moe_combine import moe_combine

    n, k = index.shape
    ids, perm = torch.sort(index.reshape(-1))
    offsets = torch.bincount(ids, minlength=NUM_EXPERTS).cumsum(0).to(torch.int32)
    rows = x[perm // k]
    if grouped is None:
        h = fk.fp8_grouped_linear(rows, gu, gu_s, offsets, BLOCK)
        y = fk.fp8_grouped_linear(silu_gate_ref(h), dn, dn_s, offsets, BLOCK)
    else:
        h = grouped_mm()(rows, grouped[0], offs=offsets)
        y = grouped_mm()(silu_gate_ref(h), grouped[1], offs=offsets)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=perm.device)
    return moe_combine(y, pos.view(n, k), weights)


@contextlib.contextmanager
def _env(name: str, value: str):
    """`name` set to `value` for the block; the caller's own value comes back after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def experts_on_cublas(on: bool):
    """The experts' products on cuBLAS (where `fp8_moe` takes them) or on Triton, for the block."""
    return _env("RBS_BENCH_FP8_CUBLAS_GROUPED", "1" if on else "0")


def tma_off():
    """The Triton products on the pointer kernel instead of the persistent TMA form, for the
    block (`kernels.fp8_gemm._tma_config`)."""
    return _env("RBS_BENCH_FP8_TMA", "0")


def check_experts(tokens, variant) -> dict:
    """The whole experts block (`fp8_moe_experts`, cuBLAS or Triton products) against
    `fp8_moe_experts_ref` in bf16 on 256 sampled tokens, per token: ||kernel - ref|| <=
    2 ||ref - ref in fp32|| + 0.05 ||ref in fp32 - exact|| (exact: fp64 without quantisation)."""
    from rbs_bench.kernels.fp8_moe import fp8_moe_experts, fp8_moe_experts_ref

    x, index, weights, gu, gu_s, dn, dn_s = experts_inputs(tokens)
    with experts_on_cublas(variant == "cublas"):
        got = fp8_moe_experts(x, index, weights, gu, gu_s, dn, dn_s, BLOCK)
    rows = sample_rows(tokens, seed=3)[:256]
    sub = (x[rows], index[rows], weights[rows])
    ref = fp8_moe_experts_ref(*sub, gu, gu_s, dn, dn_s, BLOCK).double()  # bf16, as the layer
    ref32 = fp8_moe_experts_ref(sub[0].float(), sub[1], sub[2].float(), gu, gu_s, dn, dn_s, BLOCK)
    wg = fk.dequantize_weight_ref(gu, gu_s, BLOCK).double()
    wd = fk.dequantize_weight_ref(dn, dn_s, BLOCK).double()
    exact = torch.zeros(rows.numel(), x.shape[1], dtype=torch.float64, device=x.device)
    for t in range(rows.numel()):
        e = sub[1][t]  # the token's 8 experts
        gate, up = torch.einsum("jnk,k->jn", wg[e], sub[0][t].double()).chunk(2, -1)
        ys = torch.einsum("jnk,jk->jn", wd[e], F.silu(gate) * up)
        exact[t] = (sub[2][t, :, None].double() * ys).sum(0)
    # the bf16 pipeline's own spread (its roundings of h and the gate) stands in for the
    # output rounding of the plain products' rule
    err = (got[rows].double() - ref).norm(dim=-1)
    tol = 2 * (ref - ref32.double()).norm(dim=-1) + 0.05 * (ref32.double() - exact).norm(dim=-1)
    return {"ratio": float((err / (tol + 1e-30)).max()), "rows_checked": int(rows.numel())}


def time_experts(tokens, rep_ms) -> dict:
    """The experts block of `tokens` tokens (a feed-forward chunk): `fp8_moe_experts` as the layer
    runs it, with Triton products, the unfused FP8 path, and bf16 grouped_mm the same way; where
    its products run on cuBLAS, the block with its per-expert calls launched from each other
    number of host threads of `LAUNCH_THREADS` (`ms_fp8_threads<n>`; `launch_threads`: the
    default's) and each stage alone (`experts_stages`, `ms_stage_*`). TFLOP/s count both
    products."""
    from rbs_bench.kernels import fp8_moe as fm
    from rbs_bench.kernels.fp8_moe import fp8_moe_experts

    args = experts_inputs(tokens)
    ms, launch = {}, {}
    ms["fp8"] = do_bench(lambda: fp8_moe_experts(*args, BLOCK), rep_ms)
    if fm.cublas_scales(args[1].numel(), args[0], *args[3:], BLOCK) is not None:
        launch["launch_threads"] = default = fm.launch_threads()
        for threads in LAUNCH_THREADS:
            if threads != default:
                with _env("RBS_BENCH_FP8_LAUNCH_THREADS", str(threads)):
                    ms[f"fp8_threads{threads}"] = do_bench(
                        lambda: fp8_moe_experts(*args, BLOCK), rep_ms
                    )
    with experts_on_cublas(False):
        ms["fp8_triton"] = do_bench(lambda: fp8_moe_experts(*args, BLOCK), rep_ms)
        ms["fp8_unfused_triton"] = do_bench(lambda: experts_unfused(*args), rep_ms)
        if _tma_applies(args[0], args[3]):
            with tma_off():
                ms["fp8_triton_pointer"] = do_bench(lambda: fp8_moe_experts(*args, BLOCK), rep_ms)
    ms["fp8_unfused"] = do_bench(lambda: experts_unfused(*args), rep_ms)
    if grouped_mm() is not None:
        w = [
            fk.dequantize_weight_ref(w, sc, BLOCK).to(torch.bfloat16).transpose(-2, -1)
            for w, sc in ((args[3], args[4]), (args[5], args[6]))
        ]
        ms["bf16_grouped_mm"] = do_bench(lambda: experts_unfused(*args, grouped=w), rep_ms)
        # as the bf16 layers run it: the compiled feed-forward region fuses the gather's index
        # arithmetic and the gate (`models.fastpath`); the products and the sum stay the ops above
        compiled = torch.compile(experts_unfused, dynamic=False)
        ms["bf16_compiled"] = do_bench(lambda: compiled(*args, grouped=w), rep_ms)
    ms |= {f"stage_{name}": do_bench(fn, rep_ms) for name, fn in experts_stages(args).items()}
    flops = 2.0 * tokens * TOP_K * sum(n * k for n, k in EXPERTS.values())
    from rbs_bench.tables.blocks_kernels import BF16_BASELINES

    return _time_row(ms, flops, next((b for b in BF16_BASELINES if b in ms), None)) | launch


# the experts block's stages on its cuBLAS path, in the order `fp8_moe._experts` runs them
STAGES = ("rows", "quantise", "gate_up", "gate", "down", "combine")


def experts_stages(args) -> dict:
    """{stage: a call of that stage alone on its own inputs} for `fp8_moe_experts` where its
    products run on cuBLAS (`STAGES`: the expert-sorted row layout, the rows quantised, gate_up,
    the gate with down's quantisation, down, the weighted sum); {} where they stay on Triton.
    The stages' times add up to the block's less the launch gaps between them."""
    from rbs_bench.kernels import fp8_moe as fm

    x, index, weights, gu, gu_s, dn, dn_s = args
    scales = fm.cublas_scales(index.numel(), x, gu, gu_s, dn, dn_s, BLOCK)
    if scales is None:
        return {}
    layout = fm.expert_rows(index, gu.shape[0])
    spans = fm.expert_spans(layout)
    xq, xs = fm.scatter_quant(x, layout, blocked=True)
    h = fm._cublas_products(xq, xs, gu, scales[0], spans, x.dtype)
    aq, a_s = fm.gated_quant(h, layout, blocked=True)
    y = fm._cublas_products(aq, a_s, dn, scales[1], spans, x.dtype)
    calls = (
        lambda: fm.expert_spans(fm.expert_rows(index, gu.shape[0])),
        lambda: fm.scatter_quant(x, layout, blocked=True),
        lambda: fm._cublas_products(xq, xs, gu, scales[0], spans, x.dtype),
        lambda: fm.gated_quant(h, layout, blocked=True),
        lambda: fm._cublas_products(aq, a_s, dn, scales[1], spans, x.dtype),
        lambda: fm._combine(y, layout.pos, weights.to(x.dtype)),
    )
    return dict(zip(STAGES, calls, strict=True))


def _tma_applies(x, wq) -> bool:
    """Whether the Triton products of these operands run in the TMA form (then the pointer
    kernel is timed beside it): x's rows and the weight as quantised operands would be."""
    xq = torch.empty(1, x.shape[-1], dtype=fk.FP8_DTYPE, device=x.device)
    return (
        fk._tma_config(xq, wq, wq.shape[-2], x.shape[-1], BLOCK, False, None, None, None)
        is not None
    )


def _time_row(ms: dict, flops: float, baseline: str | None) -> dict:
    row = {f"ms_{key}": v for key, v in ms.items()}
    # a stage does part of the block's arithmetic, a producer none of the product's: no rate
    partial = ("stage_", "norm_", "attention_")
    row |= {f"tflops_{k}": flops / v / 1e9 for k, v in ms.items() if not k.startswith(partial)}
    if baseline is not None:
        row["x_vs_bf16"] = ms[baseline] / ms["fp8"]
        if "fp8_fused" in ms:
            row["x_fused_vs_bf16"] = ms[baseline] / ms["fp8_fused"]
    return row


def plan(tokens: list[int]) -> list[tuple]:
    """(row id, kind, layer, tokens, variant) in the order they run: checks, then times."""
    rows = []
    for layer in (*LINEAR, *EXPERTS):
        n, k = LINEAR.get(layer, EXPERTS.get(layer))
        cublas = fk.cublas_shape_ok(n, k, BLOCK, None) and fp8_gpu(9, 0)
        for t in (*CHECK_TOKENS, max(tokens)):
            for variant in ("default", "fused", *(("cublas",) if cublas else ())):
                rows.append((f"check-{layer}-{t}-{variant}", "check", layer, t, variant))
    block = ("experts",) if {"gate_up", "down"} <= set(EXPERTS) else ()  # the whole block
    for t in (CHECK_TOKENS[-1], max(tokens)) if block else ():
        for variant in ("default", *(("cublas",) if fp8_gpu(9, 0) else ())):
            rows.append((f"check-experts-{t}-{variant}", "check", "experts", t, variant))
    for t in tokens:
        for layer in (*LINEAR, *EXPERTS, *block):
            rows.append((f"time-{layer}-{t}", "time", layer, t, ""))
    return rows


def run_row(kind, layer, tokens, variant, rep_ms) -> dict:
    if layer == "experts":
        if kind == "check":
            res = check_experts(tokens, variant)
            return res | {"check": "PASS" if res["ratio"] <= 1.0 else "FAIL"}
        return time_experts(tokens, rep_ms)
    grouped = layer in EXPERTS
    if kind == "check":
        res = (check_grouped if grouped else check_linear)(layer, tokens, variant)
        return res | {"check": "PASS" if res["ratio"] <= 1.0 else "FAIL"}
    return (time_grouped if grouped else time_linear)(layer, tokens, rep_ms)


def print_table(rows: list[dict]) -> None:
    checks = [r for r in rows if r["kind"] == "check"]
    if checks:
        passed = sum(r.get("check") == "PASS" for r in checks)
        worst = max((r["ratio"] for r in checks if r.get("check") == "PASS"), default=math.nan)
        print(f"\nchecks: {passed} of {len(checks)} pass (worst passing ratio {worst:.3g})")
    for r in rows:
        if r.get("check") in ("FAIL", "ERROR"):
            print(f"  {r['row']}: {r['check']} {r.get('error') or ''} ratio={r.get('ratio')}")
    times = [r for r in rows if r["kind"] == "time" and r.get("check") != "ERROR"]
    if times:
        print(
            "\nlayer | tokens | fp8 ms (TFLOP/s) | quant ms | gemm ms | fused ms | bf16 ms "
            "(TFLOP/s) | fp8 x | fused x | cuBLAS fp8 per-tensor ms (TFLOP/s)"
        )
        from rbs_bench.tables.blocks_kernels import BF16_BASELINES

        for r in times:
            base = _first(r, *(f"ms_{b}" for b in BF16_BASELINES))
            base_tf = _first(r, *(f"tflops_{b}" for b in BF16_BASELINES))
            print(
                f"{r['layer']} | {r['tokens']} | {r['ms_fp8']:.3f} ({r['tflops_fp8']:.0f}) | "
                f"{_first(r, 'ms_fp8_quant'):.3f} | {_first(r, 'ms_fp8_gemm'):.3f} | "
                f"{_first(r, 'ms_fp8_fused'):.3f} | "
                f"{base:.3f} ({base_tf:.0f}) | {_first(r, 'x_vs_bf16'):.2f} | "
                f"{_first(r, 'x_fused_vs_bf16'):.2f} | "
                f"{_first(r, 'ms_fp8_cublas_tensorwise'):.3f} "
                f"({_first(r, 'tflops_fp8_cublas_tensorwise'):.0f})"
            )
        for line in layer_sums(times):
            print(line)


def layer_sums(times: list[dict]) -> list[str]:
    """Per token count with every layer timed: a decoder layer's products, q + k + v (qkv where
    timed) + o + the experts block (gather, both products, gate, weighted sum), FP8 against bf16
    (`tables.blocks_kernels.fp8_layer_sums`, the sums the docs print)."""
    import pandas as pd

    from rbs_bench.tables.blocks_kernels import fp8_layer_sums, fp8_producer_sums

    df = pd.DataFrame(times)
    lines = [
        f"a layer's products at {tokens} tokens (q, k, v, o, the experts block): "
        f"FP8 {fp8:.2f} ms, bf16 {bf16:.2f} ms, {fp8 / bf16:.3f}x"
        for tokens, fp8, bf16 in fp8_layer_sums(df)
    ]
    return lines + [
        f"with q/k/v's and o's inputs quantised by their producers (the input norm, the sparse "
        f"attention) at {tokens} tokens: FP8 {fp8:.2f} ms, bf16 {bf16:.2f} ms, {fp8 / bf16:.3f}x"
        for tokens, fp8, bf16 in fp8_producer_sums(df)
    ]


def _first(row: dict, *keys) -> float:
    """The first of `keys` that holds a number in a row (a CSV row read back has NaN holes)."""
    for key in keys:
        v = row.get(key)
        if isinstance(v, (int, float)) and not math.isnan(v):
            return float(v)
    return math.nan


def fp8_gpu(major: int = 8, minor: int = 9) -> bool:
    """A CUDA GPU of at least this capability (8.9: fp8 tensor cores; 9.0: cuBLAS's block-scaled
    FP8 recipe)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (major, minor)


def environment() -> dict:
    import triton

    from rbs_bench.kernels.triton_util import kernel_arch

    return dict(
        gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        arch=kernel_arch(), torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/speed"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench time per timing")
    ap.add_argument(
        "--time-budget-s", type=positive_seconds, default=540.0, help="start no row after this"
    )
    ap.add_argument("--no-checks", action="store_true", help="times only")
    args = ap.parse_args(argv)
    if not fp8_gpu():
        print(
            "rbs-bench: error: the FP8 kernels need a CUDA GPU with fp8 tensor cores "
            "(capability 8.9 or newer)",
            file=sys.stderr,
        )
        return 2
    import pandas as pd

    from rbs_bench.bench.attention import gpu_tag

    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / f"fp8_gemm_{gpu_tag()}.csv"
    rows = pd.read_csv(csv).to_dict("records") if csv.exists() else []
    rows = [r for r in rows if not isinstance(r.get("error"), str)]  # failed rows run again
    done = {r["row"] for r in rows}
    env = environment()
    (args.out / "fp8_gemm_env.json").write_text(json.dumps(env, indent=1))
    print(env, flush=True)

    for row_id, kind, layer, tokens, variant in plan(args.tokens):
        if row_id in done or (kind == "check" and args.no_checks):
            continue
        if time.monotonic() - start > args.time_budget_s:
            print(f"time budget spent; rerun to continue ({csv})", flush=True)
            break
        row = {"row": row_id, "kind": kind, "layer": layer, "tokens": tokens, "variant": variant}
        try:
            row |= run_row(kind, layer, tokens, variant, args.rep_ms)
        except Exception as e:  # recorded, not fatal: the next rows still run
            first = str(e).splitlines()[0][:300] if str(e) else ""
            row |= {"check": "ERROR", "error": f"{type(e).__name__}: {first}"}
            traceback.print_exc()
        row["gpu"] = env["gpu"]
        rows.append(row)
        pd.DataFrame(rows).to_csv(csv, index=False)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        print(shown, flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    print(f"wrote {csv}")
    return 1 if any(r.get("check") in ("FAIL", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
