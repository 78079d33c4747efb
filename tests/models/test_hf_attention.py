"""The `rbs_sparse` attention hook inside tiny random Qwen3 / Qwen3-MoE / Llama models."""

from __future__ import annotations

import pytest
import torch
from model_fakes import BLOCK, N_TOKENS, FakeDense, KeepAll, SinkAndDiagonal, make_model, random_ids

from rbs_bench.methods import build
from rbs_bench.models import hf_attention
from rbs_bench.models.hf_attention import ATTN_IMPL, install, uninstall

ARCHS = ["qwen3", "qwen3_moe", "llama"]


@torch.no_grad()
def logits(model, ids, **kw):
    return model(input_ids=ids, use_cache=False, **kw).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_selector_matches_stock_sdpa(arch):
    ids = random_ids()
    model = make_model(arch)
    ref = logits(model, ids)
    for selector in (build("dense", block_size=BLOCK), FakeDense()):
        rec = install(model, selector)
        assert model.config._attn_implementation == ATTN_IMPL
        torch.testing.assert_close(logits(model, ids), ref, atol=1e-5, rtol=0)
        s = rec.summary()
        assert s["num_layers"] == 2 and s["density_mean"] == 1.0
        uninstall(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_every_block_matches_dense(arch):
    ids = random_ids()
    model = make_model(arch)
    ref = logits(model, ids)
    selector = KeepAll()
    rec = install(model, selector, executor="reference")
    torch.testing.assert_close(logits(model, ids), ref, atol=1e-5, rtol=0)
    assert len(selector.calls) == 2  # one select per layer, on the unexpanded GQA shapes
    assert rec.summary()["density_mean"] == pytest.approx(1.0)


def test_registered_rbs_keeping_every_block_matches_dense():
    # alpha = 0 keeps every candidate: the real selector and executor reproduce dense logits
    ids = random_ids()
    model = make_model("qwen3")
    ref = logits(model, ids)
    install(
        model,
        build("rbs", block_size=BLOCK, alpha_base=0.0, alpha_rescue=0.0),
        executor="reference",
    )
    torch.testing.assert_close(logits(model, ids), ref, atol=1e-5, rtol=0)


def test_module_without_state_runs_dense():
    ids = random_ids(100)
    model = make_model("qwen3")
    ref = logits(model, ids)
    model.set_attn_implementation(ATTN_IMPL)  # registered, but no selector attached
    hf_attention.register()
    torch.testing.assert_close(logits(model, ids), ref, atol=1e-6, rtol=0)


def _pad(rows, side="left", pad_id=0):
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(n - len(r), n) if side == "left" else slice(0, len(r))
        ids[i, span], mask[i, span] = r, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_each_prompt_alone(side):
    rows = [random_ids(N_TOKENS, seed=2)[0], random_ids(170, seed=3)[0]]
    model = make_model("qwen3")
    install(model, SinkAndDiagonal(), executor="reference")
    alone = [logits(model, r[None])[0] for r in rows]

    ids, mask = _pad(rows, side)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = logits(model, ids, attention_mask=mask, position_ids=pos)
    for i in range(len(rows)):
        valid = mask[i].bool()
        torch.testing.assert_close(batch[i][valid], alone[i], atol=1e-5, rtol=0)


def test_padded_batch_attention_sees_mask_and_zeros_pads(monkeypatch):
    # Guards the mask registration: without it transformers passes attention_mask=None.
    seen = []
    real = hf_attention._sparse_padded

    def spy(state, q, k, v, mask, *args):
        out = real(state, q, k, v, mask, *args)
        seen.append((mask.shape, out[0]))
        return out

    monkeypatch.setattr(hf_attention, "_sparse_padded", spy)
    model = make_model("qwen3")
    install(model, KeepAll(), executor="reference")
    ids, mask = _pad([random_ids(130)[0], random_ids(100)[0]])
    logits(model, ids, attention_mask=mask)
    assert len(seen) == 2 and seen[0][0] == (2, 1, 130, 130)
    assert seen[0][1][1, :, :30].abs().max() == 0  # pad positions of row 1 are zeros


def test_non_contiguous_padding_is_refused():
    model = make_model("qwen3")
    install(model, KeepAll(), executor="reference")
    ids = random_ids(130, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 40:50] = 0
    with pytest.raises(ValueError, match="non-contiguous"):
        logits(model, ids, attention_mask=mask)


def test_recorder_one_entry_per_layer():
    model = make_model("qwen3_moe")
    rec = install(model, SinkAndDiagonal(full_from=2), executor="reference")
    for _ in range(2):  # a second forward replaces the first one's records
        logits(model, random_ids())
    s = rec.summary()
    assert s["num_layers"] == 2
    assert [len(row) for row in s["density_layers_heads"]] == [4, 4]
    for row in s["density_layers_heads"]:
        assert all(0 < d <= 1 for d in row)
        assert row[2] == row[3] == 1.0 and row[0] < 1.0  # heads >= 2 keep every block
    assert 0 < s["density_mean"] < 1
    assert s["selector_s"] >= 0 and s["attention_s"] > 0
    rec.reset()
    assert rec.summary()["num_layers"] == 0


def test_recorder_density_of_registered_rbs():
    model = make_model("qwen3")
    rec = install(
        model,
        build("rbs", block_size=32, sink_blocks=1, window_blocks=1, last_q_blocks=1),
        executor="reference",
    )
    logits(model, random_ids(600))
    s = rec.summary()
    assert s["num_layers"] == 2
    assert all(0 < d <= 1 for row in s["density_layers_heads"] for d in row)


def test_generate_after_sparse_prefill_decodes_with_sdpa(monkeypatch):
    shapes = []
    real_sdpa = hf_attention.sdpa_attention_forward

    def spy(module, q, k, *args, **kwargs):
        shapes.append((q.shape[2], k.shape[2]))
        return real_sdpa(module, q, k, *args, **kwargs)

    ids = random_ids(200)
    model = make_model("qwen3")
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        selector = KeepAll()
        install(model, selector, executor="reference")
        monkeypatch.setattr(hf_attention, "sdpa_attention_forward", spy)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    assert torch.equal(out, ref)
    assert len(selector.calls) == 2  # the prefill, once per layer; decode never selects
    assert shapes and all(lq == 1 and lk > 200 for lq, lk in shapes)


def test_nonfinite_queries_raise():
    model = make_model("qwen3")
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    for selector in (KeepAll(), FakeDense()):
        install(model, selector, executor="reference")
        with pytest.raises(FloatingPointError, match="layer 1 queries/keys"):
            logits(model, random_ids(100))
        uninstall(model)


def test_sliding_window_refused_on_sparse_path():
    model = make_model(
        "qwen3",
        use_sliding_window=True,
        sliding_window=64,
        layer_types=["full_attention", "sliding_attention"],
    )
    install(model, KeepAll(), executor="reference")
    with pytest.raises(ValueError, match="sliding-window"):
        logits(model, random_ids(100))


def test_dropout_refused_in_training_mode():
    model = make_model("qwen3", attention_dropout=0.1)
    install(model, KeepAll(), executor="reference")
    model.train()
    with pytest.raises(ValueError, match="model.eval"):
        logits(model, random_ids(100))


def test_install_is_per_model():
    a, b = make_model("qwen3"), make_model("qwen3")
    ids = random_ids(200)
    ref = logits(a, ids)
    rec_a = install(a, SinkAndDiagonal(full_from=4), executor="reference")
    rec_b = install(b, FakeDense())
    assert not torch.allclose(logits(a, ids), ref, atol=1e-4)  # really sparse
    torch.testing.assert_close(logits(b, ids), ref, atol=1e-5, rtol=0)
    assert rec_a.summary()["density_mean"] < 1 and rec_b.summary()["density_mean"] == 1


def test_unknown_executor_fails_at_install():
    with pytest.raises(ValueError, match="executor"):
        install(make_model("qwen3"), KeepAll(), executor="nope")


def test_recorder_recall_per_layer_only_when_asked():
    model = make_model("qwen3")
    sel = build("quest", ratio=0.2, block_size=32, sink_blocks=1, window_blocks=1)
    rec = install(model, sel, executor="reference")
    logits(model, random_ids(600))
    assert "recall_mean" not in rec.summary()
    uninstall(model)
    rec = install(model, sel, executor="reference", recall=True)
    logits(model, random_ids(600))
    s = rec.summary()
    assert len(s["recall_layers"]) == s["num_layers"] == 2
    assert all(0 < r < 1 for r in s["recall_layers"])  # a sparse selection loses some mass
    assert s["recall_mean"] == pytest.approx(sum(s["recall_layers"]) / 2, abs=1e-5)
    assert s["recall_s"] > 0  # the passes' own seconds, apart from selector and attention
    uninstall(model)
    rec = install(model, build("dense"), recall=True)
    logits(model, random_ids(600))
    assert rec.summary()["recall_layers"] == [1.0, 1.0]
    assert rec.summary()["recall_s"] == 0


def test_the_hook_refuses_queries_whose_scores_overflow_float32():
    """Finite q and k can still give scores past float32 (the selection API refuses them too):
    the hook's per-layer check bounds every score by D max|q| max|k|."""
    from rbs_bench.models.hf_attention import PrefillRecorder, _check_finite

    q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 1, 64, 16)
    _check_finite(q, k, 0, PrefillRecorder())  # ordinary values pass
    with pytest.raises(FloatingPointError, match="overflow float32"):
        _check_finite(q * 1e16, k * 1e16, 3, PrefillRecorder())
    k[0, 0, 5, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/Inf in layer 7"):
        _check_finite(q, k, 7, PrefillRecorder())


class _FakeEvent:
    """A CUDA event's interface on a CPU: its time is the order it was recorded in (ms)."""

    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        _FakeEvent.recorded += 1
        self.at = float(_FakeEvent.recorded)

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):
        return end.at - self.at


def test_event_marks_give_seconds_only_when_read(monkeypatch):
    """On a GPU a region's seconds lie between two events and are read in `summary()`; they add
    up over regions and batch rows like floats (`_sparse_padded` sums them from 0.0)."""
    monkeypatch.setattr(hf_attention.torch.cuda, "Event", _FakeEvent)
    t0, t1, t2 = hf_attention._Mark(), hf_attention._Mark(), hf_attention._Mark()
    sel, attn = t1 - t0, t2 - t1
    assert isinstance(sel, hf_attention._Elapsed)
    assert float(0.0 + sel + (t2 - t0)) == pytest.approx((1 + 2) / 1e3)
    rec = hf_attention.PrefillRecorder()
    rec.record(0, torch.ones(2), sel, attn)
    rec.record(1, torch.ones(2), 0.0, t2 - t0)  # the dense branch records 0.0 selector seconds
    s = rec.summary()
    assert s["selector_s"] == pytest.approx(1e-3) and s["attention_s"] == pytest.approx(3e-3)
    assert isinstance(s["selector_s"], float) and float(hf_attention._Elapsed([])) == 0.0
