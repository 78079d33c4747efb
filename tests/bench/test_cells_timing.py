"""bench.cells_timing: the CSV rows of a timed run come from its records; parallel's command line
gets this run's results folder; a folder that already holds records is refused."""

from __future__ import annotations

import pytest

from rbs_bench import paths
from rbs_bench.bench import cells_timing
from rbs_bench.errors import UserError


def _rec(method, score, t, decode="cuda_graph", **extra):
    return {
        "method": method, "budget": "d10", "score": score, "density": 0.1, "ttft_s": 0.02,
        "decode_s": 0.01, "new_tokens": 9, "gpu": "NVIDIA H100 80GB HBM3", "compiled": False,
        "decode": decode, "time": t, "model_identity": {"dtype": "bfloat16"}, **extra,
    }  # fmt: skip


def test_rows_per_method_from_the_records(monkeypatch, tmp_path):
    day = "2026-11-28T01:00:"
    recs = {
        "dense": [_rec("dense", 100.0, day + "17"), _rec("dense", 0.0, day + "26")],
        "rbs": [_rec("rbs", 100.0, day + "29", recall_s=0.008)],
    }
    monkeypatch.setattr(cells_timing, "_records", lambda results: recs)
    t0 = cells_timing._stamp({"time": "2026-11-28T01:00:00"})
    rows = cells_timing.rows("warm", 7, 42.04, 36.0, tmp_path, t0)
    by = {r[cells_timing.COLUMNS.index("method")]: dict(zip(cells_timing.COLUMNS, r)) for r in rows}
    assert by["dense"]["n"] == 2 and by["dense"]["accuracy"] == 50.0
    assert (
        by["dense"]["samples"] == 3 and by["dense"]["cells"] == 2 and by["dense"]["wall_s"] == 42.0
    )
    assert (by["dense"]["first_record_s"], by["dense"]["last_record_s"]) == (17, 26)
    assert by["rbs"]["recall_s_median"] == 0.008 and by["dense"]["recall_s_median"] == 0.0
    assert by["rbs"]["decode"] == "cuda_graph" and by["rbs"]["dtype"] == "bfloat16"


def test_parallel_gets_this_runs_results_folder(tmp_path):
    got = cells_timing._with_results(
        ["x=6", "--jobs", "7", "--results", "elsewhere", "--", "budget=d10"], tmp_path
    )
    assert got == ["x=6", "--jobs", "7", "--results", str(tmp_path), "--", "budget=d10"]
    assert cells_timing._with_results(["x=6"], tmp_path) == ["x=6", "--results", str(tmp_path)]


def test_a_folder_with_records_or_no_command_is_refused(tmp_path):
    cell = tmp_path / "runs" / "e" / "m" / "dense" / "default"
    cell.mkdir(parents=True)
    (cell / paths.RECORDS).write_text("")
    args = ["--results", str(tmp_path), "--label", "a", "--csv", "c", "--", "e=1"]
    with pytest.raises(UserError, match="already holds records"):
        cells_timing.main(args)
    with pytest.raises(UserError, match="command line after --"):
        cells_timing.main(args[:-2])


def test_startup_and_bytecode_columns_and_an_older_csv_gets_them(monkeypatch, tmp_path):
    line = "cells composed and their records read in 1.9 s; the harness imported for forking in "
    line += "4.3 s"
    assert cells_timing.startup(f"7 cells\n{line}\n28 s: every cell complete") == (1.9, 4.3)
    assert cells_timing.startup("7 cells\n28 s: every cell complete") == (None, None)
    recs = {"dense": [_rec("dense", 100.0, "2026-11-28T01:00:17")]}
    monkeypatch.setattr(cells_timing, "_records", lambda results: recs)
    t0 = cells_timing._stamp({"time": "2026-11-28T01:00:00"})
    rows = cells_timing.rows("warm", 7, 30.0, 28.0, tmp_path, t0, (1.9, 4.3))
    row = dict(zip(cells_timing.COLUMNS, rows[0]))
    assert (row["compose_s"], row["import_s"]) == (1.9, 4.3)
    assert row["bytecode"] in ("kept", "not written")
    out = tmp_path / "seven.csv"
    old = cells_timing.COLUMNS[: cells_timing.COLUMNS.index("compose_s")]
    out.write_text(",".join(old) + "\n" + ",".join(["old"] + ["1"] * (len(old) - 1)) + "\n")
    cells_timing.append(out, rows)
    lines = out.read_text().splitlines()
    assert lines[0] == ",".join(cells_timing.COLUMNS) and len(lines) == 3
    assert lines[1].startswith("old,") and lines[1].endswith(",,,")
    assert lines[2].startswith("warm,") and lines[2].endswith(f",1.9,4.3,{row['bytecode']}")
