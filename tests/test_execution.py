"""Executor choice and dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rbs_bench.execution import EXECUTORS, execute, resolve_executor
from rbs_bench.methods.selection import BlockSelection


@pytest.mark.parametrize(
    "name, device, expected",
    [
        ("auto", "cpu", "reference"),
        ("auto", torch.device("cpu"), "reference"),
        ("auto", "cuda", "flex"),
        ("auto", torch.device("cuda", 0), "flex"),
        ("reference", "cuda", "reference"),
        ("reference", "cpu", "reference"),
        ("flex", "cuda", "flex"),
    ],
)
def test_resolve_executor(name, device, expected):
    assert resolve_executor(name, device) == expected


def test_resolve_executor_rejects_unknown():
    with pytest.raises(ValueError, match="auto, reference, flex") as info:
        resolve_executor("triton-fast", "cpu")
    assert "triton-fast" in str(info.value)
    assert EXECUTORS == ("reference", "flex")


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
