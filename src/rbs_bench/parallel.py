"""Experiments' cells as concurrent processes on one machine, resumably, within a time budget.

    python -m rbs_bench.parallel ruler_budget=200 ruler_main=100 [...] --jobs 8 \
        --time-budget-s 480 [--results results] [-- overrides for every cell]

Each `EXPERIMENT=N` runs every cell of the experiment's grid (its `reference` cells, e.g.
ruler_budget's dense, and its sweep) with `benchmark.num_samples=N` (`EXPERIMENT` alone: the
experiment's own n). Up to `--jobs` cells run at once, each as its own `python -m rbs_bench` process
with that cell's overrides; a small model leaves a GPU mostly idle, so several processes share it.
Where the OS can fork, this process first imports what every cell imports (torch, transformers,
the harness: seconds per process) and forks each cell from itself, which then starts at its
configuration; CUDA is never initialised here, so each cell initialises its own. Set
RBS_BENCH_PARALLEL_FORK=0 to start each cell as a new Python instead.
The cells with the most samples still to run start first. Each cell holds its own lock and skips
the samples its records already hold (rbs_bench.runner), so a call resumes the last one, and a
call that reaches `--time-budget-s` stops starting cells and gives the running ones the time left
(`time_budget_s`, checked before each sample); the next call continues. On a machine of several
GPUs each cell runs on one of them (CUDA_VISIBLE_DEVICES, the GPU with the fewest running cells;
an existing CUDA_VISIBLE_DEVICES limits the choice to its entries). Run records go to
`<results>/runs/<experiment>/<model>/...` as for any run; each process's output goes to
`outputs/parallel/<experiment>/<cell>.log`. Each process gets an equal share of the CPU's cores as
its thread count (OMP_NUM_THREADS, unless set).

`--replace-other-device` first removes a cell's records made on another kind of device (a cell of
CPU records continued on a GPU would mix two code paths of the selectors and kernels); git keeps
the removed ones. Every cell checks its settings against its records before it runs, as a single
run does; a cell that fails is reported with the last line of its log, and the others go on.

`--jobs` (at least 1), each N (a whole number, at least 1), `--time-budget-s` (finite, above 0)
and the common overrides' device and executor are checked before anything starts. SIGTERM (what
SLURM and `timeout` send) or SIGINT to this process is forwarded to every running cell, which
stops after recording or discarding its sample in flight; this process waits for all of them
(at most STOP_WAIT_S, then kills what is left), so none outlives it and no cell's lock stays
held, and exits with one line and status 143 / 130. Exit status 1: a cell failed; 2: bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rbs_bench.checks import check_run_settings
from rbs_bench.config import UserError, compose_cell, reference_cells
from rbs_bench.errors import deferred, one_line, stop_on_signals, stopping
from rbs_bench.kernels.triton_util import AUTOTUNE_CACHE_ENV
from rbs_bench.paths import read_file
from rbs_bench.records import read_cell
from rbs_bench.slurm import _parse, grid

LOG_DIR = Path("outputs/parallel")
MARGIN_S = 30  # a cell started with less time than this left would only load the model
STOP_WAIT_S = 60  # how long a stop waits for the cells to end before it kills them
POLL_S = 0.2  # how often ended cells are looked for: a whole second was a second of every run
FORK_ENV = "RBS_BENCH_PARALLEL_FORK"
LOG_NAME_BYTES = 120  # a longer log name is cut and given a digest of the whole


@dataclass
class Cell:
    experiment: str
    overrides: list[str]  # the full `python -m rbs_bench` arguments
    records: Path  # its records file
    samples: int  # samples the cell has when complete
    done: int = 0

    @property
    def name(self) -> str:
        keep = [o for o in self.overrides if o.split("=")[0] in CELL_KEYS]
        name = "_".join(o.split("=", 1)[1] for o in keep).replace("/", "-") or "cell"
        if len(name.encode()) <= LOG_NAME_BYTES:
            return name
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        return f"{name.encode()[: LOG_NAME_BYTES - 11].decode(errors='ignore')}_{digest}"


CELL_KEYS = ("method", "budget", "budget.target", "method.block_size", "rbs_thresholds")


def _count(cfg) -> int:
    """Samples a complete cell holds: tasks x lengths x num_samples (0: the data's rows)."""
    from rbs_bench import benchmarks

    n = cfg.benchmark.num_samples
    if n <= 0:
        return -1  # every row of the data: known once the cell has run
    tasks = cfg.benchmark.tasks
    if cfg.benchmark.name == "infinitebench" and not tasks:
        tasks = list(benchmarks.get("infinitebench").TASKS)
    return len(tasks) * len(cfg.benchmark.context_lengths) * n


def cells(spec: str, common: list[str]) -> list[Cell]:
    """The cells of `EXPERIMENT[=N]` with the common overrides."""
    from rbs_bench.session import cell_dir

    experiment, _, n = spec.partition("=")
    base = [f"+experiment={experiment}", *common]
    if n:
        base.append(f"benchmark.num_samples={_count_arg(spec, experiment, n)}")
    sweep, hydra_ovs = grid(base)  # a comma-separated value in `common` is an axis of the grid
    fixed = [o.input_line for o in _parse(base) if not o.is_sweep_override()]
    fixed = [o for o in fixed if not o.startswith("hydra.")]
    cfg = compose_cell(fixed)
    out = []
    for extra in reference_cells(cfg, base) + sweep:
        ovs = fixed + [o for o in extra if o not in fixed] + hydra_ovs
        cell_cfg = compose_cell([o for o in ovs if not o.startswith("hydra.")])
        check_run_settings(cell_cfg)  # device, executor: before any cell starts
        records = cell_dir(cell_cfg, experiment) / "records.jsonl"
        out.append(Cell(experiment, ovs, records, _count(cell_cfg)))
    return out


def _count_arg(spec: str, experiment: str, n: str) -> int:
    if not (n.isascii() and n.isdigit() and int(n) >= 1):
        raise UserError(
            f"{spec}: N is the samples per task and length, a whole number of at least 1 (e.g. "
            f"{experiment}=100); or give {experiment} alone for the experiment's own"
        )
    return int(n)


def _records(path: Path) -> list[dict]:
    """The cell's records, for counting progress and reading their device, as every reader
    reads them (records.read_cell: a repeated line counts once). A file that read refuses counts
    as no progress: the cell's own run names the problem in one line and fails."""
    try:
        return read_cell(path)
    except UserError:
        return []


def _device_kind(name: str) -> str:
    return "cuda" if str(name).startswith("cuda") else str(name)


def _lines(path: Path) -> list[dict]:
    """Every JSON object line of a records file, unchecked: what `replace_other_device` removes
    is judged by the devices its lines name, whatever else is wrong with them."""
    try:
        text = read_file(path).decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line: the runner drops it too
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def replace_other_device(cell: Cell, device: str) -> int:
    """Remove the cell's records (and cell.json) when any was made on another kind of device;
    returns how many were removed."""
    recs = _lines(cell.records)
    kind = _device_kind(device)
    if not recs or all(_device_kind(r.get("device", "")) == kind for r in recs):
        return 0
    cell.records.unlink()
    (cell.records.parent / "cell.json").unlink(missing_ok=True)
    return len(recs)


def _complete(cell: Cell, done: int) -> bool:
    """All samples recorded (a cell of every data row: any record, since a run records them
    all unless stopped; a rerun completes a stopped one)."""
    return done >= cell.samples if cell.samples >= 0 else done > 0


def _resolve_device(device: str) -> str:
    # NVML's device count, not the CUDA driver's: a process that initialised the driver cannot
    # fork a cell that uses CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def visible_gpus(device: str) -> list[str]:
    """The GPUs cells are spread over: CUDA_VISIBLE_DEVICES's entries where it is set, else the
    indices NVML counts (`_resolve_device` makes the count NVML's, so CUDA stays uninitialised
    here); none off CUDA or with one GPU (a cell then sees what this process sees)."""
    if not device.startswith("cuda") or ":" in device:
        return []
    import torch

    count = torch.cuda.device_count()
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in given.split(",") if g.strip()] if given is not None else None
    ids = (ids if ids is not None else [str(i) for i in range(count)])[:count]
    return ids if len(ids) > 1 else []


def _pick_gpu(gpus: list[str], running: list) -> str | None:
    """The GPU with the fewest running cells (the first of them on a tie)."""
    if not gpus:
        return None
    load = {g: 0 for g in gpus}
    for item in running:
        if item[4] in load:
            load[item[4]] += 1
    return min(gpus, key=lambda g: load[g])


class Forked:
    """A cell run by a child forked from this process (its imports already done), with the part
    of `subprocess.Popen`'s interface that this module uses."""

    def __init__(self, args: list[str], log, env: dict):
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the cell
            _run_forked(args, log.fileno(), env)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"cell {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_forked(args: list[str], log_fd: int, env: dict) -> None:
    """The forked cell: `python -m rbs_bench ARGS` with its output to the log; never returns."""
    code = 1
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.environ.update(env)
        import torch

        from rbs_bench import __main__ as entry
        from rbs_bench import config

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        config._STARTED = time.monotonic()  # the cell's time budget counts from here
        sys.argv = [entry.__file__, *args]
        entry.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _forkable() -> bool:
    """Fork the cells: the OS can, it is not turned off, and CUDA is not initialised here after
    importing what the cells import (`_preload`)."""
    if os.environ.get(FORK_ENV, "1").strip() == "0" or not hasattr(os, "fork"):
        return False
    _preload()
    import torch

    return not torch.cuda.is_initialized()


def _preload() -> None:
    """Import what every cell imports (the entry point, the runner with torch, transformers and
    the kernels, the report), once, before the first fork."""
    import rbs_bench.__main__  # noqa: F401
    import rbs_bench.report  # noqa: F401
    import rbs_bench.runner  # noqa: F401


def check_args(jobs: int, budget_s: float) -> None:
    """--jobs and --time-budget-s, before anything starts."""
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: run at least one cell at a time, e.g. --jobs 4")
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise UserError(
            f"--time-budget-s {budget_s:g} must be a finite number of seconds above 0 (no cell "
            "starts after it; rerunning continues), e.g. --time-budget-s 3600"
        )


def run(specs: list[str], jobs: int, budget_s: float, common: list[str], replace: bool) -> int:
    check_args(jobs, budget_s)
    start = time.monotonic()
    given = [o.split("=", 1)[1] for o in common if o.startswith("device=")]
    device = _resolve_device(given[-1] if given else "auto")
    common = [o for o in common if not o.startswith("device=")] + [f"device={device}"]
    todo = [c for spec in specs for c in cells(spec, common)]
    for c in todo:
        if replace:
            gone = replace_other_device(c, device)
            if gone:
                print(f"{c.records}: removed {gone} records made on another device", flush=True)
        c.done = len(_records(c.records))
    pending = [c for c in todo if not _complete(c, c.done)]
    pending.sort(key=lambda c: c.done - c.samples)  # the most samples to run first
    total = sum(max(c.samples - c.done, 0) for c in pending)
    gpus = visible_gpus(device) if pending else []
    spread = f" (spread over {len(gpus)} GPUs: {','.join(gpus)})" if gpus else ""
    print(
        f"{len(todo)} cells, {len(pending)} to run ({total} samples) with {jobs} processes on "
        f"{device}{spread}, {budget_s:g} s",
        flush=True,
    )
    env = cell_env(jobs)
    running: list[tuple[Cell, subprocess.Popen, object, Path, str | None]] = []
    composed = time.monotonic() - start
    fork = bool(pending) and _forkable()
    if fork:
        print(
            f"cells composed and their records read in {composed:.1f} s; the harness imported "
            f"for forking in {time.monotonic() - start - composed:.1f} s",
            flush=True,
        )
    try:
        failed = _run_cells(pending, running, jobs, budget_s, start, env, fork, gpus)
    except BaseException:  # SIGTERM / SIGINT (or a failure here): the cells end first
        _stop_cells(running, stopping() or signal.SIGTERM)
        raise
    left_cells = [c for c in todo if not _complete(c, len(_records(c.records)))]
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    done_s = time.monotonic() - start
    if left_cells:
        print(f"{done_s:.0f} s: {len(left_cells)} cells unfinished; rerun the same command")
    else:
        print(f"{done_s:.0f} s: every cell complete")
    return 1 if failed else 0


def cell_env(jobs: int) -> dict:
    """The cells' environment: this one's, over two defaults. The processes share the machine's
    cores, so each gets its share of threads; an autotuned kernel keeps its choices on disk, so a
    cell reads what an earlier one timed (kernels.triton_util.autotune) instead of timing the
    space under the other cells' load."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, AUTOTUNE_CACHE_ENV: "1"}
    return env | dict(os.environ)


def _stop_cells(running: list, signum: int) -> None:
    """Forward the stop to every running cell and wait for each (kill what is left after
    STOP_WAIT_S), so no cell outlives this process or keeps its lock."""
    for _, proc, _, _, _ in running:
        if proc.poll() is None:
            proc.send_signal(signum)
    deadline = time.monotonic() + STOP_WAIT_S
    for _, proc, log, _, _ in running:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _run_cells(pending, running, jobs, budget_s, start, env, fork=False, gpus=()) -> list[str]:
    """Start pending cells (`fork`: as children of this process, `Forked`; each on the least
    loaded of `gpus` where given) while there are free jobs and time, until every cell has ended;
    the failed cells' lines."""
    failed = []
    while pending or running:
        left = budget_s - (time.monotonic() - start)
        while pending and len(running) < jobs and left > MARGIN_S:
            c = pending.pop(0)
            log_path = LOG_DIR / c.experiment / f"{c.name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "a")
            args = [*c.overrides, "progress=false", f"time_budget_s={int(left)}"]
            gpu = _pick_gpu(list(gpus), running)
            child_env = env if gpu is None else env | {"CUDA_VISIBLE_DEVICES": gpu}
            with deferred():  # a stop waits until the new cell is on the list it stops
                if fork:
                    proc = Forked(args, log, child_env)
                else:
                    args = [sys.executable, "-m", "rbs_bench", *args]
                    proc = subprocess.Popen(
                        args, stdout=log, stderr=subprocess.STDOUT, env=child_env
                    )
                running.append((c, proc, log, log_path, gpu))
            on = f" on GPU {gpu}" if gpu is not None else ""
            print(f"start {c.experiment}/{c.name} ({c.done}/{c.samples} done){on}", flush=True)
        time.sleep(POLL_S)
        for item in list(running):
            c, proc, log, log_path, _ = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            now = len(_records(c.records))
            print(f"end   {c.experiment}/{c.name}: {now}/{c.samples} samples", flush=True)
            if proc.returncode != 0:
                lines = log_path.read_text().splitlines()
                last = lines[-1] if lines else f"exit status {proc.returncode}"
                failed.append(f"{c.experiment}/{c.name}: {last}")
        if not running and pending and budget_s - (time.monotonic() - start) <= MARGIN_S:
            break
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        prog="python -m rbs_bench.parallel", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "experiments", nargs="+", help="EXPERIMENT or EXPERIMENT=N (samples per task and length)"
    )
    ap.add_argument("--jobs", type=int, default=8, help="cells at once (default 8)")
    ap.add_argument(
        "--time-budget-s", type=float, default=480.0, help="start no cell after this (480)"
    )
    ap.add_argument("--results", default="results", help="results dir (default results)")
    ap.add_argument(
        "--replace-other-device",
        action="store_true",
        help="first remove a cell's records made on another kind of device",
    )
    ns = ap.parse_args(argv)
    stop_on_signals()  # forwarded to the cells (`_stop_cells`); one line, 143 / 130
    common = [f"results_dir={ns.results}", *common]
    return one_line(
        lambda: run(ns.experiments, ns.jobs, ns.time_budget_s, common, ns.replace_other_device)
    )


if __name__ == "__main__":
    sys.exit(main())
