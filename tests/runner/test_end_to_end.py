"""The runner end to end on the embedded tiny model: grid, records, summary, resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rbs_bench import methods

SMALL = [
    "budget=default",  # the experiment's own grid asks for calibrated targets
    "benchmark.context_lengths=[1024]",
    "benchmark.num_samples=2",
    "benchmark.max_new_tokens=4",
    "progress=false",
]


def _run(tmp_path, *extra, timeout=600):
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "+experiment=ruler_budget",
        *SMALL,
        f"results_dir={tmp_path}",
        *extra,
    ]
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_grid_writes_records_and_summary(tmp_path):
    every = f"hydra.sweeper.params.method='{','.join(methods.available())}'"
    paper_forced = [  # the experiment's CPU default shrinks them; these are the paper's
        "forced.sink_blocks=2",
        "forced.window_blocks=4",
        "forced.last_q_blocks=2",
        "forced.min_budget=1024",
    ]
    every = [every, *paper_forced]
    res = _run(tmp_path, *every)
    assert res.returncode == 0, res.stderr[-3000:]
    exp = tmp_path / "runs" / "ruler_budget" / "tiny"
    summary = (exp / "summary.csv").read_text().splitlines()
    names = [row.split(",")[0] for row in summary[1:]]
    assert names == methods.in_order(methods.available())  # MethodInfo.order, dense first
    for method in methods.available():
        recs = _records(exp / method / "default" / "records.jsonl")
        assert [r["index"] for r in recs] == [0, 1]
        for r in recs:
            assert r["method"] == method and r["context_length"] == 1024
            assert r["input_tokens"] <= 1024 - 4 and r["new_tokens"] <= 4
            assert 0 < r["density"] <= 1 and 0 <= r["score"] <= 100
            assert len(r["density_layers_heads"]) >= 2  # one row per layer
        if method in ("dense", "rbs", "centroid", "full_l2", "flashprefill", "flexprefill"):
            # 1024 tokens at block 128: 8 blocks, all forced by sinks, window and last rows
            # (FlexPrefill runs prompts up to its 1024-token min budget dense)
            assert all(r["density"] == 1.0 for r in recs)
    assert (exp / "score_vs_density.png").exists()
    # rerunning finds everything recorded and recomputes nothing
    res = _run(tmp_path, *every)
    assert res.returncode == 0
    assert res.stdout.count("already recorded") == len(methods.available())


@pytest.mark.slow
def test_sparse_methods_prune_on_longer_prompts(tmp_path):
    res = _run(
        tmp_path,
        "method=rbs",
        "method.block_size=32",
        "method.alpha_base=0.9",
        "method.alpha_rescue=0.9",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (rec, *_) = _records(tmp_path / "runs/ruler_budget/tiny/rbs/default/records.jsonl")
    assert rec["density"] < 1.0
    assert rec["method_fields"]["alpha_base"] == 0.9


@pytest.mark.slow
def test_kill_and_resume(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "+experiment=ruler_budget",
        "method=dense",
        "budget=default",
        "benchmark.tasks=[niah_single_1]",  # short prompts: 24 new tokens fit in 1024
        "benchmark.context_lengths=[1024]",
        "benchmark.num_samples=12",
        "benchmark.max_new_tokens=24",
        "progress=false",
        f"results_dir={tmp_path}",
    ]
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    path = tmp_path / "runs/ruler_budget/tiny/dense/default/records.jsonl"
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and (not path.exists() or not path.read_text().strip()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = _records(path)
    assert 1 <= len(first) < 12, "kill should land mid-run"
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    final = _records(path)
    assert sorted(r["index"] for r in final) == list(range(12))
    assert final[: len(first)] == first  # finished samples were not recomputed
