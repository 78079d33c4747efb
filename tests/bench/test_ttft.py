"""The TTFT benchmark on the CPU: timed attention hook, requests, calibration capture, memory
measures, the resumable CSV, bad input, and (on a GPU) the Qwen3-30B-A3B-shaped default path."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rbs_bench import methods
from rbs_bench.bench import ttft, ttft_calibrate, ttft_measure, ttft_model, ttft_rows, ttft_setup
from rbs_bench.config import TimingCfg, UserError
from rbs_bench.models.hf_attention import install, uninstall

ROOT = Path(__file__).resolve().parents[2]
N = 256  # prompt tokens of the run tests: two key blocks, quick on a CPU
SMALL_MOE = {  # the Qwen3-30B-A3B config with its widths shrunk, for a CPU
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def settings(tmp_path, **kw) -> ttft_setup.Settings:
    fields = {"contexts": [N], "batch_contexts": [N], "methods": ["dense", "rbs"]} | kw
    fields = {"repeats": 1, "warmup": 0} | fields
    return ttft_setup.resolve(TimingCfg(**fields), device="cpu", out=tmp_path, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    s = settings(tmp_path_factory.mktemp("tiny"))
    return s, ttft_model.build_model(s)


def ids_for(s, lm, n, batch=1):
    return ttft_model.prompts(s, n, lm.vocab)[:batch]


def test_timed_hook_keeps_sdpa_logits_and_times_prefill_only(tiny):
    s, lm = tiny
    ids = ids_for(s, lm, 384)
    with torch.inference_mode():
        got = lm.model(input_ids=ids, use_cache=False).logits
        lm.model.set_attn_implementation("sdpa")
        want = lm.model(input_ids=ids, use_cache=False).logits
        lm.model.set_attn_implementation(ttft_model.TIMED_IMPL)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        out = ttft_measure.request(lm, ids)
    # one attention span per layer for the prefill; the decode step (Lq = 1) is not timed
    assert len(lm.probe.spans["attention"]) == s.layers
    assert lm.probe.spans["selector"] == []
    assert out["ttft_ms"] > out["attention_ms"] > 0
    assert out["decode_ms"] > 0 and out["selector_ms"] == 0


def test_timed_selector_spans_sit_inside_attention(tiny):
    s, lm = tiny
    ids = ids_for(s, lm, 512)
    rec = install(lm.model, ttft_model.TimedSelector(methods.build("rbs"), lm.probe), "reference")
    lm.model.set_attn_implementation(ttft_model.TIMED_IMPL)
    try:
        with torch.inference_mode():
            out = ttft_measure.request(lm, ids)
    finally:
        uninstall(lm.model)
    assert lm.model.config._attn_implementation == ttft_model.TIMED_IMPL  # restored, not rbs_sparse
    assert len(lm.probe.spans["selector"]) == len(lm.probe.spans["attention"]) == s.layers
    assert 0 < out["selector_ms"] < out["attention_ms"]
    assert rec.summary()["num_layers"] == s.layers


def test_captured_first_layer_gives_the_in_run_selection(tiny):
    # Layer 0 sees the same Q/K whatever the method, so selecting on the captured activations
    # must give the density the recorder measures for layer 0 while the method runs.
    s, lm = tiny
    ids = ids_for(s, lm, 640)
    seen = []
    ttft_measure.dense_prefill(lm, ids, lambda q, k, scale: seen.append((q, k, scale)))
    assert len(seen) == s.layers  # each layer handed over once, as the prefill reaches it
    q, k, scale = seen[0]
    assert q.shape == (1, lm.heads, 640, lm.head_dim)
    assert k.shape == (1, lm.kv_heads, 640, lm.head_dim)
    assert scale == pytest.approx(lm.head_dim**-0.5)
    # 10 blocks of 64 and one forced block per row: most pairs are left to the rule
    fields = dict(ratio=0.3, block_size=64, sink_blocks=0, window_blocks=1, last_q_blocks=0)
    selector = methods.build("quest", impl="torch", **fields)
    want = selector.select(q, k).head_density()[0]
    assert 0 < float(want.mean()) < 1
    rec = install(lm.model, selector, "reference")
    try:
        with torch.inference_mode():
            lm.model(input_ids=ids, use_cache=False)
    finally:
        uninstall(lm.model)
    got = torch.tensor(rec.summary()["density_layers_heads"][0], dtype=want.dtype)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_calibration_streams_the_layers_and_meets_the_target_or_flags_the_floor(tmp_path):
    s = settings(tmp_path, target=0.6)
    lm = ttft_model.build_model(s)
    ids = ids_for(s, lm, 4096)  # 32 blocks of 128: the forced blocks keep about 45% of pairs
    layers = []
    ttft_measure.dense_prefill(lm, ids, lambda q, k, scale: layers.append((q, k, scale)))
    # rbs's exact curve: one prefill gives the knob; xattn's grid: a few prefills
    got = ttft_calibrate.calibrate_methods(s, lm, ids, ["rbs", "xattn"], {"rbs"})
    for name in ("rbs", "xattn"):
        cal = got[name]
        assert (
            cal.target_reached
            and abs(cal.calibration_density - 0.6) <= ttft_calibrate.CALIBRATION_TOL
        )
        sel = methods.build(name, **cal.fields)
        mean = sum(sel.select(q, k, scale=c).density() for q, k, c in layers) / len(layers)
        assert mean == pytest.approx(cal.calibration_density, abs=1e-9)
    assert got["rbs"].selector_workspace_mib > 0 and got["xattn"].selector_workspace_mib is None
    # 5% is below the forced blocks alone: the closest density (the sparsest end), flagged
    low = ttft_calibrate.calibrate_methods(
        settings(tmp_path, target=0.05), lm, ids, ["rbs"], set()
    )["rbs"]
    floor = methods.build("rbs").with_knob(1 / 0.18)
    want = sum(floor.select(q, k, scale=c).density() for q, k, c in layers) / len(layers)
    assert not low.target_reached
    assert low.calibration_density == pytest.approx(want, abs=1e-9)
    assert want > 0.05 + ttft_calibrate.CALIBRATION_TOL


@pytest.mark.parametrize("name", ["rbs", "full_l2", "centroid", "flashprefill", "quest"])
def test_block_statistics_hold_the_rule_per_block(name):
    hkv, n, d, block = 2, 1000, 64, 128
    k = torch.randn(1, hkv, n, d)
    parts = dict(ttft_measure.block_statistics(methods.build(name), k))
    m = math.ceil(n / block)
    vectors = {"rbs": 1, "full_l2": 1, "centroid": 1, "flashprefill": 1, "quest": 2}[name]
    scalars = {"rbs": 2, "full_l2": 1}.get(name, 0)
    want = sum(4 * hkv * m * (d if t.dim() == 4 else 1) for t in parts.values())
    assert ttft_model.tensor_bytes(list(parts.values())) == want
    assert sum(t.dim() == 4 for t in parts.values()) == vectors
    assert sum(t.dim() == 3 for t in parts.values()) == scalars
    assert all(t.shape[:3] == (1, hkv, m) for t in parts.values())


def test_methods_without_block_summaries_report_none():
    k = torch.randn(1, 2, 512, 64)
    assert ttft_measure.block_statistics(methods.build("xattn"), k) is None
    assert ttft_measure.block_statistics(methods.build("minference"), k) is None
    assert (
        ttft_measure.block_statistics(methods.build("oracle"), k) is None
    )  # it reads the attention


def test_cpu_peak_sees_a_freed_temporary():
    def fn():
        tmp = torch.ones(1 << 20)  # 4 MiB, freed before returning
        return float(tmp.sum())

    out, peak = ttft_measure.cpu_peak_bytes(fn)
    assert out == float(1 << 20)
    assert peak >= 4 * (1 << 20)


def test_selector_workspace_excludes_the_selection():
    q, k = torch.randn(1, 4, 2048, 64), torch.randn(1, 2, 2048, 64)
    selector = methods.build("rbs", impl="torch")
    ws, index = ttft_measure.selector_memory(selector, q, k)
    sel = selector.select(q, k)
    assert index * ttft_model.MiB == ttft_model.tensor_bytes(sel)
    assert ws > 0


def test_resolve_fills_cpu_defaults_and_rejects_bad_input(tmp_path):
    s = ttft_setup.resolve(TimingCfg(), device="cpu", out=tmp_path)
    d = ttft_setup.DEVICE_DEFAULTS["cpu"]
    assert s.model == d["model"] and s.contexts == sorted(d["contexts"], reverse=True)
    assert s.repeats == d["repeats"] and s.batch_contexts == d["batch_contexts"]
    assert s.tag == "cpu"
    bad = [
        ({"methods": ["dense", "nosuch"]}, "unknown method 'nosuch'"),
        ({"model": "qwen3_30b_a3b"}, "needs a CUDA device"),
        ({"model": "gpt"}, "timing.model='gpt'"),
        ({"contexts": [10**6]}, "outside 2-"),
        ({"batches": [0]}, "batch sizes must be >= 1"),
        ({"target": 0.0}, "timing.target=0.0"),
        ({"sdpa_backend": "fa3"}, "timing.sdpa_backend='fa3'"),
        ({"layers": 0}, "timing.layers=0"),
    ]
    for fields, msg in bad:
        with pytest.raises(UserError, match=msg):
            ttft_setup.resolve(TimingCfg(**fields), device="cpu", out=tmp_path)
    with pytest.raises(UserError, match="unknown executor"):
        ttft_setup.resolve(TimingCfg(), device="cpu", executor="fa9", out=tmp_path)


def test_plan_runs_batch_one_first_largest_context_first_dense_first(tmp_path):
    s = settings(
        tmp_path,
        contexts=[512, 1024],
        methods=["rbs", "quest", "dense"],
        batches=[1, 2],
        batch_contexts=[512],
        batch_methods=["quest", "dense"],
    )
    assert ttft_rows.plan(s) == [
        (1, 1024, "dense"),
        (1, 1024, "rbs"),
        (1, 1024, "quest"),
        (1, 512, "dense"),
        (1, 512, "rbs"),
        (1, 512, "quest"),
        (2, 512, "dense"),
        (2, 512, "quest"),
    ]


def test_run_writes_every_column_resumes_and_reuses_calibration(tmp_path, capsys, monkeypatch):
    s = settings(tmp_path)
    first = ttft.run(s)
    assert len(first) == 2 and s.figure.stat().st_size > 10_000
    # batch 2 added later: only its rows run, with the recorded batch-1 calibration (no capture)
    monkeypatch.setattr(ttft_calibrate, "dense_prefill", lambda *a: pytest.fail("calibrated again"))
    s = settings(tmp_path, batches=[1, 2])
    df = ttft.run(s)
    assert len(df) == 4 and set(df["status"]) == {"ok"}
    rbs = df[(df["method"] == "rbs") & (df["batch"] == 1)].iloc[0]
    dense = df[(df["method"] == "dense") & (df["batch"] == 1)].iloc[0]
    # 2 key blocks of 128: the 2 sinks and the 4-block window already cover every causal pair
    assert rbs["density"] == 1.0 and rbs["calibration_density"] == 1.0
    assert not ttft_rows.as_bool(rbs["target_reached"])
    assert rbs["ttft_speedup"] == pytest.approx(dense["ttft_ms"] / rbs["ttft_ms"])
    assert rbs["attention_speedup"] == pytest.approx(dense["attention_ms"] / rbs["attention_ms"])
    assert rbs["sparse_attention_ms"] == pytest.approx(rbs["attention_ms"] - rbs["selector_ms"])
    per_layer = (rbs["ttft_ms"] - rbs["attention_ms"]) / s.layers
    assert rbs["outside_ms_per_layer"] == pytest.approx(per_layer)
    assert math.isnan(rbs["gemm_ms_per_layer"]) and math.isnan(rbs["outside_x_gemm"])  # CPU
    assert rbs["tokens_per_s"] == pytest.approx(N / (rbs["ttft_ms"] / 1e3))
    assert rbs["knob_name"] == "alpha_scale"
    # the sparsest scale: each branch's threshold stops at 1 (its top block)
    fields = json.loads(rbs["fields"])
    assert fields["alpha_base"] == 1.0 and fields["alpha_rescue"] == pytest.approx(1.0)
    assert rbs["knob"] == pytest.approx(methods.build("rbs", **fields).alpha_scale)
    assert rbs["block_stats_mib"] > 0 and rbs["selector_workspace_mib"] > 0
    assert rbs["peak_allocated_mib"] > rbs["model_mib"] > 0
    assert math.isnan(rbs["peak_reserved_mib"])  # a CPU has no reserved pool
    two = df[(df["method"] == "rbs") & (df["batch"] == 2)].iloc[0]
    assert two["fields"] == rbs["fields"]
    assert two["prompts_per_s"] == pytest.approx(2 / (two["ttft_ms"] / 1e3))
    assert "random weights" in rbs["model_desc"] and f"{s.layers} layers" in rbs["model_desc"]
    before = s.csv.read_text()
    capsys.readouterr()
    again = ttft.run(s)
    assert "0 rows to run" in capsys.readouterr().out
    assert len(again) == 4 and s.csv.read_text() == before


def test_a_run_killed_after_calibrating_times_its_rows_without_calibrating_again(
    tmp_path, monkeypatch
):
    s = settings(tmp_path, methods=["rbs"])
    real = ttft.time_row

    def killed(*a, **kw):
        raise KeyboardInterrupt  # the job ends after calibration, before its row is written

    monkeypatch.setattr(ttft, "time_row", killed)
    with pytest.raises(KeyboardInterrupt):
        ttft.run(s)
    assert not s.csv.exists() and s.calibrations.exists()
    with s.calibrations.open("a") as f:
        f.write('{"model": "tiny", "n": 10')  # a line cut by the kill is passed over
    lm = ttft_model.build_model(s)
    saved = {m: cal for (_, m), cal in ttft_calibrate.saved_calibrations(s, lm).items()}
    monkeypatch.setattr(ttft, "time_row", real)
    monkeypatch.setattr(ttft_calibrate, "dense_prefill", lambda *a: pytest.fail("calibrated again"))
    df = ttft.run(s)
    assert list(df["method"]) == ["rbs"] and df["block_stats_mib"].iloc[0] > 0
    # a calibration saved after the cut line stays whole
    ttft_calibrate.save_calibrations(s, lm, N + 1, saved)
    assert set(ttft_calibrate.saved_calibrations(s, lm)) == {(N, "rbs"), (N + 1, "rbs")}
    # another target is another calibration
    other = settings(tmp_path, methods=["rbs"], target=0.5)
    assert ttft_calibrate.saved_calibrations(other, ttft_model.build_model(other)) == {}


def test_time_budget_stops_before_the_next_row(tmp_path, capsys):
    s = settings(tmp_path, time_budget_s=0.0)
    df = ttft.run(s)
    assert df.empty and not s.csv.exists()
    assert "time budget of 0 s reached with 2 rows left" in capsys.readouterr().out


def test_small_qwen3_moe_runs_the_moe_path(tmp_path):
    s = settings(tmp_path, contexts=[256], layers=1)
    s.model = "qwen3_30b_a3b"  # resolve() keeps this model for CUDA; build it small on the CPU
    lm = ttft_model.build_model(s, overrides=SMALL_MOE)
    assert type(lm.model).__name__ == "Qwen3MoeForCausalLM" and lm.dtype == "bfloat16"
    assert "random weights, 1 of 48 layers" in lm.description
    with torch.inference_mode():
        out = ttft_measure.request(lm, ids_for(s, lm, 256))
    assert out["ttft_ms"] > out["attention_ms"] > 0


@pytest.mark.slow
def test_experiment_dispatch_writes_tables(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "+experiment=selector_time",
        f"results_dir={tmp_path}",
        f"timing.contexts=[{N}]",
        "timing.methods=[dense,rbs]",
        "timing.repeats=1",
        "progress=false",
        f"hydra.run.dir={tmp_path}/hydra",
    ]
    (tmp_path / "paper").mkdir()
    paper = ROOT / "results" / "paper" / "paper_values.csv"
    (tmp_path / "paper" / "paper_values.csv").write_text(paper.read_text())
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "speed" / "ttft_cpu.csv").exists()
    md = (tmp_path / "tables" / "selector_time_cpu.md").read_text()
    assert "RBS-Attention" in md and "ttft_cpu.csv" in md


def test_model_other_than_tiny_is_refused_by_the_experiments(tmp_path):
    from hydra import compose, initialize_config_module

    from rbs_bench.config import register_schemas

    register_schemas()
    with initialize_config_module(config_module="rbs_bench.conf", version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+experiment=speed", "model=qwen3_32b", f"results_dir={tmp_path}"],
        )
    with pytest.raises(UserError, match="model=qwen3_32b is not used by the timing experiments"):
        ttft.run_experiment(cfg, "speed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_layer_qwen3_30b_a3b_shape(tmp_path):
    cfg = TimingCfg(layers=1, contexts=[16384], methods=["dense", "rbs"], batches=[1], repeats=1)
    s = ttft_setup.resolve(cfg, device="cuda", out=tmp_path, progress=False)
    df = ttft.run(s).set_index("method")
    assert set(df["status"]) == {"ok"}
    assert df.loc["rbs", "density"] < 1.0 and df.loc["rbs", "selector_ms"] > 0
    assert df.loc["dense", "peak_allocated_mib"] > df.loc["dense", "model_mib"]
    assert df.loc["rbs", "peak_reserved_mib"] >= df.loc["rbs", "peak_allocated_mib"]
    assert df.loc["rbs", "ttft_ms"] > df.loc["rbs", "attention_ms"] > df.loc["rbs", "selector_ms"]
    # one layer's GEMMs on the same tokens, and the part outside attention against them
    assert df.loc["dense", "gemm_ms_per_layer"] > 0
    assert df.loc["dense", "outside_x_gemm"] == pytest.approx(
        df.loc["dense", "outside_ms_per_layer"] / df.loc["dense", "gemm_ms_per_layer"]
    )


def test_a_checkpoint_directory_is_timed_through_from_pretrained(tmp_path):
    """--checkpoint loads a saved model as a hub id loads (here the tiny model saved to disk):
    its own depth and dtype name the rows."""
    from rbs_bench.models import tiny

    ckpt = tmp_path / "ckpt"
    tiny.build_model(tiny.tiny_config(num_hidden_layers=3)).save_pretrained(ckpt)
    s = ttft_setup.resolve(
        TimingCfg(checkpoint=str(ckpt), model="tiny_ckpt", contexts=[256], methods=["dense"]),
        device="cpu",
        out=tmp_path,
        progress=False,
    )
    assert (s.model, s.layers, s.dtype) == ("tiny_ckpt", 3, "float32")
    lm = ttft_model.build_model(s)
    assert "tiny_ckpt from the checkpoint ckpt" in lm.description
    with torch.inference_mode():
        out = ttft_measure.request(lm, ttft_model.prompts(s, 256, lm.vocab)[:1])
    assert out["ttft_ms"] > 0
    # a Qwen3-32B checkpoint (the hub's config: 40,960 positions) gets YaRN to 128K, as runs do
    (tmp_path / "q32").mkdir()
    (tmp_path / "q32" / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen3", "num_hidden_layers": 64, "max_position_embeddings": 40960}
        )
    )
    q32 = TimingCfg(checkpoint=str(tmp_path / "q32"), model="qwen3_32b", contexts=[131072])
    assert ttft_setup.resolve(q32, device="cpu", out=tmp_path, progress=False).contexts == [131072]
    bad = TimingCfg(checkpoint=str(tmp_path / "none"), contexts=[256])
    with pytest.raises(UserError, match="cannot read .*config.json"):
        ttft_setup.resolve(bad, device="cpu", out=tmp_path, progress=False)
