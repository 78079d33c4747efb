"""The quick start's seconds per sample, every method on the same samples in one process."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from rbs_bench.bench import cpu_samples

ROOT = Path(__file__).resolve().parents[2]


def test_every_method_runs_the_same_samples_and_is_compared_with_dense(tmp_path, capsys):
    assert cpu_samples.main(
        ["--samples", "2", "--methods", "dense", "rbs", "minference", "--out", str(tmp_path),
         "--name", "mine", "--set", "benchmark.tasks=[niah_multikey_3]"]
    ) == 0  # fmt: skip
    df = pd.read_csv(tmp_path / "mine.csv").set_index("method")
    assert list(df.index) == ["dense", "rbs", "minference"]
    assert (df["samples"] == 2).all() and (df["context_length"] == 4096).all()
    assert df.loc["dense", "wall_over_dense"] == 1.0 and df.loc["dense", "budget"] == "default"
    assert (df.loc[["rbs", "minference"], "budget"] == "d25").all()
    # the recall pass is part of the wall time and left out of the request's
    assert (df["request_s"] > 0).all() and (df["request_s"] <= df["wall_s"] + 1e-3).all()
    # the prefill alone: the request less its decode
    assert (df["prefill_s"] > 0).all() and (df["prefill_s"] < df["request_s"]).all()
    assert (df["input_tokens"] == 3862).all() and (df["dtype"] == "float32").all()
    sparse = df.loc[["rbs", "minference"]]
    assert (sparse["request_s"] < sparse["wall_s"]).all()
    out = capsys.readouterr().out
    assert "sample 2/2 (3862 tokens)" in out and "request_over_dense" in out


def test_an_unknown_method_is_one_line(tmp_path, capsys):
    assert cpu_samples.main(["--methods", "dense", "nosuch", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuch" in err[0], err
    assert not (tmp_path / "cpu_samples_cpu.csv").exists()


def test_the_methods_are_the_experiments_grid():
    """Dense (the reference cell, at its own budget) first, then the sweep's methods in order."""
    conf = yaml.safe_load((ROOT / "conf" / "experiment" / "ruler_budget.yaml").read_text())
    sweep = conf["hydra"]["sweeper"]["params"]["method"].split(",")
    reference = [dict(o.split("=") for o in cell.split()) for cell in conf["reference"]]
    got = cpu_samples.grid_budgets("ruler_budget", "d30")
    assert list(got) == [r["method"] for r in reference] + sweep
    assert got[reference[0]["method"]] == reference[0]["budget"]
    assert all(got[m] == "d30" for m in sweep)
