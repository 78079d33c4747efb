"""results/scale/<gpu>.md from GPU records, calibration entries and full-depth TTFT rows."""

from __future__ import annotations

import json

import pandas as pd
import yaml

from rbs_bench import scale


def _record(method: str, density: float, ttft: float) -> dict:
    return {
        "method": method,
        "budget": "d5" if method != "dense" else "default",
        "task": "niah_single_1",
        "index": 0,
        "context_length": 131072,
        "gpu": "NVIDIA H200",
        "ttft_s": ttft,
        "decode_s": 2.0,
        "peak_allocated_mib": 77000,
        "peak_reserved_mib": 79000,
        # two layers x two heads; p90 differs from the mean
        "density_layers_heads": [[density, density], [density, 3 * density]],
        "score": 0.0,
    }


def test_scale_report_from_records(tmp_path):
    res = tmp_path / "results"
    for method, dens, ttft in [("dense", 1.0, 15.0), ("rbs", 0.04, 5.0)]:
        rec = _record(method, dens, ttft)  # in its own cell's folder, as a run writes it
        cell = res / "runs" / "ruler_budget" / "qwen3_30b_a3b_random" / method / rec["budget"]
        cell.mkdir(parents=True)
        (cell / "records.jsonl").write_text(json.dumps(rec) + "\n")
    cal = res / "calibration" / "qwen3_30b_a3b_random"
    cal.mkdir(parents=True)
    entry = {"target": 0.05, "knob": 3.0, "density_mean": 0.05, "abs_error": 7e-6, "steps": 3}
    entry.update(forwards=6, prompts=2, context_length=131072, seconds=360.0, device="NVIDIA H200")
    doc = {"model": "qwen3_30b_a3b_random", "method": "rbs", "entries": [entry]}
    (cal / "rbs.yaml").write_text(yaml.safe_dump(doc))
    speed = res / "speed"
    speed.mkdir()
    base = {"model": "qwen3_30b_a3b", "n": 131072, "status": "ok", "peak_reserved_mib": 1}
    rows = [
        {
            **base,
            "layers": 48,
            "batch": 1,
            "method": "dense",
            "density": 1.0,
            "ttft_ms": 900.0,
            "attention_ms": 600.0,
            "selector_ms": 0.0,
            "peak_allocated_mib": 77000,
            "ttft_speedup": 1.0,
            "attention_speedup": 1.0,
        },
        {
            **base,
            "layers": 48,
            "batch": 1,
            "method": "rbs",
            "density": 0.05,
            "ttft_ms": 300.0,
            "attention_ms": 50.0,
            "selector_ms": 5.0,
            "peak_allocated_mib": 77000,
            "ttft_speedup": 3.0,  # as bench.ttft writes them: dense over method
            "attention_speedup": 12.0,
            "ffn_chunk_tokens": 0,
            "compile": True,
            "gemm_ms_per_layer": 4.0,
        },
        {
            **base,
            "layers": 4,
            "batch": 1,
            "method": "rbs",
            "density": 0.05,
            "ttft_ms": 1.0,
            "attention_ms": 1.0,
            "selector_ms": 1.0,
            "peak_allocated_mib": 1,
        },
    ]
    pd.DataFrame(rows).to_csv(speed / "ttft_nvidia_h200.csv", index=False)
    values = tmp_path / "values.csv"
    values.write_text(
        "table,caption,row,column,value,unit,tex_line,derived\n"
        "tab:calibration,c,RBS-Attention,GPU-hours,0.885,GPU-hours,742,0\n"
        "tab:calibration,c,RBS-Attention,Configurations,3,count,742,0\n"
    )

    (path,) = scale.build(res, tmp_path / "out", values)
    text = path.read_text()
    assert path.name == "nvidia_h200.md" and text.startswith("# Paper scale on NVIDIA H200")
    rbs_run = next(line for line in text.splitlines() if "| RBS-Attention | d5 |" in line)
    cells = [c.strip() for c in rbs_run.split("|")]
    assert cells[7] == "eager, FFN 16K chunks"  # records from before either was recorded
    assert cells[8:11] == ["5.00", "2.00", "75.2"]  # prefill s, decode s, peak GiB
    assert cells[12] == "0.0600 / 0.0400 / 0.0960"  # mean / p50 / p90 over layers x heads
    cal_row = next(line for line in text.splitlines() if "| 360.0 |" in line)
    # 360 s on one GPU = 0.1 GPU-hours for 2 prompts -> 2.5 for 50; the paper's 0.885 beside
    assert "| 0.1000 | 2.500 | 3 | 0.885 |" in cal_row
    ttft = [line for line in text.splitlines() if line.startswith("| qwen3_30b_a3b | ")]
    assert len(ttft) == 2  # the 4-layer row is not a full-depth row
    assert "| 12.00 | 3.00 |" in ttft[1]  # attention and TTFT speedups over dense
    # how the layers ran, and the part outside attention per layer against the layer's GEMMs
    assert "| compiled, FFN unchunked | RBS-Attention |" in ttft[1]
    assert "| 5.21 | 1.30 | 12.00 |" in ttft[1]
    assert "| eager, FFN unchunked | Dense |" in ttft[0] and "| 6.25 | – | 1.00 |" in ttft[0]


def test_scale_report_names_gpu_count_and_visual_share(tmp_path):
    """A Qwen3-32B cell over two GPUs is set beside the busiest GPU's estimate; an FP8 cell beside
    the FP8 estimate; a Video-MME cell shows its video tokens' share of the prompt."""
    from rbs_bench.models import memory

    res = tmp_path / "results"
    cells = {
        ("ruler_budget", "qwen3_32b", "dense"): {"gpus": 2},
        ("ruler_budget", "qwen3_30b_a3b_fp8", "dense"): {"gpus": 1},
        ("videomme", "qwen3_vl_30b_a3b_thinking_fp8", "dense"): {
            "gpus": 1,
            "context_length": 32768,  # a cap: the prompt is shorter
            "input_tokens": 12000,
            "new_tokens": 16,
            "visual_tokens": 10800,
            "visual_token_share": 0.9,
        },
        ("ruler_budget", "qwen3_30b_a3b_random", "dense"): {},  # older records: no gpus field
    }
    for (experiment, model, method), extra in cells.items():
        cell = res / "runs" / experiment / model / method / "default"
        cell.mkdir(parents=True)
        rec = _record(method, 1.0, 10.0) | extra
        (cell / "records.jsonl").write_text(json.dumps(rec) + "\n")
    (path,) = scale.build(res, tmp_path / "out")
    rows = {
        line.split("|")[2].strip(): [c.strip() for c in line.split("|")]
        for line in path.read_text().splitlines()
        if line.startswith("| ruler_budget |") or line.startswith("| videomme |")
    }
    old = scale.OLD_FFN_CHUNK  # these records name no feed-forward chunk: they ran 16384
    # ... nor whether their layers were compiled: eager
    two = memory.estimate_model("qwen3_32b", 131072, ffn_chunk_tokens=old, compiled=False)
    two = memory.per_gpu(two, 2) / memory.GiB
    assert rows["qwen3_32b"][13] == f"{two:.1f}" and rows["qwen3_32b"][16] == "2"
    fp8 = memory.estimate_model("qwen3_30b_a3b_fp8", 131072, ffn_chunk_tokens=old, compiled=False)
    fp8 = fp8.total / memory.GiB
    assert rows["qwen3_30b_a3b_fp8"][13] == f"{fp8:.1f}" and rows["qwen3_30b_a3b_fp8"][16] == "1"
    vl = rows["qwen3_vl_30b_a3b_thinking_fp8"]
    est = memory.estimate_model(
        "qwen3_vl_30b_a3b_thinking_fp8", 12016, visual_tokens=10800, compiled=False
    )
    assert vl[13] == f"{est.total / memory.GiB:.1f}"  # at the longest request, not the cap
    assert vl[17] == "90.0" and rows["qwen3_30b_a3b_random"][16] == "1"
    assert rows["qwen3_30b_a3b_random"][17] == "–"


def test_checkpoint_ttft_rows_at_full_depth_are_reported(tmp_path):
    """bench.ttft rows of a checkpoint are named by its model (qwen3_30b_a3b_fp8): at its
    architecture's full depth they are full-depth rows, beside the FP8 estimate."""
    from rbs_bench.models import memory, rehearsal

    assert rehearsal.full_depth("qwen3_30b_a3b_fp8") == 48
    assert rehearsal.full_depth("qwen3_vl_30b_a3b_thinking_fp8") == 48
    assert rehearsal.full_depth("qwen3_32b") == 64 and rehearsal.full_depth("gpt5") is None
    res = tmp_path / "results"
    (res / "speed").mkdir(parents=True)
    row = {"model": "qwen3_30b_a3b_fp8", "n": 131072, "status": "ok", "batch": 1, "method": "rbs"}
    row |= {
        "density": 0.05,
        "ttft_ms": 3000.0,
        "peak_allocated_mib": 49000,
        "ffn_chunk_tokens": 32768,
    }
    rows = [row | {"layers": 48}, row | {"layers": 4}]
    pd.DataFrame(rows).to_csv(res / "speed" / "ttft_nvidia_h100_80gb_hbm3.csv", index=False)
    (path,) = scale.build(res, tmp_path / "out")
    ttft = [
        line for line in path.read_text().splitlines() if line.startswith("| qwen3_30b_a3b_fp8")
    ]
    assert len(ttft) == 1 and "| 48 |" in ttft[0]
    est = memory.estimate_model(
        "qwen3_30b_a3b_fp8", 131072, ffn_chunk_tokens=32768, compiled=False
    )  # a row without the compile column ran eagerly
    assert f"| {est.total / memory.GiB:.1f} |" in ttft[0]


def test_side_sets_calibrations_are_read_with_their_name(tmp_path):
    """`results/scale/<name>/calibration` is read beside the main calibrations, each entry with
    its set ("" for the main records), and the report names the set beside the model."""
    res = tmp_path / "results"
    entry = {"target": 0.05, "knob": 3.0, "abs_error": 1e-5, "forwards": 6, "prompts": 2}
    for root, device, seconds in [
        (res / "calibration", "NVIDIA H100 80GB HBM3", 150.0),
        (res / "scale" / "side_h200" / "calibration", "NVIDIA H200", 110.0),
    ]:
        cal = root / "qwen3_30b_a3b_fp8"
        cal.mkdir(parents=True)
        doc = {"model": "qwen3_30b_a3b_fp8", "method": "rbs"}
        doc["entries"] = [{**entry, "seconds": seconds, "device": device}]
        (cal / "rbs.yaml").write_text(yaml.safe_dump(doc))
    cal = scale.calibration_entries(res).set_index("gpu")
    assert cal.loc["NVIDIA H100 80GB HBM3", "set"] == ""
    assert cal.loc["NVIDIA H200", "set"] == "side_h200"
    assert cal.loc["NVIDIA H200", "seconds"] == 110.0
    scale.build(res, tmp_path / "out")
    report = (tmp_path / "out" / "nvidia_h200.md").read_text()
    assert "| qwen3_30b_a3b_fp8 (side_h200) | RBS-Attention |" in report
    assert "side_h200" not in (tmp_path / "out" / "nvidia_h100_80gb_hbm3.md").read_text()
