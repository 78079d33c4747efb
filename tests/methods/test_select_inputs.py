"""Every registered method's `select` rejects inputs it cannot select on, with a ValueError that
says what is wrong: non-finite q/k, scores past float32, no tokens, non-float dtypes
(methods/selection.py `check_inputs`)."""

from __future__ import annotations

import pytest
import torch

from rbs_bench import methods
from rbs_bench.methods.selection import finite_checked

N, D = 512, 16


def _qk(n: int = N, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, D, generator=gen)
    k = torch.randn(1, 2, n, D, generator=gen)
    return q.to(dtype), k.to(dtype)


def _poison(which: str, value: float):
    q, k = _qk()
    (q if which == "q" else k)[0, 1, 300, 3] = value
    return q, k


@pytest.mark.parametrize("name", methods.available())
@pytest.mark.parametrize(
    "case,inputs,match",
    [
        ("nan in q", lambda: _poison("q", float("nan")), "q holds NaN or Inf"),
        ("inf in k", lambda: _poison("k", float("inf")), "k holds NaN or Inf"),
        ("-inf in q", lambda: _poison("q", float("-inf")), "q holds NaN or Inf"),
        ("no tokens", lambda: _qk(0), r"are empty \(N = 0 tokens"),
        ("integer", lambda: _qk(dtype=torch.int32), "must be floating point"),
        ("bool", lambda: _qk(dtype=torch.bool), "must be floating point"),
    ],
)
def test_select_rejects_bad_inputs(name, case, inputs, match):
    q, k = inputs()
    with pytest.raises(ValueError, match=match):
        methods.build(name).select(q, k)


@pytest.mark.parametrize("name", methods.available())
def test_select_accepts_finite_float_inputs(name):
    q, k = _qk()
    sel = methods.build(name).select(q, k)
    assert 0 < sel.density() <= 1


def test_huge_finite_values_are_refused_as_overflow_not_mistaken_for_inf():
    q, k = _qk()
    q[..., 0] = 3e38  # each finite in fp32; their norm and every score with them overflow
    with pytest.raises(ValueError, match="too large for float32 scores"):
        methods.build("rbs", impl="torch").select(q, k)
    q[..., 0] = 1e6  # large, yet every score fits float32 many times over
    assert 0 < methods.build("rbs", impl="torch").select(q, k).density() <= 1


def test_finite_check_is_skipped_where_the_caller_made_it():
    q, k = _poison("q", float("nan"))
    with finite_checked():  # the attention hook checks q and k itself (models/hf_attention.py)
        methods.build("dense").select(q, k)
    with pytest.raises(ValueError, match="NaN"):
        methods.build("dense").select(q, k)
