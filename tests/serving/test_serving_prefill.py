"""Sparse prefill over a packed batch (the vLLM backend's core, runnable without vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from rbs_bench.kernels.block_sparse_attn import expand_block_mask

from rbs_bench.execution import execute
from rbs_bench.methods import build
from rbs_bench.serving.prefill import (
    ENV_VAR,
    PrefillSpec,
    StepStats,
    pack_selections,
    sparse_prefill,
    summarize,
)

HQ, HKV, D, BLOCK = 4, 2, 64, 32
LENGTHS = [1, 127, 300, 129, 33]  # one token, partial blocks, a 10-block prompt
TIGHT = dict(block_size=BLOCK, sink_blocks=1, window_blocks=1, last_q_blocks=0)


def packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, HQ, D, generator=g)
    k = torch.randn(t, HKV, D, generator=g)
    v = torch.randn(t, HKV, D, generator=g)
    k[40:72] *= 3.0  # a dispersed key block inside the long prompt's span
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    return q, k, v, bounds


def heads_first(x):
    return x.transpose(0, 1).unsqueeze(0)


def masked_sdpa(q, k, v, token_mask, scale):
    """Dense attention with the selection expanded to tokens: the reference for sparse output."""
    return F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v), attn_mask=token_mask, scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip


def run(q, k, v, bounds, selector, fill=0.0):
    out = torch.full_like(q, fill)
    dens, marks = sparse_prefill(q, k, v, bounds, selector, "reference", D**-0.5, out)
    return out, dens, marks


def test_keep_every_block_is_causal_attention_of_each_sequence_alone():
    q, k, v, bounds = packed(LENGTHS)
    keep_all = build("rbs", block_size=BLOCK, alpha_base=0.0, alpha_rescue=0.0)
    out, dens, marks = run(q, k, v, bounds, keep_all)
    for (a, b), d in zip(bounds, dens):
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        ref = masked_sdpa(q[a:b], k[a:b], v[a:b], causal, D**-0.5)
        torch.testing.assert_close(out[a:b], ref, atol=2e-5, rtol=0)
        assert d.shape == (HQ,) and torch.all(d == 1.0)
    assert len(marks) == 3 and marks[0] <= marks[1] <= marks[2]


def test_each_sequence_gets_its_own_selection_and_only_its_own_keys():
    q, k, v, bounds = packed(LENGTHS)
    selector = build("rbs", **TIGHT).with_knob(5.0)  # alpha_base > 1: base keeps none
    out, dens, _ = run(q, k, v, bounds, selector)
    scale = D**-0.5
    sparse_seen = False
    for (a, b), d in zip(bounds, dens):
        alone = selector.select(heads_first(q[a:b]), heads_first(k[a:b]), scale=scale)
        torch.testing.assert_close(d, alone.head_density()[0].float())
        token_mask = expand_block_mask(alone.mask(), BLOCK, BLOCK, b - a)[0]  # [Hq, n, n]
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        ref = masked_sdpa(q[a:b], k[a:b], v[a:b], token_mask & causal, scale)
        torch.testing.assert_close(out[a:b], ref, atol=2e-5, rtol=0)
        sparse_seen |= bool((d < 1).any())
    assert sparse_seen  # the 300-token prompt keeps fewer than all of its block pairs

    # Scoring the batch as one sequence would select (and attend) differently.
    t = q.shape[0]
    whole = selector.select(heads_first(q), heads_first(k), scale=scale)
    as_one = execute(heads_first(q), heads_first(k), heads_first(v), whole, "reference", scale)
    assert not torch.allclose(as_one[0].transpose(0, 1)[bounds[2][0] :], out[bounds[2][0] :])
    assert t == sum(LENGTHS)


def test_rows_outside_the_bounds_are_left_alone():
    q, k, v, bounds = packed([5, 200, 3, 90])
    chosen = [bounds[1], bounds[3]]  # rows 0-4 and 205-207 belong to other requests
    selector = build("rbs", **TIGHT)
    out, dens, _ = run(q, k, v, chosen, selector, fill=7.0)
    assert len(dens) == 2
    for a, b in (bounds[0], bounds[2]):
        assert torch.all(out[a:b] == 7.0)
    ref, _, _ = run(q, k, v, chosen[:1], selector)
    torch.testing.assert_close(out[slice(*chosen[0])], ref[slice(*chosen[0])])


@dataclass(frozen=True)
class EveryOtherKey:
    """A token-level pattern (not block-level): query t sees the keys of t's parity, so it must
    go through its own executor, one sequence at a time."""

    n: int
    heads: int

    def head_density(self):
        return torch.full((1, self.heads), 0.5, dtype=torch.float64)

    def attend(self, q, k, v, scale=None, executor="auto"):
        pos = torch.arange(self.n)
        mask = (pos[:, None] >= pos) & (pos[:, None] % 2 == pos % 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class ParitySelector:
    is_dense = False

    def select(self, q, k, scale=None):
        return EveryOtherKey(q.shape[2], q.shape[1])


def test_token_level_patterns_run_one_sequence_at_a_time():
    q, k, v, bounds = packed([300, 129])
    out, dens, _ = run(q, k, v, bounds, ParitySelector())
    for (a, b), d in zip(bounds, dens):
        pos = torch.arange(b - a)
        mask = (pos[:, None] >= pos) & (pos[:, None] % 2 == pos % 2)
        ref = masked_sdpa(q[a:b], k[a:b], v[a:b], mask, D**-0.5)
        torch.testing.assert_close(out[a:b], ref, atol=2e-5, rtol=0)
        assert torch.all(d == 0.5)


def test_pack_selections_pads_shorter_sequences_with_empty_blocks():
    q, k, _, bounds = packed([300, 33])
    sel = build("rbs", **TIGHT)
    sels = [sel.select(heads_first(q[a:b]), heads_first(k[a:b])) for a, b in bounds]
    count, indices = pack_selections(sels)
    assert count.shape == (2, HQ, 10) and indices.shape == (2, HQ, 10, 10)
    assert torch.equal(count[1, :, :2], sels[1].kv_count[0])
    assert torch.all(count[1, :, 2:] == 0)


def test_spec_round_trips_through_the_environment(monkeypatch):
    spec = PrefillSpec("rbs", {"block_size": 64}, knob=1.5, executor="reference")
    monkeypatch.setenv(ENV_VAR, spec.to_json())
    back = PrefillSpec.from_env()
    assert back == spec
    sel = back.selector()
    assert (sel.alpha_base, sel.alpha_rescue, sel.block_size) == pytest.approx((0.33, 0.27, 64))
    monkeypatch.delenv(ENV_VAR)
    assert PrefillSpec.from_env() is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (PrefillSpec("nosuch"), "valid methods: .*rbs"),
        (PrefillSpec("dense", knob=0.5), "has no knob"),
        (PrefillSpec("rbs", {"alpha": 0.1}), "valid fields"),
        (PrefillSpec("rbs", executor="fast"), "choose one of"),
    ],
)
def test_bad_spec_fails_in_the_callers_process(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.check("cpu")


def test_bad_json_names_the_variable():
    with pytest.raises(ValueError, match=ENV_VAR):
        PrefillSpec.from_json('{"method": "rbs", "budget": 1}')


def test_step_stats_split_steps_and_convert_times():
    stats = StepStats()
    dens = [torch.tensor([1.0, 0.5])]
    for step in range(2):
        for layer in ("l0", "l1"):
            base = float(step * 10)
            stats.add(layer, "sparse", [300], dens, (base, base + 0.002, base + 0.005))
    entries = stats.drain()
    assert [e["step"] for e in entries] == [0, 0, 1, 1]
    assert entries[0]["selector_ms"] == pytest.approx(2.0)
    assert entries[0]["attention_ms"] == pytest.approx(3.0)
    s = summarize(entries)
    assert s["density"] == pytest.approx(0.75)
    assert s["prefill_attention_ms"] == pytest.approx(20.0)
    assert s["layer_calls"] == 4 and s["paths"] == ["sparse"]
    assert stats.drain() == []
