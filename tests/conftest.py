"""What the tests share, defined once: structured q/k inputs, the comparison of two selections
as sets with near-threshold blocks excepted, and the test of which blocks lie near a threshold.

Test modules import them as `from conftest import structured_qk, assert_same_sets, within`
(pytest puts this directory on sys.path when it loads this file).
"""

from __future__ import annotations

import math
import os

import torch

# Kernels launch with their tuning space's first configuration, untimed: the tests check values,
# and timing every configuration at every new shape would take most of the GPU suite's time.
# The benches under rbs_bench.bench tune over the whole space.
os.environ.setdefault("RBS_BENCH_AUTOTUNE", "first")


def _local(g, b, hq, hkv, n, d):
    """Local (rotary-like) attention, sink-like first keys, and needle keys later rows read."""
    pos = torch.arange(n)[:, None] * torch.logspace(-2.5, 0, d // 2)[None, :]
    rope = torch.cat([pos.cos(), pos.sin()], -1)
    q = 2.0 * rope + torch.randn(b, hq, n, d, generator=g)
    k = 2.0 * rope + torch.randn(b, hkv, n, d, generator=g)
    k[:, :, :4] += 2 * torch.randn(b, hkv, 1, d, generator=g)  # sink-like first tokens
    for j in torch.randint(0, n - 1, (4,), generator=g).tolist():
        k[:, :, j] += 0.3 * q[:, :: hq // hkv, j:].sum(2).clamp(-4, 4)  # a needle later rows read
    return q, k


def _tempered(g, b, hq, hkv, n, d):
    """Heads of four temperatures along a shared direction c, with sink keys and strong single
    columns along c (the sharp heads put their mass on a few tokens, which block means dilute);
    with several KV heads the last one has keys constant over blocks of 32 (block means see them
    exactly). Both query-aware and vertical-slash heads occur."""
    grp = hq // hkv
    c = torch.randn(b, hkv, 1, d, generator=g)
    c = c / c.norm(dim=-1, keepdim=True) * math.sqrt(d)
    temp = torch.tensor([0.2, 1.0, 0.5, 2.0])[torch.arange(hq) % 4].view(1, hq, 1, 1)
    q = torch.randn(b, hq, n, d, generator=g) + temp * c.repeat_interleave(grp, 1)
    k = torch.randn(b, hkv, n, d, generator=g) * 0.5
    k[:, :, : min(4, n)] += c  # sinks
    k[:, :, 37::211] += 2.5 * c  # strong columns
    if hkv > 1:
        m = math.ceil(n / 32)
        levels = torch.randn(b, m, d, generator=g).repeat_interleave(32, 1)[:, :n]
        k[:, -1] = 0.5 * levels + 0.05 * torch.randn(b, n, d, generator=g)
    return q, k


def _needles(g, b, hq, hkv, n, d, stride=97, span=30, reader=5):
    """Random q/k with a shared key direction (sink-like bias), and every `stride` tokens a
    dispersed block: one strong key that the query `reader` tokens later matches, then `span`
    keys scaled up (a diluted needle)."""
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g) * 0.3
    k += torch.randn(b, hkv, 1, d, generator=g)
    for j in range(0, n, stride):
        k[:, :, j] += 4 * q[:, :: hq // hkv, min(n - 1, j + reader)]
        k[:, :, j + 1 : j + span] *= 2.5
    return q * 1.5, k


def _sinks(g, b, hq, hkv, n, d):
    """Random q/k whose first keys every query leans to (sink-like)."""
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    k[:, :, : min(4, n)] += 3
    return q + 1, k


KINDS = {"local": _local, "tempered": _tempered, "needles": _needles, "sinks": _sinks}


def structured_qk(
    b, hq, hkv, n, d, seed, kind="local", dtype=torch.float32, device="cpu", **params
):
    """Seeded q [b, hq, n, d] and k [b, hkv, n, d] with the structure of real attention that a
    selector test needs: `kind` is one of KINDS (each described in its docstring), `params` its
    own settings (needles: stride, span, reader). Built in fp32 on the CPU, then moved."""
    q, k = KINDS[kind](torch.Generator().manual_seed(seed), b, hq, hkv, n, d, **params)
    return q.to(device, dtype), k.to(device, dtype)


def within(values: torch.Tensor, cuts, eps) -> torch.Tensor:
    """bool like `values`: within `eps` (strictly) of any of `cuts` (tensors broadcasting
    against values, e.g. a row's threshold, or the last kept and first dropped score)."""
    near = torch.zeros_like(values, dtype=torch.bool)
    for cut in cuts:
        near |= (values - cut).abs() < eps
    return near


def assert_same_sets(got, want, near, what="", share=0.02, floor=3, first=0, pairs=None):
    """got and want (bool [..., M, M] selections) agree outside `near`, the blocks within
    rounding of a threshold, and those are few: at most max(floor, share * pairs), with `pairs`
    the candidate pairs, by default the (i, j) with first <= j < i of every leading index."""
    m = got.shape[-1]
    if pairs is None:
        pairs = got[..., 0, 0].numel() * (m - first) * (m - first - 1) // 2
    excepted = int(near.sum())
    assert excepted <= max(floor, share * max(1, pairs)), f"{excepted} boundary blocks {what}"
    differ = (got != want) & ~near
    assert not differ.any(), f"{int(differ.sum())} blocks differ ({excepted} excepted) {what}"
