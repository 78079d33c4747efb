"""Timing tables and the speedup figure from TTFT CSVs: layouts, flags, and the paper's values
beside ours only where the setting is the paper's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from rbs_bench.bench import ttft_rows
from rbs_bench.tables import timing
from rbs_bench.tables.paper import PaperValues

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
H100_TAG = "nvidia_h100_80gb_hbm3"
SPEEDUP = {"rbs": 8.0, "flashprefill": 5.0, "quest": 4.0}  # dense time / method time, by rule


def fake_rows(device: str, ns=(32768, 131072), batches=(1, 4)) -> pd.DataFrame:
    """TTFT rows whose times follow a rule: dense t(N) = N^2 / 1e6 ms, a method t / SPEEDUP;
    rbs misses its target at the shortest N; quest runs out of memory at batch 4."""
    rows = []
    for b in batches:
        for n in ns:
            dense_ms = b * n * n / 1e6
            for m in ["dense", *SPEEDUP]:
                ms = dense_ms / SPEEDUP.get(m, 1.0)
                oom = m == "quest" and b == 4
                rows.append(
                    {
                        "device": device,
                        "model": "qwen3_30b_a3b",
                        "model_desc": "Qwen3-30B-A3B-shaped MoE, random weights, 4 of 48 layers",
                        "layers": 4,
                        "dtype": "bfloat16",
                        "heads": 32,
                        "kv_heads": 4,
                        "head_dim": 128,
                        "batch": b,
                        "n": n,
                        "method": m,
                        "target": 1.0 if m == "dense" else 0.05,
                        "status": "oom" if oom else "ok",
                        "fields": "{}",
                        "calibration_density": 1.0 if m == "dense" else 0.05,
                        "target_reached": not (m == "rbs" and n == min(ns)),
                        "density": 1.0 if m == "dense" else 0.05,
                        "ttft_ms": None if oom else ms,
                        "decode_ms": 1.0,
                        "attention_ms": None if oom else 0.8 * ms,
                        "selector_ms": 0.0 if m == "dense" else 0.1 * ms,
                        "prompts_per_s": b / (ms / 1e3),
                        "tokens_per_s": b * n / (ms / 1e3),
                        "peak_allocated_mib": 6000.0 + n / 64,
                        "peak_reserved_mib": 7000.0 + n / 64,
                        "model_mib": 5900.0,
                        "block_stats_mib": 2.0 if m in ("rbs", "quest") and b == 1 else None,
                        "block_stats": "centroid 128 x fp32" if b == 1 else None,
                        "selector_workspace_mib": 6.0 if m != "dense" and b == 1 else None,
                        "selection_mib": 1.0 if m != "dense" and b == 1 else None,
                        "executor": "auto",
                        "sdpa_backend": "default",
                        "warmup": 1,
                        "repeats": 3,
                        "torch": "2.11.0",
                        "triton": "3.6.0",
                        "transformers": "5.17.0",
                    }
                )
    return ttft_rows.derive(pd.DataFrame(rows))


@pytest.fixture
def results(tmp_path):
    (tmp_path / "paper").mkdir()
    shutil.copy(ROOT / "results" / "paper" / "paper_values.csv", tmp_path / "paper")
    (tmp_path / "speed").mkdir()
    return tmp_path


def test_h100_tables_show_ours_beside_the_paper_at_128k(results, tmp_path):
    fake_rows(H100).to_csv(results / "speed" / f"ttft_{H100_TAG}.csv", index=False)
    for f in (ROOT / "results" / "speed").glob(f"*_{H100_TAG}.csv"):
        if not f.name.startswith("ttft_"):  # the committed standalone attention runs
            shutil.copy(f, results / "speed")
    out = tmp_path / "tables"
    written = timing.build(results, out)
    names = {p.name for p in written}
    for exp in timing.EXPERIMENTS:
        assert {f"{exp}_{H100_TAG}.md", f"{exp}_{H100_TAG}.tex"} <= names
    assert (out / f"speed_{H100_TAG}.png").stat().st_size > 10_000

    pv = PaperValues.load(results / "paper" / "paper_values.csv")
    speed = (out / f"speed_{H100_TAG}.md").read_text()
    alone = timing.standalone_rows(results / "speed", H100_TAG)
    rbs_alone = alone[(alone["method"] == "rbs") & (alone["n"] == 131072)]["speedup"].item()
    paper = [
        pv.get("fig:speed_3panel", f"{p}:128K", "RBS-Attention")
        for p in ("standalone", "vllm_attention", "vllm_ttft")
    ]
    x = f"{SPEEDUP['rbs']:.2f}x"
    row = speed.split("| RBS-Attention |")[1].split("\n")[0].split("|")  # the speedups table
    assert row[1].strip() == f"{rbs_alone:.2f}x / {x} / {x} ({' / '.join(paper)})"  # 128K
    assert row[0].strip().endswith(f"{x} {timing.FLAG}")  # rbs missed its target at 32K
    assert f"ttft_{H100_TAG}.csv" in speed and f"methods_128k_{H100_TAG}.csv" in speed

    memory = (out / f"memory_{H100_TAG}.md").read_text()
    meta = pv.get("tab:metadata", "RBS-Attention", "MiB/layer")
    ws = pv.get("tab:metadata", "RBS-Attention", "Workspace (MiB)")
    assert f"2.000 ({meta})" in memory and f"6.000 ({ws})" in memory
    assert "1,024 key blocks of 128, head dimension 128, 4 KV heads" in memory
    assert "Peak memory at batch 1: allocated / reserved (GiB)" in memory

    throughput = (out / f"throughput_{H100_TAG}.md").read_text()
    assert f"| 128K | 4 | {SPEEDUP['flashprefill']:.2f}x |" in throughput
    assert "OOM" in throughput  # quest at batch 4

    selector = (out / f"selector_time_{H100_TAG}.md").read_text()
    assert "| Selector | 32K | 128K |" in selector
    tex = (out / f"selector_time_{H100_TAG}.tex").read_text()
    assert "\\begin{tabular}" in tex and "ttft\\_" in tex


def test_other_devices_get_no_paper_values(results, tmp_path):
    fake_rows("cpu", ns=(1024, 2048), batches=(1,)).to_csv(
        results / "speed" / "ttft_cpu.csv", index=False
    )
    out = tmp_path / "tables"
    timing.build(results, out)
    speed = (out / "speed_cpu.md").read_text()
    assert "(20.65" not in speed and "not shown" in speed
    assert "| RBS-Attention | – / " in speed  # no standalone CSV for a CPU
    memory = (out / "memory_cpu.md").read_text()
    assert "so only ours are shown" in memory


def test_build_without_csvs_writes_nothing(results, tmp_path):
    assert timing.build(results, tmp_path / "tables") == []


def test_standalone_rows_prefer_the_later_methods_file(results):
    common = {"gpu": "X", "target": 0.05, "density": 0.05, "executor": "triton"}
    pd.DataFrame(
        [
            {**common, "n": 1024, "method": "rbs", "total_ms": 1.0, "speedup_vs_sdpa_fa2": 3.0},
            {**common, "n": 1024, "method": "rbs", "total_ms": 2.0, "speedup_vs_sdpa_fa2": 1.5},
            {**common, "n": 1024, "method": "sdpa_fa2", "total_ms": 3.0},
        ]
    ).to_csv(results / "speed" / "attention_x.csv", index=False)
    pd.DataFrame(
        [{**common, "n": 1024, "method": "rbs", "total_ms": 1.5, "speedup_vs_sdpa_fa2": 2.0}]
    ).to_csv(results / "speed" / "methods_1k_x.csv", index=False)
    rows = timing.standalone_rows(results / "speed", "x")
    assert len(rows) == 1 and rows["speedup"].item() == 2.0  # the methods_* row wins
    (results / "speed" / "methods_1k_x.csv").unlink()
    rows = timing.standalone_rows(results / "speed", "x")
    assert rows["speedup"].item() == 3.0  # best executor of the one file


def test_a_csv_with_two_settings_gets_one_set_of_tables_each(results, tmp_path):
    four = fake_rows("cpu", ns=(1024,), batches=(1,))
    eight = four.assign(layers=8, model_desc="8 of 48 layers", ttft_ms=2 * four["ttft_ms"])
    pd.concat([four, eight]).to_csv(results / "speed" / "ttft_cpu.csv", index=False)
    out = tmp_path / "tables"
    names = {p.name for p in timing.build(results, out)}
    for layers in (4, 8):
        assert f"speed_cpu_qwen3_30b_a3b_{layers}l_bfloat16.md" in names
    eight_md = (out / "speed_cpu_qwen3_30b_a3b_8l_bfloat16.md").read_text()
    assert "8 of 48 layers" in eight_md and "4 of 48 layers" not in eight_md


def test_the_latest_full_way_a_model_ran_keeps_the_plain_table_name(results, tmp_path):
    """Eager rows with 16K feed-forward chunks, then compiled unchunked rows of the same model,
    then two compiled rows with 32K chunks: the compiled unchunked ones, the latest of the two
    full runs, are the plain tables; the others get their way named."""
    eager = fake_rows("cpu", ns=(1024,), batches=(1,)).assign(
        compile=False, ffn_chunk_tokens=16384, run="2026-01-01T00:00:00"
    )
    fast = eager.assign(
        compile=True, ffn_chunk_tokens=0, run="2026-02-01T00:00:00", gemm_ms_per_layer=0.05
    )
    fast["ttft_ms"] = eager["ttft_ms"] / 2
    chunked = fast[fast["method"].isin(["dense", "rbs"])].assign(
        ffn_chunk_tokens=32768, run="2026-03-01T00:00:00"
    )
    rows = pd.concat([fast, eager, chunked])
    ttft_rows.derive(rows).to_csv(results / "speed" / "ttft_cpu.csv", index=False)
    out = tmp_path / "tables"
    names = {p.name for p in timing.build(results, out)}
    assert {"speed_cpu.md", "speed_cpu_eager_ffn16k.md", "speed_cpu_compiled_ffn32k.md"} <= names
    plain = (out / "speed_cpu.md").read_text()
    assert "regions outside attention compiled" in plain and "unchunked" in plain
    dense = fast[fast["method"] == "dense"].iloc[0]
    per_layer = (dense["ttft_ms"] - dense["attention_ms"]) / dense["layers"]
    assert f"1K {per_layer:.1f} ms, {per_layer / 0.05:.2f}x" in plain
    old = (out / "speed_cpu_eager_ffn16k.md").read_text()
    assert "layers eager, feed-forward blocks over 16K-token chunks" in old


def test_tables_whose_rows_moved_to_other_names_are_removed(results, tmp_path, capsys):
    """A second model's rows make the first model's tables model-named: the plain-named ones of
    the earlier build go, and files that are not this CSV's tables stay."""
    four = fake_rows("cpu", ns=(1024,), batches=(1,))
    csv = results / "speed" / "ttft_cpu.csv"
    four.to_csv(csv, index=False)
    out = tmp_path / "tables"
    timing.build(results, out)
    assert (out / "speed_cpu.md").exists() and (out / "speed_cpu.png").exists()
    (out / "speed_cpu_notes.md").write_text("# my notes\n")  # not generated: kept
    eight = four.assign(layers=8, model_desc="8 of 48 layers")
    pd.concat([four, eight]).to_csv(csv, index=False)
    names = {p.name for p in timing.build(results, out)}
    assert "speed_cpu_qwen3_30b_a3b_8l_bfloat16.md" in names
    left = {p.name for p in out.iterdir()}
    assert not {"speed_cpu.md", "speed_cpu.tex", "speed_cpu.png", "memory_cpu.md"} & left
    assert "speed_cpu_notes.md" in left and names <= left
    assert "removed" in capsys.readouterr().out


def test_a_model_over_two_gpus_is_said_to_be_so():
    df = fake_rows(H100, ns=(131072,), batches=(1,))
    df["model"], df["layers"], df["gpus"] = "qwen3_32b", 64, 2
    assert timing._unlike_paper(df).endswith(f"on 2 {H100} GPUs")
    assert timing._unlike_paper(df).startswith("qwen3_32b runs all 64 layers")
    df["model"], df["layers"], df["gpus"] = "qwen3_30b_a3b", 48, 1
    assert timing._unlike_paper(df).endswith(f"on one {H100}")
