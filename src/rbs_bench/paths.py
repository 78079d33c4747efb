"""The layout of a results directory, in one place: every module that reads or writes under
`results_dir` builds its paths here.

    <results>/runs/<experiment>/<model>/                   one experiment on one model: summary.md,
                                                           summary*.csv, plots (`experiment_dir`)
    <results>/runs/<experiment>/<model>/<method>/<budget>/ one cell (`cell_dir`): records.jsonl,
                                                           cell.json, .lock
    <results>/calibration/<model>/<method>.yaml            calibrated knobs (`calibration_file`;
                                                           calibration.dir moves the folder)
    <results>/speed/                                       timing CSVs and plots
    <results>/tables/  <results>/figures/  <results>/scale/  tables, figures, GPU cost reports
    <results>/paper/paper_values.csv                       the paper's numbers

Every name that becomes a folder or file name (experiment, model, method, budget) must be one path
component: not empty, not `.` or `..`, without a path separator or a NUL byte. A name that is not
stops with one line (`component`), so nothing is ever written outside its directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from rbs_bench.errors import UserError

RUNS = "runs"
CALIBRATION = "calibration"
SPEED = "speed"
TABLES = "tables"
FIGURES = "figures"
SCALE = "scale"
PAPER_VALUES = ("paper", "paper_values.csv")
RECORDS = "records.jsonl"  # a cell's run records, one JSON line per sample
CELL_FILE = "cell.json"  # the settings the records of a cell were made with (a cache)
LOCK_NAME = ".lock"  # the lock a cell's writers hold (records.cell_lock)
SUMMARY = "summary.md"  # an experiment's summary on one model (report.write_summary)

_SEPARATORS = {"/", "\\", os.sep, os.altsep, "\0"} - {None}


def component(value, key: str) -> str:
    """`value` as one path component, or a UserError naming `key` (the config key that set it)."""
    text = "" if value is None else str(value)
    bad = None
    if not text.strip():
        bad = "is empty"
    elif text in (".", ".."):
        bad = "names a directory of the path itself"
    elif any(s in text for s in _SEPARATORS):
        bad = "holds a path separator"
    if bad:
        raise UserError(
            f"{key}={text!r} {bad}; it becomes one folder or file name under results_dir, so use "
            f"a plain name such as {key}=d50 (letters, digits, '_', '-', '.')"
        )
    return text


def runs_dir(results) -> Path:
    return Path(results) / RUNS


def experiment_dir(results, experiment: str, model: str) -> Path:
    """<results>/runs/<experiment>/<model>: an experiment's cells on one model, and its summary."""
    return runs_dir(results) / component(experiment, "experiment") / component(model, "model.name")


def cell_dir(results, experiment: str, model: str, method: str, budget: str) -> Path:
    """<results>/runs/<experiment>/<model>/<method>/<budget>: one cell's records."""
    return (
        experiment_dir(results, experiment, model)
        / component(method, "method.name")
        / component(budget, "budget.name")
    )


def experiment_dirs(results) -> list[Path]:
    """Every <results>/runs/<experiment>/<model> folder, sorted."""
    return sorted(p for p in runs_dir(results).glob("*/*") if p.is_dir())


def cell_records(exp_dir) -> list[Path]:
    """The records file of every cell of an experiment folder, sorted."""
    return sorted(Path(exp_dir).glob(f"*/*/{RECORDS}"))


def calibration_dir(results) -> Path:
    return Path(results) / CALIBRATION


def calibration_file(cal_dir, model: str, method: str) -> Path:
    """<calibration dir>/<model>/<method>.yaml: the calibrated knobs of one method on one model."""
    name = component(method, "method.name")
    return Path(cal_dir) / component(model, "model.name") / f"{name}.yaml"


def speed_dir(results) -> Path:
    return Path(results) / SPEED


def tables_dir(results) -> Path:
    return Path(results) / TABLES


def figures_dir(results) -> Path:
    return Path(results) / FIGURES


def scale_dir(results) -> Path:
    return Path(results) / SCALE


def paper_values_file(results) -> Path:
    return Path(results).joinpath(*PAPER_VALUES)
