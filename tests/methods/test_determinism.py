"""Selection on the CPU is a pure function of q and k: the same selection on every call and with
any number of threads, ties included (docs/design.md §3, "Determinism")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rbs_bench import methods


def _fields(sel) -> dict:
    return {f.name: getattr(sel, f.name) for f in dataclasses.fields(sel)}


def _same(a, b) -> bool:
    fa, fb = _fields(a), _fields(b)
    return fa.keys() == fb.keys() and all(
        torch.equal(x, fb[k]) if isinstance(x, torch.Tensor) else x == fb[k] for k, x in fa.items()
    )


def _inputs(ties: bool):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1024, 32, generator=gen)
    k = torch.randn(1, 2, 1024, 32, generator=gen)
    if ties:  # every key block the same: equal scores everywhere, ties at every threshold
        k = k[:, :, :128].repeat(1, 1, 8, 1)
        q = q[:, :, :128].repeat(1, 1, 8, 1)
    return q, k


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", methods.available())
def test_select_repeats_exactly_across_calls_and_threads(name, ties):
    q, k = _inputs(ties)
    selector = methods.build(name)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(threads, 2))
        first, again = selector.select(q, k), selector.select(q.clone(), k.clone())
        torch.set_num_threads(1)
        single = selector.select(q, k)
    finally:
        torch.set_num_threads(threads)
    assert _same(first, again)
    assert _same(first, single)
