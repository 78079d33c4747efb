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
