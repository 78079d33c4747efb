"""Everything about a run's input that can be checked before a model loads.

`check_cell` is called for every cell of a grid before the first cell starts (by `preflight`,
before Hydra runs, and again by `rbs_bench.__main__.run` and `rbs_bench.calibrate.run` for the
cells a launcher hands them), so that a bad value stops the command with one line, exit status
2, and nothing written: no cell directory, no `cell.json`, no records, no calibration entry.

What it checks, in order: the device, executor and time budgets (`check_run_settings`, also for
the analyses that are not grids); the names that become folders (experiment, model, method,
budget) are one path component each, at most `paths.NAME_BYTES` long (`paths.component`); the
budget's target is a density in (0, 1];
`benchmark.num_samples` is at least 1 (0 means "every row" only for benchmarks that read rows
from a data set) and at most what the benchmark can generate (its `MAX_SAMPLES`);
`benchmark.max_new_tokens` is positive (or null); the method's block size is a power of two in
[16, 1024]; the method's fields and knob; the benchmark's tasks, data (a malformed local data row
names its file and row) and context lengths (at least one block, at most `model.max_context`);
the model's local files (a truncated weight file or tokenizer names the file, `models.identity`;
weights only in pickle files need `model.allow_pickle=true`); that the cell's files can be
written there (regular files, no symbolic link leading out of results_dir, a path the file system
takes: `check_writable`); and the calibration the budget reads (present, well-formed, not edited,
of this model) or, calibrating, `calibration.num_prompts`.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rbs_bench import benchmarks, config, models, paths
from rbs_bench.calibrations import calibration_path, read_entries
from rbs_bench.config import (
    CONFIG_MODULE,
    explain,
    reference_cells,
    sweep_cells,
    validate,
)
from rbs_bench.errors import UserError
from rbs_bench.execution import EXECUTORS
from rbs_bench.session import build_selector, cell_dir, check_benchmark

BLOCK_SIZES = (16, 1024)  # smallest and largest block size a run accepts (powers of two)
DEVICE_TYPES = ("cpu", "cuda")  # what `device` may name (auto: cuda when visible, else cpu)


def check_cell(cfg: DictConfig, experiment: str, calibrating: bool = False) -> None:
    """Raise UserError (one line) if this cell cannot run; write nothing either way.

    `calibrating`: the cell is checked for `rbs_bench.calibrate`, which writes a calibration
    rather than reading one."""
    check_run_settings(cfg)
    paths.confine(cfg.results_dir)  # from here on no write leaves it through a link
    _check_names(cfg, experiment)
    _check_budget(cfg)
    try:
        bench = benchmarks.get(cfg.benchmark.name)
    except ValueError as e:
        raise UserError(str(e)) from None
    _check_num_samples(cfg, bench)
    _check_max_new_tokens(cfg)
    _check_block_size(cfg)
    selector = build_selector(cfg, apply_budget=False)  # fields and knob values of the method
    check_benchmark(cfg)  # tasks, data sources and rows, lengths against model.max_context
    _check_lengths(cfg, selector.block_size)
    _check_model_files(cfg)
    if calibrating:
        if cfg.budget.target is not None and selector.knob is not None:
            _check_num_prompts(cfg)
            path = calibration_path(cfg)
            paths.confine(cfg.calibration.dir)
            for name in (path.name, f"{path.name}.lock"):
                check_writable(path.with_name(name), "calibration.dir")
            read_entries(path)  # a malformed file fails now, not after the search
    else:
        cell = cell_dir(cfg, experiment)
        for name in (paths.RECORDS, paths.LOCK_NAME):  # appended to, opened for writing
            check_writable(cell / name, "results_dir")
        cached = paths.check_inside(cell / paths.CELL_FILE)  # replaced whole: its folder decides
        if os.path.lexists(cached) and paths.not_regular(cached, os.lstat(cached).st_mode):
            raise paths.not_regular(cached, os.lstat(cached).st_mode)
        build_selector(cfg)  # reads the calibrated knob: a missing or malformed file fails now


def check_run_settings(cfg: DictConfig) -> None:
    """The settings of how any command runs: `device` names a device (auto, cpu, cuda, cuda:N;
    whether one is visible is checked where the model loads, so a job can be submitted from a
    machine without one), `executor` is one of the executors, and every time budget
    (`time_budget_s`, `timing.time_budget_s`) is a finite number of seconds above 0 or unset."""
    _check_device(str(cfg.device))
    valid = ("auto", *EXECUTORS)
    if cfg.executor not in valid:
        raise UserError(
            f"executor={cfg.executor!r} is not an executor; use one of {', '.join(valid)}"
        )
    budgets = [("time_budget_s", cfg.get("time_budget_s"))]
    if cfg.get("timing") is not None:
        budgets.append(("timing.time_budget_s", cfg.timing.get("time_budget_s")))
    for key, value in budgets:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(
                f"{key}={value:g} must be a finite number of seconds above 0 (no new work starts "
                f"after it; rerunning continues), e.g. {key}=3600, or leave it unset for no limit"
            )


def _check_device(name: str) -> None:
    if name == "auto":
        return
    import torch

    try:
        kind = torch.device(name).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in DEVICE_TYPES:
        raise UserError(
            f"device={name!r} is not a device this harness runs on; use device=auto, cpu, cuda or "
            "cuda:N"
        )


def _check_names(cfg: DictConfig, experiment: str) -> None:
    """Each name that becomes a folder or file name under results_dir is one path component."""
    paths.component(experiment, "experiment")
    paths.component(cfg.model.name, "model.name")
    paths.component(cfg.method.name, "method.name")
    paths.component(cfg.budget.name, "budget.name")


def _check_budget(cfg: DictConfig) -> None:
    target = cfg.budget.target
    if target is not None and not (math.isfinite(target) and 0 < target <= 1):
        raise UserError(
            f"budget.target={target:g} is not a density in (0, 1] (the kept fraction of block "
            "pairs); e.g. budget=d50 or budget.target=0.5"
        )
    knob = cfg.budget.knob
    if knob is not None and not math.isfinite(knob):
        raise UserError(f"budget.knob={knob} must be a finite number")


def _check_num_samples(cfg: DictConfig, bench) -> None:
    n = cfg.benchmark.num_samples
    reads_rows = hasattr(bench, "load_rows")  # data-set benchmarks: 0 means every row
    if n < 0 or (n == 0 and not reads_rows):
        least = "0 (every row)" if reads_rows else "1"
        raise UserError(
            f"benchmark.num_samples={n}: {cfg.benchmark.name} needs at least {least}; "
            f"e.g. benchmark.num_samples=5"
        )
    _check_max_samples(cfg, bench)


def _check_max_samples(cfg: DictConfig, bench) -> None:
    most = getattr(bench, "MAX_SAMPLES", None)
    n = cfg.benchmark.num_samples
    if most is not None and n > most:
        raise UserError(
            f"benchmark.num_samples={n}: {cfg.benchmark.name} generates at most {most:,} prompts "
            f"per task and length (all of a cell's prompts are built before it runs); e.g. "
            f"benchmark.num_samples=500"
        )


def _check_max_new_tokens(cfg: DictConfig) -> None:
    n = cfg.benchmark.max_new_tokens
    if n is not None and n < 1:
        raise UserError(
            f"benchmark.max_new_tokens={n} must be at least 1 (a prediction needs a token), or "
            "null for each task's official budget"
        )


def _check_num_prompts(cfg: DictConfig) -> None:
    n = cfg.calibration.num_prompts
    if n < 1:
        raise UserError(
            f"calibration.num_prompts={n}: calibration measures density on at least one prompt; "
            "e.g. calibration.num_prompts=1"
        )


def _check_model_files(cfg: DictConfig) -> None:
    """The model's identity (models.identity): the weights' digest of a local model reads its
    files' sizes and headers, so a truncated weight file or tokenizer fails here, naming it."""
    try:
        models.identity(cfg.model)
        problem = models.pickle_problem(cfg.model)
    except ValueError as e:
        raise UserError(str(e)) from None
    if problem is not None:
        raise UserError(problem)


def _check_block_size(cfg: DictConfig) -> None:
    size = OmegaConf.select(cfg, "method.block_size")
    if size is None:
        return
    lo, hi = BLOCK_SIZES
    if not (isinstance(size, int) and lo <= size <= hi and size & (size - 1) == 0):
        raise UserError(
            f"method.block_size={size} must be a power of two in [{lo}, {hi}] "
            f"(e.g. 64, 128, 256); other sizes fall off the kernels' fast paths"
        )


def _check_lengths(cfg: DictConfig, block_size: int) -> None:
    for n in cfg.benchmark.context_lengths:
        if n < block_size:
            raise UserError(
                f"context length {n} is shorter than one block ({block_size} tokens, "
                f"method {cfg.method.name}); raise benchmark.context_lengths"
            )


def check_writable(path: Path, key: str) -> None:
    """UserError unless `path` (a file, maybe not there yet) could be created or appended to:
    inside its results folder (`paths.check_inside`: no symbolic link out of it on the way, the
    file itself no link), a regular file if it exists, and a path short enough for the file
    system (with room for a temp file's name beside it).

    Nothing is created: the nearest existing ancestor must be a writable directory."""
    path = paths.check_inside(path)
    full = os.fsencode(os.path.abspath(path))
    if len(full) + 32 > _path_max():
        raise UserError(
            f"{path} is {len(full)} bytes long, too long a path for the file system; set "
            f"{key}= to a shorter folder or use shorter names"
        )
    if os.path.lexists(path):
        problem = paths.not_regular(path, os.lstat(path).st_mode)
        if problem is not None:
            raise problem
        if not os.access(path, os.W_OK):
            raise UserError(f"{path} is not writable; fix its permissions or set {key}=...")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        what = "not a directory" if not parent.is_dir() else "not writable"
        raise UserError(
            f"cannot write {path}: {parent} is {what}; set {key}= to a writable directory"
        )


def _path_max() -> int:
    try:
        return os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        return 4096


def preflight(argv: list[str], calibrating: bool = False) -> None:
    """Exit with one line if plain command-line overrides do not compose, or if any cell of the
    experiment's grid cannot run (check_cell), before Hydra runs and before a model loads."""
    if not any(a.startswith("-") for a in argv):
        config.COMMAND_OVERRIDES = list(argv)
        problem = check_overrides(argv, calibrating=calibrating)
        if problem:
            print(f"rbs-bench: error: {problem}", file=sys.stderr)
            sys.exit(2)


def check_overrides(overrides: list[str], calibrating: bool = False) -> str | None:
    """Compose the config for these overrides and check every cell of its grid; None if fine,
    else the one-line error."""
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            validate(cfg)
            analysis = cfg.get("observations") is not None or cfg.get("timing") is not None
            experiment = cfg.hydra.runtime.choices.get("experiment") or "adhoc"
            # each cell is checked as it is composed, so a bad value fails at the first cell
            grids = reference_cells(cfg, overrides) + sweep_cells(
                cfg.hydra.sweeper.get("params"), overrides
            )
            for grid in grids:
                cell = compose(config_name="config", overrides=list(overrides) + grid)
                validate(cell)
                check_run_settings(cell)
                if not analysis:  # analyses are not grids of cells: they check their own input
                    check_cell(cell, experiment, calibrating=calibrating)
    except Exception as exc:  # any composition failure is the user's input
        return str(exc) if isinstance(exc, UserError) else explain(exc)
    return None
