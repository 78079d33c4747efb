"""The FP8 GEMM benchmark's plumbing on the CPU: the check rule, the row plan, resuming, a
failing variant recorded as a row, the summary. The kernels are stood in for by their PyTorch
references (the kernels themselves are checked in tests/kernels/test_fp8_gemm.py)."""

from __future__ import annotations

import types

import pandas as pd
import pytest
import torch
from rbs_bench.kernels import fp8_gemm as fk

from rbs_bench.bench import fp8_gemm as bench


def reference_kernels(broken: str | None = None):
    """A stand-in for `rbs_bench.kernels.fp8_gemm` whose products are the references;
    `broken` ("grouped") scales the grouped product by 1.01."""

    def launch(x, w, s, block, offsets=None, fused=False, quantized=None):
        if offsets is None:
            return fk.fp8_linear_ref(x, w, s, block)
        y = fk.fp8_grouped_linear_ref(x, w, s, offsets, block)
        return y * 1.01 if broken == "grouped" else y

    ns = types.SimpleNamespace(**{k: getattr(fk, k) for k in dir(fk) if not k.startswith("__")})
    ns._launch = launch
    ns.fp8_linear = lambda x, w, s, block: launch(x, w, s, block)
    ns.fp8_grouped_linear = lambda x, w, s, offsets, block: launch(x, w, s, block, offsets)
    ns.fp8_act_quant = lambda x, group: fk.act_quant_ref(x, group)
    ns._tuned_gemm = lambda space, block_k: types.SimpleNamespace(best_config="BLOCK_M: 64")
    ns.tuning_space = lambda device: ()
    return ns


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "LINEAR", {"q": (256, 128)})
    monkeypatch.setattr(bench, "EXPERTS", {"down": (128, 256)})
    monkeypatch.setattr(bench, "NUM_EXPERTS", 8)
    monkeypatch.setattr(bench, "TOP_K", 2)
    monkeypatch.setattr(bench, "CHECK_TOKENS", (1, 13))
    monkeypatch.setattr(bench, "SAMPLE_ROWS", 16)
    monkeypatch.setattr(bench, "fp8_gpu", lambda major=8, minor=9: (major, minor) <= (8, 9))
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "cpu-test"})
    monkeypatch.setattr(bench, "do_bench", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(bench, "grouped_mm", lambda: None)
    monkeypatch.setattr("rbs_bench.bench.attention.gpu_tag", lambda: "cpu_test")
    monkeypatch.setattr(bench, "fk", reference_kernels())
    return monkeypatch


def test_row_errors_rule():
    ref = torch.randn(4, 64)
    exact = ref + 0.01 * torch.randn(4, 64)
    assert bench.row_errors(ref.to(torch.bfloat16), ref, exact) <= 0.5
    wrong = (ref * 1.05).to(torch.bfloat16)
    assert bench.row_errors(wrong, ref, exact) > 1


def test_runs_resumes_and_records_a_failing_variant(small, tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--tokens", "40", "--rep-ms", "1"]
    small.setattr(bench, "fk", reference_kernels(broken="grouped"))
    assert bench.main(argv) == 1  # the grouped checks fail
    csv = tmp_path / "fp8_gemm_cpu_test.csv"
    df = pd.read_csv(csv)
    plan = [r[0] for r in bench.plan([40])]
    assert list(df["row"]) == plan
    checks = df[df["kind"] == "check"].set_index("row")["check"]
    assert set(checks[[r for r in plan if "check-q" in r]]) == {"PASS"}
    assert set(checks[[r for r in plan if "check-down" in r]]) == {"FAIL"}
    times = df[df["kind"] == "time"]
    assert (times["tflops_fp8"] > 0).all() and times["config"].notna().all()
    out = capsys.readouterr().out
    assert "checks: 6 of 12 pass" in out and "layer | tokens" in out

    small.setattr(bench, "fk", reference_kernels())
    assert bench.main(argv) == 1  # failed checks are kept, not rerun
    assert len(pd.read_csv(csv)) == len(plan)


def test_an_error_is_a_row_and_runs_again(small, tmp_path):
    def boom(*args, **kw):
        raise RuntimeError("no kernel for this GPU\nsecond line")

    ref = reference_kernels()
    ref.fp8_linear = boom
    small.setattr(bench, "fk", ref)
    argv = ["--out", str(tmp_path), "--tokens", "40", "--no-checks"]
    assert bench.main(argv) == 1
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    row = df[df["row"] == "time-q-40"].iloc[0]
    assert row["check"] == "ERROR" and row["error"] == "RuntimeError: no kernel for this GPU"
    assert df[df["row"] == "time-down-40"]["ms_fp8"].notna().all()
    small.setattr(bench, "fk", reference_kernels())
    assert bench.main(argv) == 0  # the failed row ran again and now passes
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    assert len(df) == 2 and ("error" not in df or df["error"].isna().all())


def test_the_gpu_test_compares_whole_capabilities(monkeypatch):
    """An H100 (9.0) has cuBLAS's block-scaled recipe and fp8 tensor cores; an A100 (8.0)
    neither; an L4 (8.9) fp8 tensor cores only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, fp8, hopper in (((9, 0), True, True), ((8, 0), False, False), ((8, 9), True, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda cap=cap: cap)
        assert (bench.fp8_gpu(), bench.fp8_gpu(9, 0)) == (fp8, hopper), cap


def test_needs_an_fp8_gpu(monkeypatch, capsys):
    monkeypatch.setattr(bench, "fp8_gpu", lambda: False)
    assert bench.main(["--out", "/nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("rbs-bench: error:")


def test_the_experts_block_rows_and_the_layer_sum(small, tmp_path, capsys):
    """With both expert shapes, the plan checks and times the whole experts block (on the CPU
    `fp8_moe_experts` is its reference, so its checks pass) and the summary adds a layer's
    products: q, k, v, o and the block."""
    small.setattr(bench, "LINEAR", {"q": (256, 128), "k": (128, 128), "o": (128, 256)})
    small.setattr(bench, "EXPERTS", {"gate_up": (256, 128), "down": (128, 128)})
    argv = ["--out", str(tmp_path), "--tokens", "40", "--rep-ms", "1"]
    assert bench.main(argv) == 0
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    assert {"check-experts-13-default", "check-experts-40-default", "time-experts-40"} <= set(
        df["row"]
    )
    assert set(df[df["layer"] == "experts"]["check"].dropna()) == {"PASS"}
    out = capsys.readouterr().out
    assert "a layer's products at 40 tokens (q, k, v, o, the experts block)" in out


def test_the_experts_switch_gives_back_the_callers_setting(monkeypatch):
    import os

    monkeypatch.setenv("RBS_BENCH_FP8_CUBLAS_GROUPED", "0")
    with bench.experts_on_cublas(True):
        assert os.environ["RBS_BENCH_FP8_CUBLAS_GROUPED"] == "1"
    assert os.environ["RBS_BENCH_FP8_CUBLAS_GROUPED"] == "0"
    monkeypatch.delenv("RBS_BENCH_FP8_CUBLAS_GROUPED")
    with bench.experts_on_cublas(False):
        assert os.environ["RBS_BENCH_FP8_CUBLAS_GROUPED"] == "0"
    assert "RBS_BENCH_FP8_CUBLAS_GROUPED" not in os.environ


def test_the_compiled_bf16_experts_block_computes_the_eager_one():
    """The bf16 baseline `time_experts` compiles (as the bf16 layers run their feed-forward) is
    the eager block up to bf16 rounding: its distance to the fp32 block is at most twice the
    eager bf16 block's own."""
    torch.manual_seed(0)
    n, k, hidden, inter = 48, bench.TOP_K, 256, 128
    experts = bench.NUM_EXPERTS
    x = torch.randn(n, hidden)
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k), -1)
    w = [torch.randn(experts, hidden, 2 * inter) / 16, torch.randn(experts, inter, hidden) / 16]
    args = lambda dt: (x.to(dt), index, weights.to(dt), None, None, None, None)  # noqa: E731
    exact = bench.experts_unfused(*args(torch.float32), grouped=w)
    bf = [t.to(torch.bfloat16) for t in w]
    eager = bench.experts_unfused(*args(torch.bfloat16), grouped=bf).float()
    compiled = torch.compile(bench.experts_unfused, dynamic=False)
    got = compiled(*args(torch.bfloat16), grouped=bf).float()
    own = (eager - exact).norm() / exact.norm()
    assert 0 < own < 0.02
    assert (got - exact).norm() / exact.norm() <= 2 * own


def test_a_time_row_names_what_the_layers_product_ran_on(monkeypatch):
    """The `config` column: cuBLAS, the TMA form with its launch setting, or (the pointer
    kernel) the autotuner's choice, which `bench_tuned` reads itself."""
    wq, s = bench.quantized_weight((256, 256), seed=0, device="cpu")
    x = bench.activations(8, 256, seed=1, device="cpu")
    assert bench.runs_on(x, wq, cublas=True) == "cuBLAS"
    assert bench.runs_on(x, wq, cublas=False) == ""  # a CPU tensor: never the TMA form
    monkeypatch.setattr(fk, "_tma_config", lambda *args: fk.TMA_CONFIG)
    assert bench.runs_on(x, wq, cublas=False) == f"TMA form {fk.TMA_CONFIG}"
    monkeypatch.setattr(bench, "do_bench", lambda fn, rep_ms: 1.5)
    calls = []
    assert bench.bench_tuned(lambda: calls.append(1), 10, "cuBLAS") == (1.5, "cuBLAS")
    assert calls == [1]  # run once before timing, as a tuning run would be


def test_the_experts_stages_are_timed_and_summed(small, tmp_path):
    """Where the block's products run on cuBLAS, its row also times each stage alone
    (`ms_stage_*`, in `STAGES` order), and the docs' sentence adds them up and splits the FP8
    layer into cuBLAS's products and the rest."""
    from rbs_bench.tables.blocks_kernels import _stages_sentence

    linear = {"q": (256, 128), "k": (128, 128), "qkv": (512, 128), "o": (128, 256)}
    small.setattr(bench, "LINEAR", linear)
    small.setattr(bench, "EXPERTS", {"gate_up": (256, 128), "down": (128, 128)})
    small.setattr(bench, "experts_stages", lambda args: {k: lambda: None for k in bench.STAGES})
    argv = ["--out", str(tmp_path), "--tokens", "40", "--no-checks"]
    assert bench.main(argv) == 0
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    block = df[df["layer"] == "experts"].iloc[0]
    stages = [c for c in df.columns if c.startswith("ms_stage_")]
    assert stages == [f"ms_stage_{k}" for k in bench.STAGES] and (block[stages] == 1.0).all()
    assert not any(c.startswith("tflops_stage_") for c in df.columns)
    assert "together 6.00 against the block's 1.00" in _stages_sentence(df)
    assert "cuBLAS's block-scaled products" not in _stages_sentence(df)  # no cuBLAS rows here
    df.loc[df["layer"].isin(["qkv", "o"]), "ms_fp8_cublas_block_gemm"] = 0.5
    df.loc[df["layer"] == "experts", "ms_bf16_compiled"] = 4.0
    df.loc[df["layer"] == "experts", "ms_fp8"] = 5.0
    text = _stages_sentence(df)
    # FP8: qkv 1 + o 1 + the block 5; bf16: 1 + 1 + 4; products 0.5 + 0.5 + gate_up 1 + down 1
    assert "take 3.00 ms of the FP8 layer's 7.00 (0.50x the bf16 layer's 6.00 ms)" in text
    assert "the other 4.00 ms" in text


def test_the_block_is_timed_from_each_count_of_launch_threads(small, tmp_path):
    """Where the block's products run on cuBLAS, its row records the default count of host
    threads that launch the per-expert calls (`launch_threads`) and times the block from each
    other count of `LAUNCH_THREADS`; the docs' note says them."""
    from rbs_bench.kernels import fp8_moe as fm

    from rbs_bench.tables.blocks_kernels import _launch_sentence

    small.delenv("RBS_BENCH_FP8_LAUNCH_THREADS", raising=False)
    small.setattr(bench, "EXPERTS", {"gate_up": (256, 128), "down": (128, 128)})
    small.setattr(fm, "cublas_scales", lambda *args: [None, None])
    small.setattr(bench, "experts_stages", lambda args: {})
    small.setattr(bench, "do_bench", lambda fn, rep_ms: float(fm.launch_threads()))
    assert bench.main(["--out", str(tmp_path), "--tokens", "40", "--no-checks"]) == 0
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    block = df[df["layer"] == "experts"].iloc[0]
    default = fm.LAUNCH_THREADS
    assert block["launch_threads"] == default and block["ms_fp8"] == float(default)
    others = [n for n in bench.LAUNCH_THREADS if n != default]
    assert sorted(c for c in df.columns if c.startswith("ms_fp8_threads")) == [
        f"ms_fp8_threads{n}" for n in others
    ]
    assert all(block[f"ms_fp8_threads{n}"] == float(n) for n in others)
    text = _launch_sentence(df)
    assert text.startswith("The experts block with its per-expert cuBLAS calls launched from 1 ")
    assert text.endswith(f"against {default:.2f} ms from the default {default}. ")


def test_the_producers_are_timed_and_summed(small, tmp_path):
    """The qkv and o rows also time their products on rows quantised already and what
    quantising costs their producers (the input norm, the sparse attention, both writing e4m3
    against bf16); the layer's sum with producers takes each product alone plus that difference,
    and the docs' sentence gives the parts, with the attention setup the o row recorded."""
    from rbs_bench.tables.blocks_kernels import _producers_sentence, fp8_producer_sums

    linear = {"q": (256, 128), "k": (128, 128), "qkv": (512, 128), "o": (128, 256)}
    small.setattr(bench, "LINEAR", linear)
    small.setattr(bench, "EXPERTS", {"gate_up": (256, 128), "down": (128, 128)})
    small.setattr(bench, "experts_stages", lambda args: {})
    small.setattr(bench, "ATTENTION", bench.ATTENTION | {"q_heads": 4, "kv_heads": 2})
    assert bench.main(["--out", str(tmp_path), "--tokens", "300", "--no-checks"]) == 0
    df = pd.read_csv(tmp_path / "fp8_gemm_cpu_test.csv")
    by = df.set_index("layer")
    cols = ["ms_fp8_quantised", "ms_norm_fp8", "ms_norm_bf16"]
    assert (by.loc["qkv", cols] == 1.0).all() and pd.isna(by.loc["q", "ms_fp8_quantised"])
    assert (by.loc["o", ["ms_fp8_quantised", "ms_attention_fp8", "ms_attention_bf16"]] == 1.0).all()
    assert not any(c.startswith(("tflops_norm", "tflops_attention")) for c in df.columns)
    df.loc[df["layer"] == "experts", "ms_bf16_compiled"] = 4.0
    df.loc[df["layer"] == "qkv", ["ms_norm_fp8", "ms_norm_bf16", "ms_fp8_quantised"]] = [
        0.25, 0.5, 2.0,
    ]  # fmt: skip
    df.loc[df["layer"] == "o", ["ms_attention_fp8", "ms_attention_bf16"]] = [3.0, 3.25]
    # FP8: qkv 2 + 0.25 - 0.5, o 1 + 3 - 3.25, the block 1; bf16: 1 + 1 + 4
    assert fp8_producer_sums(df) == [(300, 3.5, 6.0)]
    text = _producers_sentence(df)
    assert "300 tokens: FP8 3.50 ms, bf16 6.00 ms (0.583x)" in text
    assert "e4m3 rows 0.250 ms against 0.500 ms writing bf16" in text
    assert (
        "quantised 3.00 ms against 3.25 ms in bf16 (4 query and 2 key/value heads of 128, "
        "blocks of 128, 5% of each row's blocks). " in text
    )
    setup = [c for c in df.columns if c.startswith("attention_")]
    assert len(setup) == len(bench.ATTENTION) and pd.isna(by.loc["qkv", setup]).all()
    # a CSV from before the rows recorded the setup: the sentence leaves it out, not guesses it
    assert "in bf16. " in _producers_sentence(df.drop(columns=setup))
    assert _producers_sentence(df.drop(columns=["ms_attention_fp8"])) == ""
