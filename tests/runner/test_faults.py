"""Faults and bad input: each gives one clear line, loses nothing and writes nothing outside its
directory. One row per failure the reliability sweeps found (the embedded model, niah_single_1).

Every row runs the real entry point in this process (`python -m rbs_bench`,
`python -m rbs_bench.calibrate`, `.report`, `.figures`, `.tables`, `.parallel`,
`.tinylm.train`: their `main()` with sys.argv set), or, for the rows below the command line (a
selector's input, a calibration write, the model cache), the function itself; the rows about a
signal to `parallel` or to a benchmark command start real processes and signal them. A row whose
fault must be caught before anything runs replaces the Hydra job with a failure, so passing the
checks fails the row at once instead of running the cell. The rows that need a cell already
recorded share one real run of the dense cell (`recorded`); the rows about duplicated and moved
records use copies of the committed ruler_budget cells and compare with their committed summary.
A row whose fault is a hang runs under a deadline, and a row that signals this process does so
only once the command has installed its handler (the default one would end the test session)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from rbs_bench import __main__ as run_main
from rbs_bench import calibrate, calibrations, config, figures, methods, parallel, report, runner
from rbs_bench.records import seal
from rbs_bench.tables import build as tables_build
from rbs_bench.tinylm import train

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "src" / "rbs_bench" / "tinylm" / "weights"
PREFIX = "rbs-bench: error: "
WARNING = "rbs-bench: warning: "
STOPPED = "rbs-bench: stopped"
VALUES = ROOT / "results" / "paper" / "paper_values.csv"
EXPERIMENT = "ruler_budget"
GRID = f"+experiment={EXPERIMENT}"
# one cell of the embedded model, small enough for a few seconds a run
SMALL = [
    GRID,
    "benchmark.tasks=[niah_single_1]",
    "benchmark.context_lengths=[1024]",
    "benchmark.num_samples=1",
    "benchmark.max_new_tokens=2",
    "recall=false",
    "progress=false",
]
DENSE = [*SMALL, "method=dense", "budget=default"]
CELL = Path("runs", EXPERIMENT, "tiny", "dense", "default")
RBS_D50 = [GRID, "method=rbs", "budget=d50"]  # reads the committed calibration of rbs at 50%
COMMITTED = ROOT / "results" / CELL.parent.parent  # the committed ruler_budget cells of tiny

config.register_schemas()


@dataclass
class Outcome:
    status: int | str  # exit status, or "raised" when an exception escaped the entry point
    out: str
    err: str

    def errors(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith(PREFIX)]

    def warnings(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith(WARNING)]


# The capsys and monkeypatch of the running test (test_fault sets them): each call reads what it
# printed; a row's plugins and environment are undone after it.
_CAPSYS = None
_MP = None


def _cli(entry: str, argv: list[str], *, run: bool = True) -> Outcome:
    """Run an entry point's main() as `python -m <entry> <argv>`; `run=False` fails the row if
    the command gets past its up-front checks (the Hydra job would start)."""
    from hydra.core.hydra_config import HydraConfig

    main = {
        "rbs_bench": run_main.main,
        "rbs_bench.calibrate": calibrate.main,
        "rbs_bench.report": lambda: sys.exit(report.main(argv)),
        "rbs_bench.figures": lambda: sys.exit(figures.main(argv)),
        "rbs_bench.tables": lambda: sys.exit(tables_build.main(argv)),
        "rbs_bench.parallel": lambda: sys.exit(parallel.main(argv)),
        "rbs_bench.tinylm.train": lambda: train.main(argv),
    }[entry]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if _CAPSYS is not None:
        _CAPSYS.readouterr()  # what came before this command is not its output
    mp = pytest.MonkeyPatch()
    raised = ""
    try:
        mp.setattr(sys, "argv", [entry, *argv])
        mp.setattr(config, "COMMAND_OVERRIDES", None)
        if not run:
            mp.setattr(run_main, "_hydra_main", lambda: pytest.fail("passed the checks"))
            mp.setattr(calibrate, "_hydra_main", lambda: pytest.fail("passed the checks"))
        try:
            main()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - what the row must not give
            status, raised = "raised", f"Traceback: {type(e).__name__}: {e}\n"
    finally:
        for sig, handler in handlers.items():  # the command's handlers end with it
            signal.signal(sig, handler)
        mp.undo()
        HydraConfig.instance().cfg = None  # a finished job's overrides are not the next one's
    out, err = _CAPSYS.readouterr() if _CAPSYS is not None else ("", "")
    return Outcome(status, out, err + raised)


def _one_line(got: Outcome, *fragments: str) -> str:
    """The row gave exit status 2 and exactly one error line, holding every fragment."""
    assert "Traceback" not in got.err, got.err[-2000:]
    assert got.status == 2, (got.status, got.err[-2000:])
    lines = got.errors()
    assert len(lines) == 1, got.err[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() if p.is_file() else b""
        for p in sorted(path.rglob("*"))
        if "cwd" not in p.relative_to(path).parts[:1]
    }


def _records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "a torn last line"
    return [json.loads(line) for line in data.splitlines()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A results dir whose dense cell holds one record, made by a real run."""
    root = tmp_path_factory.mktemp("recorded")
    (root / "cwd").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root / "cwd")
        got = _cli("rbs_bench", [*DENSE, f"results_dir={root}"])
    assert got.status == 0, got.err[-3000:]
    assert len(_records(root / CELL / "records.jsonl")) == 1
    return root


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Path:
    """An empty results dir two levels below tmp_path (so `..` names land inside tmp_path),
    Hydra's own outputs kept in tmp_path/cwd."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "sub" / "R"


def _copy_recorded(recorded: Path, results: Path) -> Path:
    shutil.copytree(recorded / "runs", results / "runs")
    return results


def _copy_calibrations(results: Path) -> Path:
    shutil.copytree(ROOT / "results" / "calibration" / "tiny", results / "calibration" / "tiny")
    return results / "calibration" / "tiny" / "rbs.yaml"


def _edit_entry(path: Path, results: Path, **fields) -> None:
    """Change fields of the entry that `RBS_D50` reads (rbs at 50% in ruler_budget's setting)."""
    from rbs_bench.session import build_selector

    cfg = _compose(results, RBS_D50)
    want = calibrations.setting(cfg, build_selector(cfg, apply_budget=False))
    data = yaml.safe_load(path.read_text())
    (entry,) = [e for e in data["entries"] if e["target"] == 0.5 and e.get("setting") == want]
    entry.update(fields)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _d50_base(cfg):
    from rbs_bench.session import build_selector

    return build_selector(cfg, apply_budget=False)


def _d50_entry(cfg, **fields) -> dict:
    """A calibration entry of RBS at d50 for `cfg`'s setting, measured exactly unless `fields`
    say otherwise."""
    entry = {
        "target": 0.5,
        "knob": 2.0,
        "knob_name": "alpha_scale",
        "density_mean": 0.5,
        "abs_error": 0.0,
        "prompts": 1,
        "setting": calibrations.setting(cfg, _d50_base(cfg)),
    }
    return entry | fields


def _compose(results: Path, overrides: list[str]):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, f"results_dir={results}"])


def _weights_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "weights"
    shutil.copytree(WEIGHTS, copy)
    return copy


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


# ------------------------------------------------------------------------------------------------
# The rows. Each takes (tmp_path, results, recorded) and asserts what the row must give.


def row_budget_name_escapes(tmp_path, results, recorded):
    before = _tree(tmp_path)
    got = _cli(
        "rbs_bench",
        [*DENSE, f"results_dir={results}", "budget.name=../../../../../../escaped"],
        run=False,
    )
    _one_line(got, "budget.name='../../../../../../escaped'", "path separator")
    assert _tree(tmp_path) == before  # nothing written, inside results_dir or outside it


def row_budget_name_empty(tmp_path, results, recorded):
    before = _tree(tmp_path)
    got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", "budget.name=''"], run=False)
    _one_line(got, "budget.name='' is empty")
    assert _tree(tmp_path) == before


def row_calibration_entry_with_a_wrong_knob(tmp_path, results, recorded):
    path = _copy_calibrations(results)
    d25 = next(e for e in yaml.safe_load(path.read_text())["entries"] if e["target"] == 0.25)
    _edit_entry(path, results, knob=d25["knob"])  # d25's knob beside d50's density
    got = _cli("rbs_bench", [*RBS_D50, f"results_dir={results}"], run=False)
    _one_line(
        got,
        f"{path}: the calibration of rbs at density 0.5",
        "does not match its digest",
        "recalibrate it with: python -m rbs_bench.calibrate",
    )


def row_calibration_entry_of_another_model_config(tmp_path, results, recorded):
    _copy_calibrations(results)
    got = _cli("rbs_bench", [*RBS_D50, f"results_dir={results}", "model.dtype=bfloat16"], run=False)
    _one_line(
        got, "was measured with model.dtype='float32'", "recalibrate it with: python -m rbs_bench"
    )


def row_entry_tolerance_overrides_the_runs(tmp_path, results, recorded):
    cfg = _compose(results, RBS_D50)
    # met its own tolerance, 50x the run's
    entry = _d50_entry(cfg, density_mean=0.495, abs_error=0.005, tolerance=0.01)
    calibrations.store(cfg, entry)
    got = _cli("rbs_bench", [*RBS_D50, f"results_dir={results}"], run=False)
    _one_line(got, "records density 0.4950", "(tolerance 0.0001", "recalibrate it with")


def row_explicit_field_equal_to_the_default(tmp_path, results, recorded):
    _copy_calibrations(results)
    got = _cli(
        "rbs_bench", [*RBS_D50, f"results_dir={results}", "method.alpha_base=0.22"], run=False
    )
    _one_line(got, "method.alpha_base=0.22 would be replaced by budget 'd50'")


def row_local_weights_changed_under_one_path(tmp_path, results, recorded):
    copy = _weights_copy(tmp_path)
    argv = [*DENSE, f"results_dir={results}", f"model.hf_id={copy}"]
    first = _cli("rbs_bench", argv)
    assert first.status == 0, first.err[-3000:]
    # other weights written to the same path: one tensor changed, same names, shapes and size
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    later = time.time() + 10
    os.utime(copy / "model.safetensors", (later, later))
    got = _cli("rbs_bench", [*argv, "benchmark.num_samples=2"])
    _one_line(got, "model.weights=", "made by other code or weights")
    assert len(_records(results / CELL / "records.jsonl")) == 1  # nothing mixed in


class _FullDisk:
    """A records file on a full disk: the write gets half the line through, then ENOSPC."""

    def __init__(self, real):
        self.real = real

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()
        return False

    def write(self, text):
        self.real.write(text[: len(text) // 2])
        self.real.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.real, name)


def row_disk_full_mid_run(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    path = results / CELL / "records.jsonl"
    first = path.read_bytes()
    real_open = open

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FullDisk(f) if str(file).endswith("records.jsonl") and "a" in mode else f

    argv = [*DENSE, f"results_dir={results}", "benchmark.num_samples=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("builtins.open", full_open)
        got = _cli("rbs_bench", argv)
    _one_line(got, "No space left on device", str(path), "rerun the same command")
    assert path.read_bytes() == first  # the half line was cut back off; the first record kept
    again = _cli("rbs_bench", argv)
    assert again.status == 0, again.err[-3000:]
    recs = _records(path)
    assert sorted(r["index"] for r in recs) == [0, 1] and path.read_bytes().startswith(first)


def row_time_budget_spent_before_the_first_record(tmp_path, results, recorded):
    # the process started long before: a millisecond is spent before the first cell
    got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", "time_budget_s=0.001"])
    assert "Traceback" not in got.err and got.status == 0, (got.status, got.err[-3000:])
    lines = [ln for ln in got.out.splitlines() if "time_budget_s" in ln]
    assert len(lines) == 1 and "rerun the same command" in lines[0], got.out
    assert not (results / "runs").exists()


def _cell_json_holding(content: bytes):
    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        cached = results / CELL / "cell.json"
        cached.write_bytes(content)
        argv = [*DENSE, f"results_dir={results}"]
        got = _cli("rbs_bench", argv)
        _one_line(got, str(cached), "delete it")
        assert len(_records(results / CELL / "records.jsonl")) == 1
        cached.unlink()  # the fix the line gives: the cell is not blocked for good
        again = _cli("rbs_bench", argv)
        assert again.status == 0, again.err[-3000:]
        assert isinstance(json.loads(cached.read_text()), dict)

    return row


def row_truncated_safetensors(tmp_path, results, recorded):
    copy = _weights_copy(tmp_path)
    _truncate(copy / "model.safetensors")
    got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", f"model.hf_id={copy}"], run=False)
    _one_line(got, str(copy / "model.safetensors"), "truncated")


def row_truncated_tokenizer(tmp_path, results, recorded):
    copy = _weights_copy(tmp_path)
    _truncate(copy / "tokenizer.json")
    got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", f"model.hf_id={copy}"], run=False)
    _one_line(got, str(copy / "tokenizer.json"))


def row_binary_calibration_file(tmp_path, results, recorded):
    path = _copy_calibrations(results)
    path.write_bytes(bytes(range(256)) * 4)
    got = _cli("rbs_bench", [*RBS_D50, f"results_dir={results}"], run=False)
    _one_line(got, str(path), "not UTF-8")


def _calibration_schema(field: str, value, says: str):
    def row(tmp_path, results, recorded):
        path = _copy_calibrations(results)
        if value is not None:
            _edit_entry(path, results, **{field: value})
        else:
            data = yaml.safe_load(path.read_text())
            for e in data["entries"]:
                e.pop(field)
            path.write_text(yaml.safe_dump(data, sort_keys=False))
        got = _cli("rbs_bench.calibrate", [*RBS_D50, f"results_dir={results}"], run=False)
        _one_line(got, str(path), says)

    return row


def _not_a_record(entry: str):
    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        path = results / CELL / "records.jsonl"
        with open(path, "a") as f:
            f.write('{"x": 1}\n')
        argv = (
            [str(path.parents[2])] if entry == "rbs_bench.report" else ["--results", str(results)]
        )
        got = _cli(entry, argv)
        _one_line(got, f"{path}:2 is JSON but not a run record")

    return row


def row_negative_max_new_tokens(tmp_path, results, recorded):
    argv = [*DENSE, f"results_dir={results}", "benchmark.max_new_tokens=-3"]
    _one_line(_cli("rbs_bench", argv, run=False), "benchmark.max_new_tokens=-3")


def row_huge_num_samples(tmp_path, results, recorded):
    t0 = time.perf_counter()
    argv = [*DENSE, f"results_dir={results}", "benchmark.num_samples=99999999999999999999"]
    _one_line(_cli("rbs_bench", argv, run=False), "benchmark.num_samples=99999999999999999999")
    assert time.perf_counter() - t0 < 60  # refused before any prompt is generated


def row_zero_calibration_prompts(tmp_path, results, recorded):
    argv = [*RBS_D50, f"results_dir={results}", "calibration.num_prompts=0"]
    _one_line(_cli("rbs_bench.calibrate", argv, run=False), "calibration.num_prompts=0")


def row_calibration_write_keeps_the_mode(tmp_path, results, recorded):
    cfg = _compose(results, RBS_D50)
    entry = _d50_entry(cfg)
    old = os.umask(0o022)
    try:
        path = calibrations.store(cfg, entry)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # a new file: the umask's mode
        path.chmod(0o664)  # a results dir shared with a group
        calibrations.store(cfg, entry | {"target": 0.25, "density_mean": 0.25})
        assert stat.S_IMODE(path.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def row_overflowing_scores(tmp_path, results, recorded):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 512, 64, generator=gen), torch.randn(1, 2, 512, 64, generator=gen)
    accepted = []
    for name in methods.available():
        try:
            methods.build(name).select(q * 1e30, k * 1e30)  # finite; q.k overflows float32
            accepted.append(name)
        except ValueError as e:
            assert "too large for float32 scores" in str(e), (name, str(e))
    assert accepted == []


def _edited_record(field: str, value):
    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        path = results / CELL / "records.jsonl"
        (rec,) = _records(path)
        rec[field] = value
        path.write_text(json.dumps(rec, sort_keys=True) + "\n")
        got = _cli("rbs_bench.report", [str(path.parents[2])])
        _one_line(got, f"{path}:1 was changed after it was recorded")

    return row


ROWS: dict[str, Callable] = {
    "budget.name=../../../../../../escaped": row_budget_name_escapes,
    "budget.name=''": row_budget_name_empty,
    "a calibration entry with a wrong knob beside a right density": (
        row_calibration_entry_with_a_wrong_knob
    ),
    "a calibration entry of another model config": row_calibration_entry_of_another_model_config,
    "an entry's own tolerance": row_entry_tolerance_overrides_the_runs,
    "method.alpha_base=0.22 (the default) with budget=d50": row_explicit_field_equal_to_the_default,
    "local weights changed under one model.hf_id path": row_local_weights_changed_under_one_path,
    "disk full mid-run": row_disk_full_mid_run,
    "time_budget_s spent before the first record": row_time_budget_spent_before_the_first_record,
    "cell.json holding []": _cell_json_holding(b"[]\n"),
    "cell.json holding null": _cell_json_holding(b"null\n"),
    "cell.json holding non-UTF-8 bytes": _cell_json_holding(b"\xff\xfe{\x00\n"),
    "truncated model.safetensors": row_truncated_safetensors,
    "truncated tokenizer.json": row_truncated_tokenizer,
    "a binary calibration file": row_binary_calibration_file,
    "a calibration entry with no abs_error": _calibration_schema("abs_error", None, "abs_error"),
    "a calibration entry with knob 'abc'": _calibration_schema("knob", "abc", "'abc'"),
    "a non-record line, report": _not_a_record("rbs_bench.report"),
    "a non-record line, figures": _not_a_record("rbs_bench.figures"),
    "benchmark.max_new_tokens=-3": row_negative_max_new_tokens,
    "benchmark.num_samples=99999999999999999999": row_huge_num_samples,
    "calibration.num_prompts=0": row_zero_calibration_prompts,
    "a calibration write keeps the file's mode": row_calibration_write_keeps_the_mode,
    "q, k scaled by 1e30": row_overflowing_scores,
    "a record with an edited score": _edited_record("score", 100.0),
    "a record with an edited density": _edited_record("density", 0.01),
}


# ------------------------------------------------------------------------------------------------
# The second sweep: records bound to their cell, writes through links, pickles, plugins, signals,
# validation before the model loads.


def _stopped(got: Outcome, name: str) -> str:
    """The command ended on signal `name` with one line and exit status 128 + its number."""
    assert "Traceback" not in got.err, got.err[-2000:]
    assert got.status == 128 + getattr(signal, name), (got.status, got.err[-2000:])
    lines = [ln for ln in got.err.splitlines() if ln.startswith(STOPPED)]
    assert len(lines) == 1 and name in lines[0], got.err[-2000:]
    assert got.errors() == [], got.err[-2000:]
    return lines[0]


def _signal_self(name: str) -> None:
    """Send signal `name` to this process, as Ctrl-C or a scheduler would, once the command has
    installed its own handler; the default one would end the test session."""
    sig = getattr(signal, name)
    if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler, None):
        pytest.fail(f"the command has no handler for {name}")
    os.kill(os.getpid(), sig)


@contextlib.contextmanager
def _deadline(seconds: float):
    """A row whose fault is a hang: a TimeoutError after `seconds` instead of no end."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _lock_free(lock: Path) -> bool:
    """Whether another process can take the `flock` of `lock` at once (no one holds it)."""
    code = "import fcntl, sys; fcntl.flock(open(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    return subprocess.run([sys.executable, "-c", code, str(lock)]).returncode == 0


def _committed(results: Path, *cells: str) -> Path:
    """Copies of committed ruler_budget cells of the tiny model ("xattn/d25", ...)."""
    exp = results / CELL.parent.parent
    for cell in cells:
        shutil.copytree(COMMITTED / cell, exp / cell)
    return exp


def _summary_row(exp: Path, method: str, budget: str) -> tuple[int, float]:
    df = pd.read_csv(exp / "summary.csv")
    row = df[(df["method"] == method) & (df["budget"] == budget)].iloc[0]
    return int(row["n"]), round(float(row["score"]), 6)


def _tables(results: Path) -> Outcome:
    return _cli("rbs_bench.tables", ["--results", str(results), "--paper-values", str(VALUES)])


def row_duplicated_records(tmp_path, results, recorded):
    exp = _committed(results, "dense/default", "xattn/d25")
    assert _tables(results).status == 0
    table = (results / "tables" / "ruler_budget_tiny.md").read_text()
    path = exp / "xattn/d25/records.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + lines[:50]))  # 50 lines twice, each checksum valid
    got = _cli("rbs_bench.report", ["--results", str(results)])
    assert got.status == 0 and "Traceback" not in got.err, got.err[-2000:]
    assert _summary_row(exp, "xattn", "d25") == _summary_row(COMMITTED, "xattn", "d25")
    assert _tables(results).status == 0
    assert (results / "tables" / "ruler_budget_tiny.md").read_text() == table


def row_records_moved_between_cells(tmp_path, results, recorded):
    exp = _committed(results, "dense/default", "flexprefill/d30", "rbs/d30")
    src, dst = exp / "flexprefill/d30/records.jsonl", exp / "rbs/d30/records.jsonl"
    moved = src.read_bytes().splitlines(keepends=True)
    kept = dst.read_bytes().splitlines(keepends=True)
    src.write_bytes(b"".join(moved[20:]))
    dst.write_bytes(b"".join(kept + moved[:20]))
    for entry, argv in (
        ("rbs_bench.report", ["--results", str(results)]),
        ("rbs_bench.tables", ["--results", str(results), "--paper-values", str(VALUES)]),
        ("rbs_bench.figures", ["--results", str(results)]),
    ):
        _one_line(_cli(entry, argv), f"{dst}:{len(kept) + 1}", "ruler_budget/tiny/flexprefill/d30")


def row_moved_record_on_resume(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    other = results / CELL.parent.parent / "rbs" / "default"
    other.mkdir(parents=True)
    shutil.move(results / CELL / "records.jsonl", other / "records.jsonl")
    got = _cli("rbs_bench", [*SMALL, "method=rbs", "budget=default", f"results_dir={results}"])
    _one_line(got, f"{other / 'records.jsonl'}:1", "ruler_budget/tiny/dense/default")


def row_one_sample_recorded_twice_with_other_values(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    path = results / CELL / "records.jsonl"
    (rec,) = _records(path)
    other = seal(rec | {"score": 0.0 if rec["score"] else 100.0})  # a valid checksum of its own
    path.write_text(path.read_text() + json.dumps(other, sort_keys=True) + "\n")
    _one_line(_cli("rbs_bench.report", ["--results", str(results)]), f"{path}:2", "line 1")


def row_empty_records_file(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    empty = results / CELL.parent.parent / "rbs" / "default" / "records.jsonl"
    empty.parent.mkdir(parents=True)
    empty.write_bytes(b"")
    for entry, argv in (
        ("rbs_bench.report", ["--results", str(results)]),
        ("rbs_bench.tables", ["--results", str(results), "--paper-values", str(VALUES)]),
    ):
        got = _cli(entry, argv)
        assert got.status == 0 and "Traceback" not in got.err, got.err[-2000:]
        (line,) = got.warnings()
        assert str(empty) in line and "empty cell" in line, line
    assert str(empty) in (results / CELL.parent.parent / "summary.md").read_text()


def _not_a_file(make: Callable[[Path], None]):
    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        path = results / CELL / "records.jsonl"
        path.unlink()
        make(path)
        with _deadline(20):
            got = _cli("rbs_bench.report", ["--results", str(results)])
        _one_line(got, str(path), "not a regular file")

    return row


def row_cell_json_a_fifo(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    cached = results / CELL / "cell.json"
    cached.unlink()
    os.mkfifo(cached)
    with _deadline(20):
        got = _cli("rbs_bench", [*DENSE, f"results_dir={results}"], run=False)
    _one_line(got, str(cached), "not a regular file")


def row_calibration_file_a_fifo(tmp_path, results, recorded):
    path = _copy_calibrations(results)
    path.unlink()
    os.mkfifo(path)
    with _deadline(20):
        got = _cli("rbs_bench", [*RBS_D50, f"results_dir={results}"], run=False)
    _one_line(got, str(path), "not a regular file")


def row_paper_values_a_fifo(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    values = results / "paper" / "paper_values.csv"
    values.parent.mkdir()
    os.mkfifo(values)
    with _deadline(20):
        got = _cli("rbs_bench.tables", ["--results", str(results)])
    _one_line(got, str(values), "not a regular file")


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("not rbs-bench's\n")
    return out


def _linked_out(
    where: Callable[[Path], Path], argv: Callable[[Path], list[str]], entry="rbs_bench"
):
    """A folder or file inside results_dir that is a symbolic link to a place outside it: the
    command stops with one line naming the link, and nothing outside changes."""

    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        _copy_calibrations(results)
        outside = _outside(tmp_path)
        link = where(results)
        if link.exists():
            target = outside / link.name
            shutil.move(link, target)
        else:
            target = outside / link.name
            target.mkdir() if not link.suffix else target.write_text("")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        before = _tree(outside)
        got = _cli(entry, argv(results), run=entry == "rbs_bench.report")
        _one_line(got, str(link), "symbolic link")
        assert _tree(outside) == before

    return row


_SMALL_ADHOC = [o for o in DENSE if o != GRID]


def row_pickled_training_checkpoint(tmp_path, results, recorded):
    out, ran = tmp_path / "train", tmp_path / "code ran"
    out.mkdir()
    argv = ["--out", str(out), "--preset", "micro", "--stages", "256:2", "--device", "cpu"]
    argv += ["--workers", "0", "--no-progress"]
    settings = train.resolve(train.parse_args(argv)[0])
    (out / "run.json").write_text(json.dumps({"settings": dataclasses.asdict(settings)}))

    class Planted:
        def __reduce__(self):  # unpickling calls open(ran, "w"): code from the file runs
            return (open, (str(ran), "w"))

    torch.save({"model": Planted()}, out / "checkpoint.pt")
    got = _cli("rbs_bench.tinylm.train", argv)
    assert not ran.exists(), "the checkpoint's code ran"
    assert "Traceback" not in got.err and got.status == 2, (got.status, got.err[-2000:])
    (line,) = [ln for ln in got.err.splitlines() if "error:" in ln]
    assert str(out / "checkpoint.pt") in line, line


def row_pickled_model_weights(tmp_path, results, recorded):
    from safetensors.torch import load_file

    copy = _weights_copy(tmp_path)
    torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    argv = [*DENSE, f"results_dir={results}", f"model.path={copy}"]
    got = _cli("rbs_bench", argv, run=False)
    _one_line(got, str(copy), "pytorch_model.bin", "model.allow_pickle=true")
    from rbs_bench.checks import check_overrides

    assert check_overrides([*argv, "model.allow_pickle=true"]) is None  # the user opts in


def _plugin(tmp_path: Path, name: str, source: str) -> None:
    """A distribution whose `rbs_bench.methods` entry point `name` is the class `Plugin` of a
    module made from `source`, put on sys.path as if installed (undone after the row)."""
    module = f"rbs_fault_{name}_{uuid.uuid4().hex[:8]}"
    site = tmp_path / "site"
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[rbs_bench.methods]\n{name} = {module}:Plugin\n")
    _MP.syspath_prepend(str(site))
    methods.refresh()


def _plugin_import(name: str, body: str, entry: str):
    def row(tmp_path, results, recorded):
        _copy_recorded(recorded, results)
        _plugin(tmp_path, name, body)
        _MP.setenv("RBS_BENCH_PLUGIN_IMPORT_S", "2")
        argv = ["--help"] if entry == "rbs_bench" else ["--results", str(results)]
        t0 = time.monotonic()
        with _deadline(40):
            got = _cli(entry, argv)
        assert got.status == 0 and "Traceback" not in got.err, (got.status, got.err[-2000:])
        assert time.monotonic() - t0 < 30
        (line,) = got.warnings()
        assert f"skipped method plugin {name!r}" in line, line
        assert {"exit3": "SystemExit", "interrupt": "KeyboardInterrupt"}.get(
            name, "took longer than"
        ) in line, line

    return row


SELECTOR = """
import dataclasses

import torch

from rbs_bench.methods.info import MethodInfo
from rbs_bench.methods.selection import BlockSelection, num_blocks


@dataclasses.dataclass(frozen=True)
class Plugin:
    block_size: int = 128

    name = "{name}"
    knob = None
    knob_direction = 1
    is_dense = False
    info = MethodInfo(display="{name}")

    def fields(self):
        return dataclasses.asdict(self)

    def select(self, q, k, scale=None):
        b, h, n, _ = q.shape
        m = num_blocks(n, self.block_size)
        causal = torch.ones(m, m, dtype=torch.bool).tril().expand(b, h, m, m)
        sel = BlockSelection.from_mask(causal, self.block_size, self.block_size, n)
        if m <= 4:  # the registry's check selects on a short input: right there
            return sel
        count, idx = sel.kv_count.clone(), sel.kv_indices.clone()
        {bad}
        return dataclasses.replace(sel, kv_count=count, kv_indices=idx)
"""


def _bad_selection(name: str, bad: str, says: str):
    """A plugin selector that returns a bad selection on the run's prompts: the cell stops with
    one line naming the plugin and what it returned, and nothing is recorded."""

    def row(tmp_path, results, recorded):
        _plugin(tmp_path, name, SELECTOR.replace("{name}", name).replace("{bad}", bad))
        config.register_schemas()
        argv = [*SMALL, f"method={name}", "budget=default", f"results_dir={results}"]
        _one_line(_cli("rbs_bench", argv), f"method plugin {name!r}", says)
        cell = results / CELL.parent.parent / name / "default"
        assert not (cell / "records.jsonl").exists() or not (cell / "records.jsonl").read_bytes()

    return row


def row_sigint_during_a_run(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    path = results / CELL / "records.jsonl"
    first = path.read_bytes()
    real = runner._run_sample

    def stop_after(*args, **kwargs):
        rec = real(*args, **kwargs)
        _signal_self("SIGINT")  # Ctrl-C with the second sample computed, not yet recorded
        return rec

    argv = [*DENSE, f"results_dir={results}", "benchmark.num_samples=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "_run_sample", stop_after)
        got = _cli("rbs_bench", argv)
    _stopped(got, "SIGINT")
    assert path.read_bytes() == first  # the sample in flight discarded whole
    assert _lock_free(results / CELL / ".lock")
    again = _cli("rbs_bench", argv)
    assert again.status == 0 and len(_records(path)) == 2, again.err[-2000:]


def row_sigterm_while_a_record_is_written(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    path = results / CELL / "records.jsonl"
    real, sent = os.fsync, []

    def fsync(fd):
        real(fd)
        if not sent and os.readlink(f"/proc/self/fd/{fd}").endswith("records.jsonl"):
            sent.append(fd)
            _signal_self("SIGTERM")  # between the record's write and its return

    argv = [*DENSE, f"results_dir={results}", "benchmark.num_samples=3"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        got = _cli("rbs_bench", argv)
    _stopped(got, "SIGTERM")
    assert sent and len(_records(path)) == 2  # the sample in flight recorded whole, then stopped
    assert _lock_free(results / CELL / ".lock")


def row_sigint_during_calibration(tmp_path, results, recorded):
    argv = [*SMALL, "method=rbs", "budget=d50", "calibration.num_prompts=1"]
    argv += ["calibration.tolerance=0.05", f"results_dir={results}"]
    real = calibrate.probe

    def stop_after(*args, **kwargs):
        out = real(*args, **kwargs)
        _signal_self("SIGINT")
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "probe", stop_after)
        got = _cli("rbs_bench.calibrate", argv)
    _stopped(got, "SIGINT")
    path = results / "calibration" / "tiny" / "rbs.yaml"
    assert not path.exists() or isinstance(yaml.safe_load(path.read_text()), dict)


def row_sigterm_during_report(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    exp = results / CELL.parent.parent
    assert _cli("rbs_bench.report", ["--results", str(results)]).status == 0
    before = _tree(exp)
    real = report.plot_score_vs_density

    def stop_first(*args, **kwargs):
        _signal_self("SIGTERM")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "plot_score_vs_density", stop_first)
        got = _cli("rbs_bench.report", ["--results", str(results)])
    _stopped(got, "SIGTERM")
    assert _tree(exp) == before  # every summary whole, no temp file left


def row_sigterm_during_tables(tmp_path, results, recorded):
    _committed(results, "dense/default", "rbs/d30")
    real = tables_build._write

    def stop_first(*args, **kwargs):
        _signal_self("SIGTERM")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables_build, "_write", stop_first)
        got = _tables(results)
    _stopped(got, "SIGTERM")


def _handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (its SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid`."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out.update(map(int, kids))
        todo.extend(map(int, kids))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def row_sigterm_to_parallel(tmp_path, results, recorded):
    """A real process tree: `parallel` and two `python -m rbs_bench` workers. A SIGTERM to
    `parallel` once a record exists reaches every worker; when it exits, none is left and no
    cell's lock is held."""
    cmd = [sys.executable, "-m", "rbs_bench.parallel", f"{EXPERIMENT}=20", "--jobs", "2"]
    cmd += ["--results", str(results), "--", "device=cpu", "benchmark.tasks=[niah_single_1]"]
    cmd += ["benchmark.context_lengths=[1024]", "benchmark.max_new_tokens=2", "recall=false"]
    cmd += ["method=dense,rbs", "budget=default"]
    proc = subprocess.Popen(cmd, cwd=tmp_path / "cwd", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        cells = results / CELL.parent.parent
        while time.monotonic() < deadline and proc.poll() is None:
            tree |= _children(proc.pid)
            if any(p.stat().st_size for p in cells.glob("*/*/records.jsonl")):
                break
            time.sleep(0.2)
        tree |= _children(proc.pid)
        assert proc.poll() is None and len(tree) >= 2, "the workers did not start"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (proc.returncode, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.startswith(STOPPED)]
        assert len(lines) == 1 and "SIGTERM" in lines[0] and "Traceback" not in err, err[-3000:]
        assert [p for p in tree if _alive(p)] == []
        for cell in cells.glob("*/*"):
            assert _lock_free(cell / ".lock"), cell
            data = (
                (cell / "records.jsonl").read_bytes() if (cell / "records.jsonl").exists() else b""
            )
            assert not data or data.endswith(b"\n")
            assert all(json.loads(ln) for ln in data.splitlines())
        logs = list((tmp_path / "cwd" / "outputs" / "parallel").rglob("*.log"))
        assert len(logs) == 2 and all(STOPPED in p.read_text() for p in logs)
    finally:
        for pid in [proc.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def row_sigterm_to_a_benchmark_command(tmp_path, results, recorded):
    cmd = [sys.executable, "-m", "rbs_bench.bench.cpu_samples", "--samples", "1"]
    cmd += ["--methods", "dense", "--out", str(tmp_path / "speed")]
    proc = subprocess.Popen(cmd, cwd=tmp_path / "cwd", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _handles(proc.pid, signal.SIGTERM):
            time.sleep(0.05)
        assert _handles(proc.pid, signal.SIGTERM), "no handler for SIGTERM"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 143 and "Traceback" not in err, (proc.returncode, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.startswith(STOPPED)]
        assert len(lines) == 1 and "SIGTERM" in lines[0], err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _refused(*overrides: str, says: str, analysis: bool = False):
    def row(tmp_path, results, recorded):
        base = [] if analysis else DENSE
        got = _cli("rbs_bench", [*base, f"results_dir={results}", *overrides], run=False)
        _one_line(got, says)

    return row


def _parallel_refused(argv: list[str], says: str):
    def row(tmp_path, results, recorded):
        with _deadline(60):
            got = _cli("rbs_bench.parallel", [*argv, "--results", str(results)])
        _one_line(got, says)
        assert not (tmp_path / "cwd" / "outputs").exists()  # no cell started

    return row


def row_missing_results_folder(tmp_path, results, recorded):
    assert not results.exists()
    for entry, argv in (
        ("rbs_bench.report", ["--results", str(results)]),
        ("rbs_bench.report", [str(results / "runs" / EXPERIMENT / "tiny")]),
        ("rbs_bench.figures", ["--results", str(results)]),
        ("rbs_bench.tables", ["--results", str(results), "--paper-values", str(VALUES)]),
    ):
        _one_line(_cli(entry, argv), str(results))
    assert not results.exists()


def row_experiment_folder_not_writable(tmp_path, results, recorded):
    _copy_recorded(recorded, results)
    exp = results / CELL.parent.parent
    real_open = os.open

    def denied(path, flags, *args, **kwargs):  # what chmod gives a user who is not root
        if Path(path).parent == exp and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    exp.chmod(0o555)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if os.geteuid() == 0:  # root writes through any mode
                mp.setattr(os, "open", denied)
            got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", "benchmark.num_samples=2"])
    finally:
        exp.chmod(0o755)
    _one_line(got, str(exp), os.strerror(errno.EACCES))
    assert len(_records(results / CELL / "records.jsonl")) == 2  # the records are kept


def row_cached_model_files_take_the_umask(tmp_path, results, recorded):
    from rbs_bench.models import tiny

    old = os.umask(0o027)
    try:
        path = tiny.materialize(tmp_path / "cache")
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in path.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o640)}, modes
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


LONG = "n" * 300

SECOND_SWEEP: dict[str, Callable] = {
    "50 records duplicated in a committed cell": row_duplicated_records,
    "20 records moved from flexprefill/d30 into rbs/d30": row_records_moved_between_cells,
    "a record moved into another cell, resumed": row_moved_record_on_resume,
    "one sample recorded twice with other values": row_one_sample_recorded_twice_with_other_values,
    "an empty records.jsonl": row_empty_records_file,
    "records.jsonl a folder": _not_a_file(lambda p: p.mkdir()),
    "records.jsonl a FIFO": _not_a_file(os.mkfifo),
    "cell.json a FIFO": row_cell_json_a_fifo,
    "a calibration file a FIFO": row_calibration_file_a_fifo,
    "paper_values.csv a FIFO, tables": row_paper_values_a_fifo,
    "runs/adhoc a link out of results_dir": _linked_out(
        lambda r: r / "runs" / "adhoc", lambda r: [*_SMALL_ADHOC, f"results_dir={r}"]
    ),
    "a cell folder a link out of results_dir": _linked_out(
        lambda r: r / CELL, lambda r: [*DENSE, f"results_dir={r}"]
    ),
    "records.jsonl a link out of results_dir": _linked_out(
        lambda r: r / CELL / "records.jsonl", lambda r: [*DENSE, f"results_dir={r}"]
    ),
    "a cell's .lock a link out of results_dir": _linked_out(
        lambda r: r / CELL / ".lock", lambda r: [*DENSE, f"results_dir={r}"]
    ),
    "cell.json a link out of results_dir": _linked_out(
        lambda r: r / CELL / "cell.json", lambda r: [*DENSE, f"results_dir={r}"]
    ),
    "a calibration folder a link out of results_dir, calibrate": _linked_out(
        lambda r: r / "calibration" / "tiny",
        lambda r: [*RBS_D50, f"results_dir={r}"],
        "rbs_bench.calibrate",
    ),
    "an experiment folder a link out of results_dir, report": _linked_out(
        lambda r: r / CELL.parent.parent, lambda r: ["--results", str(r)], "rbs_bench.report"
    ),
    "a pickled training checkpoint": row_pickled_training_checkpoint,
    "model.path holding pytorch_model.bin": row_pickled_model_weights,
    "a method plugin whose import calls sys.exit(3)": _plugin_import(
        "exit3", "import sys\nsys.exit(3)\n", "rbs_bench"
    ),
    "a method plugin whose import raises KeyboardInterrupt": _plugin_import(
        "interrupt", "raise KeyboardInterrupt\n", "rbs_bench"
    ),
    "a method plugin whose import hangs": _plugin_import(
        "hang", "import time\ntime.sleep(3600)\n", "rbs_bench.report"
    ),
    "a selection with a future block": _bad_selection(
        "future", "idx[:, :, 1, 1] = 5", "outside the causal range"
    ),
    "a selection with a negative block": _bad_selection(
        "negative", "idx[:, :, 2, 0] = -1", "outside the causal range"
    ),
    "a selection with a block past the last": _bad_selection(
        "beyond", "idx[:, :, m - 1, 0] = m + 3", "outside the causal range"
    ),
    "a selection with more blocks than its row": _bad_selection(
        "overfull", "count[:, :, 0] = 3", "more than"
    ),
    "a selection of the wrong shape": _bad_selection("shape", "count = count[:, :, :-1]", "shape"),
    "a selection with NaN counts": _bad_selection(
        "nancount", "count = count.float().masked_fill(count == 1, float('nan'))", "float32"
    ),
    "a selector returning None": _bad_selection("none", "return None", "returned None"),
    "a selector raising at long prompts": _bad_selection(
        "raising", "raise RuntimeError('boom')", "RuntimeError: boom"
    ),
    "SIGINT during a run": row_sigint_during_a_run,
    "SIGTERM while a record is written": row_sigterm_while_a_record_is_written,
    "SIGINT during a calibration": row_sigint_during_calibration,
    "SIGTERM during report": row_sigterm_during_report,
    "SIGTERM during tables": row_sigterm_during_tables,
    "SIGTERM to parallel": row_sigterm_to_parallel,
    "SIGTERM to a benchmark command": row_sigterm_to_a_benchmark_command,
    "time_budget_s=-5": _refused("time_budget_s=-5", says="time_budget_s=-5"),
    "time_budget_s=nan": _refused("time_budget_s=nan", says="time_budget_s=nan"),
    "timing.time_budget_s=-1": _refused(
        "+experiment=speed",
        "timing.time_budget_s=-1",
        says="timing.time_budget_s=-1",
        analysis=True,
    ),  # fmt: skip
    "a 300-character model.name": _refused(f"model.name={LONG}", says="model.name="),
    "a 300-character budget.name": _refused(f"budget.name={LONG}", says="budget.name="),
    "device=nosuch": _refused("device=nosuch", says="device='nosuch'"),
    "executor=nosuch": _refused("executor=nosuch", says="executor='nosuch'"),
    "parallel --jobs 0": _parallel_refused(["thresholds=1", "--jobs", "0"], "--jobs 0"),
    "parallel --jobs -1": _parallel_refused(["thresholds=1", "--jobs", "-1"], "--jobs -1"),
    "parallel --time-budget-s 0": _parallel_refused(
        ["thresholds=1", "--time-budget-s", "0"], "--time-budget-s 0"
    ),
    "parallel ruler_budget=abc": _parallel_refused(["ruler_budget=abc"], "ruler_budget=abc"),
    "parallel ruler_budget=0": _parallel_refused(["ruler_budget=0"], "ruler_budget=0"),
    "report, figures and tables on a missing results folder": row_missing_results_folder,
    "an experiment folder not writable after the first record": row_experiment_folder_not_writable,
    "cached model files and the umask": row_cached_model_files_take_the_umask,
}


ROWS |= SECOND_SWEEP


@pytest.mark.parametrize("row", list(ROWS))
def test_fault(row, tmp_path, fresh, recorded, capsys, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_CAPSYS", capsys)
    monkeypatch.setattr(sys.modules[__name__], "_MP", monkeypatch)
    try:
        ROWS[row](tmp_path, fresh, recorded)
    finally:
        monkeypatch.undo()  # a row's plugins leave sys.path before the registry is read again
        methods.refresh()
