"""`python -m rbs_bench.parallel`: an experiment's cells as concurrent processes, resumably."""

import json
import os
import subprocess
import sys

from rbs_bench import parallel


def test_cells_are_the_reference_and_the_sweep():
    cells = parallel.cells("ruler_budget=3", ["results_dir=/tmp/r", "device=cpu"])
    assert len(cells) == 1 + 6 * 4  # dense, then 6 methods x 4 targets
    first = cells[0]
    assert "method=dense" in first.overrides and "budget=default" in first.overrides
    assert str(first.records).endswith("runs/ruler_budget/tiny/dense/default/records.jsonl")
    assert all(c.samples == 3 for c in cells)  # one task at one length, 3 samples
    block = parallel.cells("block_size=5", ["results_dir=/tmp/r"])
    assert {c.records.parent.name for c in block} == {f"anchor0.7_B{b}" for b in (32, 64, 128)}
    assert parallel.cells("longbench_v2", ["results_dir=/tmp/r"])[0].samples == -1  # every row


def test_records_of_another_device_are_replaced(tmp_path):
    (cell,) = parallel.cells("thresholds", [f"results_dir={tmp_path}"])[:1]
    cell.records.parent.mkdir(parents=True)
    cell.records.write_text(json.dumps({"device": "cpu", "index": 0}) + "\n")
    (cell.records.parent / "cell.json").write_text("{}")
    assert parallel.replace_other_device(cell, "cpu") == 0 and cell.records.exists()
    assert parallel.replace_other_device(cell, "cuda:0") == 1
    assert not cell.records.exists() and not (cell.records.parent / "cell.json").exists()


def _run(tmp_path):
    cmd = [sys.executable, "-m", "rbs_bench.parallel", "thresholds=1", "--jobs", "2"]
    cmd += ["--results", str(tmp_path), "--", "device=cpu", "model=tiny_random"]
    cmd += ["benchmark.context_lengths=[1024]", "benchmark.max_new_tokens=2"]
    cmd += ["rbs_thresholds=default,aggressive"]  # replaces the experiment's axis: two cells
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


def test_a_call_runs_every_cell_and_a_rerun_has_nothing_left(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "2 cells, 2 to run (2 samples) with 2 processes on cpu" in res.stdout
    assert "every cell complete" in res.stdout
    runs = tmp_path / "runs/thresholds/tiny_random/rbs"
    assert sorted(p.name for p in runs.iterdir()) == ["aggressive", "default"]
    assert (tmp_path / "outputs/parallel/thresholds/default.log").exists()
    again = _run(tmp_path)
    assert "2 cells, 0 to run" in again.stdout and "start" not in again.stdout


def test_cells_are_forked_unless_turned_off(monkeypatch):
    """Cells fork from this process (its imports done once) where the OS can and CUDA is not
    initialised here; RBS_BENCH_PARALLEL_FORK=0 starts each as a new Python."""
    import torch

    monkeypatch.setenv(parallel.FORK_ENV, "0")
    assert not parallel._forkable()
    monkeypatch.delenv(parallel.FORK_ENV)
    assert parallel._forkable() == hasattr(os, "fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not parallel._forkable()


def test_cells_are_spread_over_the_visible_gpus(monkeypatch, tmp_path):
    """Several GPUs: each cell gets one (the least loaded) through CUDA_VISIBLE_DEVICES, within
    the entries of an existing CUDA_VISIBLE_DEVICES; one GPU, a fixed cuda:N or the CPU: none."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parallel.visible_gpus("cuda") == ["0", "1", "2", "3"]
    assert parallel.visible_gpus("cuda:1") == [] and parallel.visible_gpus("cpu") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parallel.visible_gpus("cuda") == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parallel.visible_gpus("cuda") == []

    started = []

    class Proc:
        returncode = 0

        def __init__(self, args, stdout, stderr, env):
            started.append(env.get("CUDA_VISIBLE_DEVICES"))

        def poll(self):
            return 0  # ends at once: the next cells take the GPUs it frees

    monkeypatch.setattr(parallel.subprocess, "Popen", Proc)
    monkeypatch.setattr(parallel, "LOG_DIR", tmp_path)
    monkeypatch.setattr(parallel.time, "sleep", lambda s: None)
    todo = [parallel.Cell("e", [f"method=m{i}"], tmp_path / f"{i}.jsonl", 1) for i in range(5)]
    parallel._run_cells(todo, [], 3, 1e6, parallel.time.monotonic(), {}, gpus=["0", "1"])
    assert started == ["0", "1", "0", "0", "1"]  # the least loaded first; then the freed ones


def test_cells_keep_tuned_choices_and_share_the_cores(monkeypatch):
    """Cells read the kernels' stored tuning choices and split the cores, unless the caller's
    environment says otherwise."""
    monkeypatch.delenv("RBS_BENCH_AUTOTUNE_CACHE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 16)
    env = parallel.cell_env(4)
    assert env["RBS_BENCH_AUTOTUNE_CACHE"] == "1" and env["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("RBS_BENCH_AUTOTUNE_CACHE", "0")
    assert parallel.cell_env(4)["RBS_BENCH_AUTOTUNE_CACHE"] == "0"
