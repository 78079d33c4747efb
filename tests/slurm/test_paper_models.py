"""slurm/paper_models.sbatch, run end to end on a CPU at tiny dims: the steps' command lines as the
GPU runs them (the FP8 MoE's write, calibrations and ruler_budget cells, one process per method;
synthetic Video-MME, the VL model's write and cells; tables), with the models shrunk through
WRITE_ARGS, a short context and a reachable budget (at 2K the forced blocks alone keep more than
5%). Qwen3-32B's steps are the same functions with another model (and model.device_map=auto,
which needs GPUs); each python process costs seconds, so they are left out here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rbs_bench.models import local_digest
from rbs_bench.records import read_records

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {  # the models shrunk: whole 128x128 blocks, 2 layers (WRITE_ARGS)
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
}
EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 256,
    "num_position_embeddings": 256,
    "deepstack_visual_indexes": "[0]",
}


def sets(fields: dict, prefix: str = "") -> str:
    return " ".join(f"--set {prefix}{k}={v}" for k, v in fields.items())


MOE = sets(SHAPE | EXPERTS)
VL = sets(SHAPE | EXPERTS, "text_config.") + " " + sets(VISION, "vision_config.")


def run_script(tmp_path: Path, steps: str, write_args: str) -> subprocess.CompletedProcess:
    env = os.environ | {
        "STEPS": steps,
        "DEVICE": "cpu",
        "CONTEXT": "2048",
        "BUDGET": "d50",
        "SAMPLES": "1",
        "FRAMES": "4",
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "VIDEO_DIR": str(tmp_path / "videos"),
        "RESULTS": str(tmp_path / "results"),
        "RBS_PYTHON": sys.executable,
        "WRITE_ARGS": f"--layers 2 --no-progress {write_args}",
        "VIDEO_ARGS": "--size 96x64 --fps 1 --seconds 90 240 1800 --no-progress",
        "RUN_ARGS": "model.dtype=float32 progress=false benchmark.max_new_tokens=2",
    }
    return subprocess.run(
        ["bash", str(ROOT / "slurm" / "paper_models.sbatch")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_paper_models_script_runs_every_step(tmp_path):
    parts = [
        ("fp8-write fp8-calibrate fp8-run", MOE),
        ("vl-videos vl-write vl-run tables", VL),
    ]
    for steps, write_args in parts:
        r = run_script(tmp_path, steps, write_args)
        assert r.returncode == 0, (steps, r.stdout[-1500:], r.stderr[-3000:])
    runs = tmp_path / "results" / "runs"
    cells = [
        ("qwen3_30b_a3b_fp8", "dense", "default"),
        ("qwen3_30b_a3b_fp8", "flashprefill", "d50"),
        ("qwen3_30b_a3b_fp8", "rbs", "d50"),
    ]
    for model, method, budget in cells:
        (rec,) = read_records(runs / "ruler_budget" / model / method / budget / "records.jsonl")
        assert rec["context_length"] == 2048 and rec["model"] == model
        # the checkpoint is named by its weights' digest, not by where it lies
        assert "path" not in rec["model_identity"]
        assert rec["model_identity"]["weights"] == local_digest(tmp_path / "ckpt" / model)
    cal = tmp_path / "results" / "calibration" / "qwen3_30b_a3b_fp8"
    assert sorted(p.stem for p in cal.glob("*.yaml")) == ["flashprefill", "rbs"]
    vl = runs / "videomme" / "qwen3_vl_30b_a3b_thinking_fp8"
    for method in ("dense", "rbs"):
        recs = read_records(vl / method / "default" / "records.jsonl")
        assert [r["meta"]["duration"] for r in recs] == ["short", "medium", "long"]
        assert all(0 < r["visual_token_share"] < 1 for r in recs)
    assert (tmp_path / "results" / "tables" / "ruler_budget_qwen3_30b_a3b_fp8.md").is_file()
