"""Executor choice and dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rbs_bench.execution import EXECUTORS, HAS_TRITON, execute, resolve_executor
from rbs_bench.methods.selection import BlockSelection

CUDA_AUTO = "triton" if HAS_TRITON else "flex"


@pytest.mark.parametrize(
    "name, device, expected",
    [
        ("auto", "cpu", "reference"),
        ("auto", torch.device("cpu"), "reference"),
        ("auto", "cuda", CUDA_AUTO),
        ("auto", torch.device("cuda", 0), CUDA_AUTO),
        ("reference", "cuda", "reference"),
        ("reference", "cpu", "reference"),
        ("flex", "cuda", "flex"),
        ("triton", "cuda", "triton"),
        ("triton", "cpu", "triton"),
    ],
)
def test_resolve_executor(name, device, expected):
    assert resolve_executor(name, device) == expected


def test_resolve_executor_rejects_unknown():
    with pytest.raises(ValueError, match="auto, reference, flex, triton") as info:
        resolve_executor("triton-fast", "cpu")
    assert "triton-fast" in str(info.value)
    assert EXECUTORS == ("reference", "flex", "triton")


def test_auto_falls_back_to_flex_without_triton(monkeypatch):
    monkeypatch.setattr("rbs_bench.execution.HAS_TRITON", False)
    assert resolve_executor("auto", "cuda") == "flex"
    assert resolve_executor("auto", "cpu") == "reference"


def test_execute_full_selection_is_causal_attention():
    q, k, v = torch.randn(2, 4, 200, 32), torch.randn(2, 2, 200, 32), torch.randn(2, 2, 200, 32)
    sel = BlockSelection.full(2, 4, 200, 64)
    out = execute(q, k, v, sel, executor="auto")
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_execute_errors():
    q = torch.randn(1, 2, 100, 16)
    with pytest.raises(ValueError, match="seq_len=128"):
        execute(q, q, q, BlockSelection.full(1, 2, 128, 64))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        execute(q, q, q, BlockSelection.full(1, 2, 100, 64), executor="flex")
    # without triton: a one-line RuntimeError; with it (not interpreted): CPU tensors refused
    with pytest.raises((ValueError, RuntimeError), match="needs CUDA tensors|needs triton"):
        execute(q, q, q, BlockSelection.full(1, 2, 100, 64), executor="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("executor", ["auto", "triton"])
def test_execute_full_selection_is_causal_attention_gpu(executor):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1000, 64, generator=gen) for h in (4, 2, 2))
    truth = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    sel = BlockSelection.full(1, 4, 1000, 128, device="cuda")
    out = execute(q, k, v, sel, executor=executor)
    torch.testing.assert_close(out.float().cpu(), truth, atol=2e-2, rtol=2e-2)


def test_execute_writes_into_a_model_layout_buffer():
    """`out=` in [B, N, Hq, D] memory seen as [B, Hq, N, D] (what the HF hook passes) is filled
    and returned, by the reference here and by MInference's own executor."""
    from rbs_bench import methods

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 160, 32), torch.randn(1, 2, 160, 32), torch.randn(1, 2, 160, 32)
    sel = BlockSelection.full(1, 4, 160, 64)
    buf = torch.full((1, 160, 4, 32), float("nan")).transpose(1, 2)
    got = execute(q, k, v, sel, executor="reference", out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, execute(q, k, v, sel, executor="reference"))
    own = methods.build("minference").select(q, k)
    buf = torch.full((1, 160, 4, 32), float("nan")).transpose(1, 2)
    got = execute(q, k, v, own, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, execute(q, k, v, own))


def test_execute_writes_the_output_quantised_for_an_fp8_projection():
    """With `out_scales` an executor other than the Triton kernel quantises its output, seen as the
    o projection's rows [B * N, Hq * D], into the e4m3 `out` (a model's [B, N, Hq, D] memory) and
    the group-major scales [Hq, B * N]: `act_quant_ref` of those rows. A bf16 `out` is refused."""
    from rbs_bench.kernels.fp8_gemm import act_quant_ref

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 100, 128, generator=gen) for h in (4, 2, 2))
    sel = BlockSelection.full(2, 4, 100, 64)
    b, h, n, d = q.shape
    out = torch.empty(b, n, h, d, dtype=torch.float8_e4m3fn).transpose(1, 2)
    scales = torch.empty(h, b * n)
    got = execute(q, k, v, sel, executor="reference", out=out, out_scales=scales)
    assert got.data_ptr() == out.data_ptr()
    rows = execute(q, k, v, sel, executor="reference").transpose(1, 2).reshape(b * n, h * d)
    want_q, want_s = act_quant_ref(rows, d)
    assert torch.equal(out.transpose(1, 2).reshape(b * n, h * d).view(torch.uint8),
                       want_q.view(torch.uint8))  # fmt: skip
    assert torch.equal(scales, want_s.t())
    with pytest.raises(ValueError, match="out_scales needs an e4m3 `out`"):
        execute(q, k, v, sel, executor="reference", out=torch.empty_like(q), out_scales=scales)
