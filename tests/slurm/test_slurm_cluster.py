"""Both SLURM paths against a real scheduler: slurmctld + slurmd + munged on localhost.

The cluster comes from Debian's slurm-wlm and munge (installed by the fixture if missing; skipped
only where that is impossible: not root, or no apt-get). A 2-method x 1-length x 2-sample grid on
the embedded tiny model goes through `hydra/launcher=slurm_local` (slurm_h100 pointed at the local
partition) and through `sbatch --array` with slurm/grid.sbatch; the merged records must hold every
cell exactly once, a rerun of a finished task must leave them byte for byte unchanged, and a task
requeued mid-run (what preemption does) must finish its cell without losing or repeating a sample.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from local_slurm import PARTITION, LocalSlurm, Unavailable, install

from rbs_bench import report
from rbs_bench import slurm as grid_helper
from rbs_bench.records import read_records, record_key

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "slurm" / "grid.sbatch"
TEST_CONF = Path(__file__).resolve().parent / "conf"
METHODS = ["dense", "rbs"]
GRID = [
    "+experiment=ruler_budget",
    f"method={','.join(METHODS)}",
    "budget=default",
    "benchmark.tasks=[niah_single_1]",
    "benchmark.context_lengths=[1024]",
    "benchmark.num_samples=2",
    "benchmark.max_new_tokens=4",
    "progress=false",
]
# sbatch options that fit the template's H100 request onto the local CPU node
LOCAL = [f"--partition={PARTITION}", "--gpus-per-node=0", "--cpus-per-task=1", "--mem=0"]
TIMEOUT = 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (daemons run as SlurmUser=root)")
    try:
        print(install())
    except Unavailable as e:
        pytest.skip(str(e))
    root = Path(tempfile.mkdtemp(prefix="rbs-slurm-"))
    c = LocalSlurm(root)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _job_env(c: LocalSlurm) -> dict[str, str]:
    """What the jobs inherit through sbatch: this interpreter, a private model cache, 1 thread."""
    return {
        "RBS_PYTHON": sys.executable,
        "RBS_BENCH_CACHE": str(c.root / "cache"),
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "1",
    }


def _sbatch(c: LocalSlurm, array: str, *overrides: str) -> str:
    res = c.run(
        "sbatch",
        "--parsable",
        f"--array={array}",
        *LOCAL,
        f"--output={c.root / 'sbatch-%A_%a.out'}",
        str(TEMPLATE),
        *overrides,
        **_job_env(c),
    )
    return res.stdout.strip().split(";")[0]


def _task_states(c: LocalSlurm, job: str, n: int) -> list[str]:
    return [c.job(f"{job}_{i}").get("JobState") for i in range(n)]


def _cells(results: Path) -> dict[str, list[dict]]:
    exp = results / "runs" / "ruler_budget" / "tiny"
    return {m: read_records(exp / m / "default" / "records.jsonl") for m in METHODS}


def _check_merged(results: Path) -> None:
    """Every cell present with all its samples, each sample once, and the summary built."""
    for method, recs in _cells(results).items():
        keys = [record_key(r) for r in recs]
        assert sorted(keys) == [("niah_single_1", 1024, i) for i in range(2)], method
        assert len(set(keys)) == len(keys), f"{method}: duplicate records"
        assert all(r["method"] == method for r in recs)
    # each task rebuilt the summary when it finished; rebuild it once more now that all are done
    # (as `python -m rbs_bench.report` does), so the check does not depend on finishing order
    report.write_summary(results / "runs/ruler_budget/tiny")
    summary = pd.read_csv(results / "runs/ruler_budget/tiny/summary.csv")
    assert sorted(summary["method"]) == sorted(METHODS)
    assert (summary["n"] == 2).all()  # n = 2 samples per cell


def _outputs(c: LocalSlurm, job: str) -> str:
    return "".join(p.read_text() for p in sorted(c.root.glob(f"sbatch-{job}_*.out")))


@pytest.fixture(scope="module")
def sbatch_results(cluster):
    results = cluster.root / "results-sbatch"
    args = [*GRID, f"results_dir={results}"]
    size = len(grid_helper.grid(args)[0])
    assert size == len(METHODS)
    job = _sbatch(cluster, grid_helper.array_spec(size), *args)
    cluster.wait_jobs(job, TIMEOUT)
    states = _task_states(cluster, job, size)
    assert states == ["COMPLETED"] * size, f"{states}\n{_outputs(cluster, job)}\n{cluster.logs()}"
    return results, args


def test_submitit_launcher_runs_the_grid_as_one_array(cluster, sbatch_results):
    results = cluster.root / "results-submitit"
    sweep = cluster.root / "multirun"
    args = [*GRID, f"results_dir={results}"]
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        "-m",
        *args,
        "hydra/launcher=slurm_local",
        f"hydra.searchpath=[file://{TEST_CONF}]",
        f"hydra.sweep.dir={sweep}",
    ]
    env = cluster.env(**_job_env(cluster))
    res = subprocess.run(
        cmd, cwd=cluster.root, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + cluster.logs()
    # one SLURM array, one task per cell, each completed through the scheduler
    tasks = sorted(p.name for p in (sweep / ".submitit").glob("*_*") if p.is_dir())
    (job,) = {t.split("_")[0] for t in tasks}
    assert tasks == [f"{job}_{i}" for i in range(len(METHODS))]
    cluster.wait_jobs(job, 60)  # the launcher returns once results exist; let the tasks end
    scripts = [p.read_text() for p in (sweep / ".submitit").rglob("*_submission.sh")]
    python = f"{shlex.quote(sys.executable)} -u -m submitit"
    assert scripts and all(python in text for text in scripts)  # the tasks use this interpreter
    assert _task_states(cluster, job, len(METHODS)) == ["COMPLETED"] * len(METHODS)
    _check_merged(results)
    # job i of the launcher is cell i of the sbatch helper: the two paths number cells alike
    cells, _ = grid_helper.grid(args)
    for i, cell in enumerate(cells):
        saved = (sweep / str(i) / ".hydra" / "overrides.yaml").read_text()
        assert [line[2:] for line in saved.splitlines()] == cell
    # the same cells give the same predictions and densities on either path
    sbatch_dir, _ = sbatch_results
    for method, recs in _cells(results).items():
        other = {record_key(r): r for r in _cells(sbatch_dir)[method]}
        for r in recs:
            assert r["prediction"] == other[record_key(r)]["prediction"]
            assert r["density"] == other[record_key(r)]["density"]


def test_sbatch_array_runs_every_cell_once(cluster, sbatch_results):
    results, _ = sbatch_results
    _check_merged(results)
    assert f"({sys.executable})" in "".join(  # every task ran with this interpreter
        p.read_text() for p in cluster.root.glob("sbatch-*.out")
    )


def test_rerunning_a_finished_task_changes_nothing(cluster, sbatch_results):
    results, args = sbatch_results
    exp = results / "runs/ruler_budget/tiny"
    before = {m: (exp / m / "default/records.jsonl").read_bytes() for m in METHODS}
    job = _sbatch(cluster, "1", *args)  # task 1 again, as a user resubmitting it would
    cluster.wait_jobs(job, TIMEOUT)
    assert cluster.job(f"{job}_1")["JobState"] == "COMPLETED", _outputs(cluster, job)
    assert {m: (exp / m / "default/records.jsonl").read_bytes() for m in METHODS} == before
    assert "all 2 samples already recorded" in _outputs(cluster, job)


def test_requeued_task_resumes_without_loss(cluster):
    """`scontrol requeue` kills the running task and queues it again, as preemption does."""
    n = 10
    results = cluster.root / "results-requeue"
    args = [
        "+experiment=ruler_budget",
        "method=dense",
        "budget=default",
        "benchmark.tasks=[niah_single_1]",
        "benchmark.context_lengths=[1024]",
        f"benchmark.num_samples={n}",
        "benchmark.max_new_tokens=16",
        "progress=false",
        f"results_dir={results}",
    ]
    path = results / "runs/ruler_budget/tiny/dense/default/records.jsonl"
    job = _sbatch(cluster, "0", *args)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and not read_records(path):
        state = cluster.job(f"{job}_0").get("JobState")
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"{state}: {_outputs(cluster, job)}"
        time.sleep(0.05)
    cluster.run("scontrol", "requeue", f"{job}_0")
    first = read_records(path)
    assert 1 <= len(first) < n, "the requeue should land mid-run"
    # SLURM holds a requeued job back for a while (BeginTime); once it is pending again, let it
    # start at once
    while cluster.job(f"{job}_0").get("JobState") != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.2)
    # and not before slurmd has finished killing the first run: a relaunch within its cleanup
    # fails at once (exit 1, no output)
    while "DUE TO JOB REQUEUE" not in _outputs(cluster, job) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)
    cluster.run("scontrol", "update", f"JobId={job}_0", "StartTime=now")
    cluster.wait_jobs(job, TIMEOUT)
    info = cluster.job(f"{job}_0")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (
        f"{info}\n{_outputs(cluster, job)}\n{cluster.logs()}"
    )
    final = read_records(path)
    keys = [record_key(r) for r in final]
    assert sorted(r["index"] for r in final) == list(range(n)) and len(set(keys)) == n
    assert final[: len(first)] == first  # finished samples were kept, not recomputed
    log = _outputs(cluster, job)
    assert "(restart 0)" in log and "(restart 1)" in log
