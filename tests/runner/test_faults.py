"""Faults and bad input: each gives one clear line, loses nothing and writes nothing outside its
directory. One row per failure a reliability sweep found (the embedded model, niah_single_1).

Every row runs the real entry point in this process (`python -m rbs_bench`,
`python -m rbs_bench.calibrate`, `python -m rbs_bench.report`, `python -m rbs_bench.figures`:
their `main()` with sys.argv set), or, for the rows below the command line (a selector's input,
a calibration write), the function itself. A row whose fault must be caught before anything runs
replaces the Hydra job with a failure, so passing the checks fails the row at once instead of
running the cell. The rows that need a cell already recorded share one real run of the dense
cell (`recorded`)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from rbs_bench import __main__ as run_main
from rbs_bench import calibrate, calibrations, config, figures, methods, report

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "src" / "rbs_bench" / "tinylm" / "weights"
PREFIX = "rbs-bench: error: "
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

config.register_schemas()


@dataclass
class Outcome:
    status: int | str  # exit status, or "raised" when an exception escaped the entry point
    out: str
    err: str

    def errors(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith(PREFIX)]


# The capsys of the running test (test_fault sets it): each call reads what it printed.
_CAPSYS = None


def _cli(entry: str, argv: list[str], *, run: bool = True) -> Outcome:
    """Run an entry point's main() as `python -m <entry> <argv>`; `run=False` fails the row if
    the command gets past its up-front checks (the Hydra job would start)."""
    from hydra.core.hydra_config import HydraConfig

    main = {
        "rbs_bench": run_main.main,
        "rbs_bench.calibrate": calibrate.main,
        "rbs_bench.report": lambda: sys.exit(report.main(argv)),
        "rbs_bench.figures": lambda: sys.exit(figures.main(argv)),
    }[entry]
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
        except Exception as e:  # noqa: BLE001 - a traceback is what the row must not give
            status, raised = "raised", f"Traceback: {type(e).__name__}: {e}\n"
    finally:
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
    got = _cli("rbs_bench", [*DENSE, f"results_dir={results}", "time_budget_s=0"])
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


@pytest.mark.parametrize("row", list(ROWS))
def test_fault(row, tmp_path, fresh, recorded, capsys, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_CAPSYS", capsys)
    ROWS[row](tmp_path, fresh, recorded)
