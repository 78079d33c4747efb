"""Two processes at once on one cell or one calibration file: every sample recorded once, every
calibration entry kept (the cell lock of records.py, the store lock of calibrations.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rbs_bench.records import read_records, record_key


def _together(tmp_path, script: str, n: int = 2, timeout: float = 120):
    """Run `script` in n processes (argv[1] = 0..n-1); each runs `_at_go` once set up, which
    waits until every process is there, so their work overlaps."""
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("ready.*"))) < n and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    out = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], out


def _at_go(tmp_path: Path) -> str:
    """Python lines: say this process is ready, then wait for the start."""
    return (
        f"Path({str(tmp_path)!r}, 'ready.' + sys.argv[1]).touch()\n"
        f"while not Path({str(tmp_path)!r}, 'go').exists():\n"
        "    time.sleep(0.002)\n"
    )


CALIBRATION_WRITER = """
import os, sys, time
from pathlib import Path
from omegaconf import OmegaConf
from rbs_bench import calibrations

who = int(sys.argv[1])
cfg = OmegaConf.create(
    {{"calibration": {{"dir": {dir!r}}}, "model": {{"name": "tiny", "hf_id": None}},
     "method": {{"name": "rbs"}}}}
)
{at_go}for i in range({n}):
    target = round(0.001 * (2 * i + who + 1), 6)
    entry = {{"target": target, "knob": 1.0, "knob_name": "alpha_scale", "density_mean": target,
              "abs_error": 0.0, "setting": {{"writer": who}}}}
    calibrations.store(cfg, entry)
"""


def test_parallel_calibrations_of_one_method_keep_every_entry(tmp_path):
    n = 40
    script = CALIBRATION_WRITER.format(dir=str(tmp_path / "cal"), at_go=_at_go(tmp_path), n=n)
    codes, out = _together(tmp_path, script)
    assert codes == [0, 0], [err[-2000:] for _, err in out]
    data = yaml.safe_load((tmp_path / "cal/tiny/rbs.yaml").read_text())
    targets = sorted(e["target"] for e in data["entries"])
    assert len(targets) == 2 * n
    assert targets == sorted(round(0.001 * (k + 1), 6) for k in range(2 * n))
    # each writer used its own temp file, and none is left behind
    assert sorted(p.name for p in (tmp_path / "cal/tiny").iterdir()) == [
        "rbs.yaml",
        "rbs.yaml.lock",
    ]


CELL_APPENDER = """
import sys, time
from pathlib import Path
from rbs_bench.records import RecordStore

who = int(sys.argv[1])
store = RecordStore(Path({path!r}))  # both open the cell before either appends, as two runs do
{at_go}for i in range({n}):
    key = ("niah_single_1", 1024, i)
    if store.done(key):
        continue
    time.sleep(0.002)  # the sample's computation
    store.append({{"task": key[0], "context_length": key[1], "index": i, "who": who}})
"""


def test_two_stores_of_one_cell_record_each_sample_once(tmp_path):
    """The cell loop on the records API: check what is recorded, compute, append."""
    path = tmp_path / "cell" / "records.jsonl"
    n = 60
    codes, out = _together(
        tmp_path, CELL_APPENDER.format(path=str(path), at_go=_at_go(tmp_path), n=n)
    )
    assert codes == [0, 0], [err[-2000:] for _, err in out]
    keys = [record_key(r) for r in read_records(path)]
    assert len(keys) == len(set(keys)) == n
    assert path.read_text().count("\n") == n


RUN_ARGS = [
    "+experiment=ruler_budget",
    "method=dense",
    "budget=default",
    "benchmark.tasks=[niah_single_1]",
    "benchmark.context_lengths=[1024]",
    "benchmark.num_samples=3",
    "benchmark.max_new_tokens=2",
    "progress=false",
]


@pytest.mark.slow
def test_two_runs_of_one_cell_record_each_sample_once(tmp_path):
    """A requeued task beside its original: the second waits for the cell lock, then skips."""
    args = [*RUN_ARGS, f"results_dir={tmp_path / 'r'}"]
    script = (
        "import sys, time\nfrom pathlib import Path\n"
        + _at_go(tmp_path)
        + f"sys.argv = ['rbs_bench', *{args!r}]\n"
        + "from rbs_bench.__main__ import main\nmain()\n"
    )
    codes, out = _together(tmp_path, script, timeout=300)
    assert codes == [0, 0], [err[-2000:] for _, err in out]
    cell = tmp_path / "r/runs/ruler_budget/tiny/dense/default"
    recs = read_records(cell / "records.jsonl")
    assert sorted(r["index"] for r in recs) == [0, 1, 2]
    stdout = "".join(o for o, _ in out)
    assert "all 3 samples already recorded" in stdout
    assert json.loads((cell / "cell.json").read_text())["method.name"] == "dense"
