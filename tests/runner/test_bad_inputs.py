"""Every bad input stops the real entry points with one line, exit status 2, before a model loads,
and writes nothing under results_dir (no cell directory, no cell.json, no calibration entry).

Each case runs `python -m rbs_bench` or `python -m rbs_bench.calibrate` in this process (their
`main()` with sys.argv set): the checks run in `preflight`, before Hydra starts, so a case takes
well under a second once the package is imported."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from rbs_bench import __main__ as run_main
from rbs_bench import calibrate, config, methods

ROOT = Path(__file__).resolve().parents[2]
GRID = "+experiment=ruler_budget"
PREFIX = "rbs-bench: error: "


def _bad_yaml(results: Path) -> None:
    shutil.copytree(ROOT / "results" / "calibration" / "tiny", results / "calibration" / "tiny")
    (results / "calibration" / "tiny" / "rbs.yaml").write_text(
        "model: tiny\nentries:\n  - target: 0.5\n    knob: [1, 2\n"
    )


def _bad_longbench_row(results: Path) -> None:
    rows = json.loads((ROOT / "tests/fixtures/longbench_v2/data.json").read_text())
    rows[1]["answer"] = "E"
    results.mkdir()
    (results / "rows.json").write_text(json.dumps(rows))


def _file_in_the_way(results: Path) -> None:
    results.parent.write_text("a file where results_dir's parent directory should be\n")


# (entry point, overrides, what the one line says, setup of results_dir). "{R}" is results_dir.
CASES = {
    "target 0": ("run", [GRID, "budget.target=0"], "budget.target=0 is not a density in (0, 1]"),
    "target 1.5": ("run", [GRID, "budget.target=1.5"], "budget.target=1.5 is not a density"),
    "target -0.1": ("run", [GRID, "budget.target=-0.1"], "budget.target=-0.1 is not a density"),
    "target 0 calibrating": (
        "calibrate",
        [GRID, "method=rbs", "budget.target=0"],
        "budget.target=0 is not a density",
    ),
    "context below one block": (
        "run",
        [GRID, "benchmark.context_lengths=[100]"],
        "context length 100 is shorter than one block (128 tokens, method dense)",
    ),
    "context above max positions": (
        "run",
        ["benchmark.context_lengths=[65536]"],
        "context length 65536 exceeds model.max_context=32768 of tiny",
    ),
    "no samples": (
        "run",
        [GRID, "benchmark.num_samples=0"],
        "benchmark.num_samples=0: ruler needs at least 1",
    ),
    "negative samples": (
        "run",
        ["benchmark=longbench_v2", "benchmark.num_samples=-1"],
        "benchmark.num_samples=-1: longbench_v2 needs at least 0 (every row)",
    ),
    "block size 7": (
        "run",
        [GRID, "method=rbs", "method.block_size=7"],
        "method.block_size=7 must be a power of two in [16, 1024]",
    ),
    "block size 2048": (
        "run",
        ["method=xattn", "method.block_size=2048"],
        "method.block_size=2048 must be a power of two in [16, 1024]",
    ),
    "malformed calibration": (
        "run",
        [GRID, "method=rbs", "budget=d50"],
        "{R}/calibration/tiny/rbs.yaml at line 5 is not valid YAML (expected ',' or ']', but "
        "got '<stream end>'); repair it, or delete {R}/calibration/tiny/rbs.yaml and rerun "
        "python -m rbs_bench.calibrate to remake it",
        _bad_yaml,
    ),
    "malformed calibration, calibrating": (
        "calibrate",
        [GRID, "method=rbs", "budget=d50"],
        "{R}/calibration/tiny/rbs.yaml at line 5 is not valid YAML",
        _bad_yaml,
    ),
    "missing calibration": (
        "run",
        [GRID, "method=rbs", "budget=d50", "benchmark.context_lengths=[2048]"],
        "create it with: python -m rbs_bench.calibrate +experiment=ruler_budget results_dir={R} "
        "'benchmark.context_lengths=[2048]' model=tiny method=rbs budget=d50 budget.target=0.5",
    ),
    "unwritable results_dir": (
        "run",
        [GRID, "method=dense", "budget=default"],
        "cannot write {R}/runs/ruler_budget/tiny/dense/default/records.jsonl: {P}/file is not a "
        "directory; set results_dir= to a writable directory",
        _file_in_the_way,
    ),
    "unwritable calibration dir": (
        "calibrate",
        [GRID, "method=rbs", "budget=d50"],
        "cannot write {R}/calibration/tiny/rbs.yaml: {P}/file is not a directory",
        _file_in_the_way,
    ),
    "malformed LongBench row": (
        "run",
        [
            "+experiment=longbench_v2",
            "benchmark.data.dataset={R}/rows.json",
        ],
        "LongBench-v2 row _id='fx-lbv2-0002' (row 1 of {R}/rows.json): field 'answer' is 'E'; "
        "valid: A, B, C, D",
        _bad_longbench_row,
    ),
    "unknown method": (
        "run",
        ["method=nosuch"],
        f"unknown method 'nosuch'; valid: {', '.join(methods.available())}",
    ),
    "unknown method, calibrating": (
        "calibrate",
        ["method=nosuch"],
        f"unknown method 'nosuch'; valid: {', '.join(methods.available())}",
    ),
}


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    entry, overrides, expect, *setup = CASES[name]
    results = tmp_path / "R"
    if name.startswith("unwritable"):
        results = tmp_path / "file" / "R"
    if setup:
        setup[0](results)
    fill = lambda s: s.replace("{R}", str(results)).replace("{P}", str(tmp_path))
    argv = [fill(o) for o in overrides]
    if not any(o.startswith("results_dir=") for o in argv):
        argv.insert(1 if argv[0].startswith("+experiment") else 0, f"results_dir={results}")
    before = _tree(tmp_path)
    monkeypatch.setattr(sys, "argv", [entry, *argv])
    monkeypatch.setattr(config, "COMMAND_OVERRIDES", None)
    main = run_main.main if entry == "run" else calibrate.main
    monkeypatch.setattr(run_main, "_hydra_main", lambda: pytest.fail("passed the checks"))
    monkeypatch.setattr(calibrate, "_hydra_main", lambda: pytest.fail("passed the checks"))
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(PREFIX)
    assert fill(expect) in lines[0]
    assert _tree(tmp_path) == before  # nothing written
