"""Synthetic Video-MME data (rbs_bench.benchmarks.videomme_synthetic), and a Video-MME cell run on
it, dense and RBS, on the embedded tiny_vl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rbs_bench.benchmarks import videomme as vm
from rbs_bench.benchmarks import videomme_synthetic as syn
from rbs_bench.records import read_records

pytest.importorskip("av")

SIZE = (64, 96)  # height, width: small frames, whole 32-pixel merge blocks
SECONDS = (90, 240, 1800)  # the shortest lengths of each class


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    syn.write(out, seed=3, fps=1, size=SIZE, seconds=SECONDS, progress=False)
    return out


def test_videos_have_videomme_lengths_and_rows_its_schema(data):
    rows = vm.load_rows({"dataset": str(data / syn.DATASET)})
    assert [r["duration"] for r in rows] == list(vm.DURATIONS)
    for row, seconds in zip(rows, SECONDS, strict=True):
        info = vm.probe(vm.find_video(data / "videos", row))
        assert (info.total_frames, info.fps, info.height, info.width) == (seconds, 1.0, *SIZE)
        assert row["videoID"].startswith(f"synth-{row['duration']}-")


def test_the_answer_is_the_colour_the_video_shows(data):
    """Every sampled frame shows the square in the colour the answer names, and only it."""
    rows = vm.load_rows({"dataset": str(data / syn.DATASET)})
    for row in rows:
        answer = row["options"]["ABCD".index(row["answer"])]
        colour = answer.split(". ", 1)[1].rstrip(".").lower()
        info = vm.probe(vm.find_video(data / "videos", row))
        idx = vm.sample_indices(info.total_frames, 8)
        frames = vm.read_frames(vm.find_video(data / "videos", row), idx)
        for f in frames:
            shown = [
                name
                for name, rgb in syn.COLOURS.items()
                if (np.abs(f.astype(int) - rgb).max(-1) < 40).sum() >= 50  # a patch of it
            ]
            assert shown == [colour], (row["question_id"], shown)


def test_rerun_keeps_videos_and_bad_settings_are_one_line(data, tmp_path):
    videos = sorted((data / "videos").iterdir())
    stamps = [p.stat().st_mtime_ns for p in videos]
    syn.write(data, seed=3, fps=1, size=SIZE, seconds=SECONDS, progress=False)
    assert [p.stat().st_mtime_ns for p in sorted((data / "videos").iterdir())] == stamps
    other = syn.write(tmp_path, seed=4, fps=1, size=SIZE, seconds=SECONDS, progress=False)
    assert json.loads(other.read_text().splitlines()[0])["videoID"] != videos[0].stem
    with pytest.raises(ValueError, match=r"--seconds 200 is not a short Video-MME video"):
        syn.write(tmp_path, seconds=(200, 600, 2400))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rbs_bench.benchmarks.videomme_synthetic",
            "--out",
            str(tmp_path),
            "--size",
            "big",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "'big' is not WIDTHxHEIGHT" in r.stderr


def test_videomme_cell_on_tiny_vl_dense_and_rbs(data, tmp_path, monkeypatch):
    """A Video-MME cell on the synthetic data, dense and RBS, on the embedded tiny_vl (the paper's
    VL model's rehearsal checkpoint runs the same command in tests/slurm/test_paper_models.py)."""
    from hydra import compose, initialize_config_module

    from rbs_bench import config
    from rbs_bench.runner import run_cell
    from rbs_bench.session import Session

    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    config.register_schemas()
    base = [
        "+experiment=videomme",
        f"benchmark.data.dataset={data / syn.DATASET}",
        f"benchmark.data.video_dir={data / 'videos'}",
        "benchmark.data.num_frames=4",
        "benchmark.max_new_tokens=2",
        "recall=false",
        "device=cpu",
        "progress=false",
        f"results_dir={tmp_path}",
        "budget=default",
    ]
    sparse = ["method=rbs", "method.block_size=16", "method.alpha_base=0.9"]
    session = Session()
    for method in (["method=dense"], [*sparse, "method.alpha_rescue=0.9"]):
        with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name="config", overrides=base + method)
        run_cell(cfg, "videomme", session)
    exp = tmp_path / "runs" / "videomme" / "tiny_vl"
    dense = read_records(exp / "dense" / "default" / "records.jsonl")
    rbs = read_records(exp / "rbs" / "default" / "records.jsonl")
    assert [r["meta"]["duration"] for r in dense] == list(vm.DURATIONS)
    for d, s in zip(dense, rbs, strict=True):
        assert d["prompt_sha1"] == s["prompt_sha1"] and d["density"] == 1.0
        assert 0 < s["density"] < 1  # pruned over the text and video tokens
        assert 0 < d["visual_token_share"] < 1
        assert d["visual_tokens"] == round(d["visual_token_share"] * d["input_tokens"])
