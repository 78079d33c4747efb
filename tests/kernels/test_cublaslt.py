"""The experts' products issued straight to cuBLASLt (`kernels/cublaslt.py`).

Its reference is `torch._scaled_mm`, which runs the same cuBLASLt matmul with the same algorithm:
on the GPU the two give the same bytes. On CPU machines the library is absent and the products
keep `torch._scaled_mm` (the loop's CPU test is in test_fp8_moe.py).
"""

from __future__ import annotations

import pytest
import torch
from rbs_bench.kernels import cublaslt, fp8_moe
from rbs_bench.kernels.triton_util import INTERPRET
from test_fp8_gemm import FP8_GPU, quantized_weight


def test_no_library_means_no_direct_products(monkeypatch):
    """Without CUDA (or without a cuBLASLt of 12.9 or newer) nothing is called directly: the
    device is not `available`, the products take `torch._scaled_mm`, and making a `Products`
    says in one line what is missing."""
    assert not cublaslt.available(torch.device("cpu"))
    monkeypatch.setattr(cublaslt, "library", lambda: None)
    with pytest.raises(RuntimeError, match=r"cuBLASLt with block-scaled FP8 \(12.9 or newer\)"):
        cublaslt.Products(torch.device("cpu"), 256, 256)
    xq = torch.zeros(8, 256).to(torch.float8_e4m3fn)
    weight, scales = quantized_weight((2, 256, 256), (128, 128))
    assert not fp8_moe._direct(xq, torch.ones(16), weight, scales, torch.bfloat16)


def test_the_environment_turns_direct_products_off(monkeypatch):
    monkeypatch.delenv("RBS_BENCH_FP8_DIRECT_LT", raising=False)
    assert cublaslt.enabled()
    monkeypatch.setenv("RBS_BENCH_FP8_DIRECT_LT", "0")
    assert not cublaslt.enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU or INTERPRET, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("threads", ["1", "2"])
def test_gpu_direct_products_are_scaled_mms_bytes(threads, monkeypatch):
    """Qwen3-30B-A3B's two expert products (gate_up 1536 x 2048; down 2048 x 768, whose scales
    cuBLAS reads in their padded layout) over experts of 0, 4, 12, 1,000 and 4,100 rows and rows
    past the last expert: the direct calls write the same bytes as `torch._scaled_mm`, from one
    and from two launch threads."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLAS's block-scaled recipe needs Hopper")
    device = torch.device("cuda", torch.cuda.current_device())
    assert cublaslt.available(device)
    print("cuBLASLt", cublaslt.library().cublasLtGetVersion())
    monkeypatch.setenv("RBS_BENCH_FP8_LAUNCH_THREADS", threads)
    counts = [1000, 0, 4, 4100, 12, 0, 1000, 8]
    spans = [(sum(counts[:e]), c) for e, c in enumerate(counts)]
    rows = sum(counts) + 12
    gen = torch.Generator(device=device).manual_seed(int(threads))
    for n, k in ((1536, 2048), (2048, 768)):
        weight, w_s = quantized_weight((len(counts), n, k), (128, 128), n, device)
        scales = fp8_moe.cublas_weight_scales(w_s)
        xq = (torch.randn(rows, k, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
        xs = torch.rand(k // 128 * rows, generator=gen, device=device) / 256 + 1e-4
        outs = {}
        for direct in ("1", "0"):
            monkeypatch.setenv("RBS_BENCH_FP8_DIRECT_LT", direct)
            assert fp8_moe._direct(xq, xs, weight, scales, torch.bfloat16) == (direct == "1")
            with torch.inference_mode():
                outs[direct] = fp8_moe._cublas_products(
                    xq, xs, weight, scales, spans, torch.bfloat16
                )
        assert torch.equal(outs["1"], outs["0"]), (n, k)
        assert bool((outs["1"][sum(counts) :] == 0).all())
        assert float(outs["1"][:1000].float().abs().amax()) > 0


def test_the_loop_hands_cublaslt_each_experts_addresses(monkeypatch):
    """With the direct calls on, `_cublas_products` hands `Products.launch` one call per non-empty
    expert: its row count and the addresses of its first row, its [G, count] block of scales, its
    weight, its weight scales (in the padded layout down's K = 768 takes) and its first output
    row, every call once over the launch threads' shares; the rows past the last expert are
    zeros."""
    calls = []

    class Recorder:
        def launch(self, share, stream=None):
            calls.extend(share)

    monkeypatch.setattr(fp8_moe, "_direct", lambda *args: True)
    monkeypatch.setattr(cublaslt, "products", lambda *args: Recorder())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)  # a CPU machine
    counts, groups, n = [8, 0, 4, 12], 6, 256
    spans = [(sum(counts[:e]), c) for e, c in enumerate(counts)]
    rows = sum(counts) + 6
    xq = torch.zeros(rows, 128 * groups).to(torch.float8_e4m3fn)
    xs = torch.rand(groups * rows)
    weight, w_s = quantized_weight((len(counts), n, 128 * groups), (128, 128))
    scales = fp8_moe.SCALE_LAYOUTS["padded_view"](w_s)
    out = fp8_moe._cublas_products(xq, xs, weight, scales, spans, torch.bfloat16)
    want = [
        (c, xq[f].data_ptr(), xs[groups * f :].data_ptr(), weight[e].data_ptr(),
         scales[e].data_ptr(), out[f].data_ptr())
        for e, (f, c) in enumerate(spans) if c
    ]  # fmt: skip
    assert sorted(calls) == sorted(want)
    assert bool((out[sum(counts) :] == 0).all())
