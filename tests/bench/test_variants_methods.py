"""The variants bench's method race, CPU side: RBS's whole selection and each rival's, the rival
calibrated to RBS's measured density on the same q and k."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rbs_bench import synthetic
from rbs_bench.bench import attention, variants
from rbs_bench.methods.rbs import RBS


def test_time_methods_races_each_rival_at_rbs_density(tmp_path: Path, monkeypatch):
    calls = []

    def cpu_bench(fn, rep_ms=200):
        start = time.perf_counter()
        fn()
        calls.append(fn)
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(attention, "do_bench", cpu_bench)
    data = synthetic.generate(1, 4, 2, 2048, 64, seed=0, device="cpu", dtype=torch.float32)
    selector, density = attention.calibrate(RBS.name, data.q, data.k, 0.3, tol=0.02)
    rows = variants.Rows(tmp_path / "variants.csv")
    variants.time_methods(rows, "synthetic", 2048, data.q, data.k, selector, density)
    assert [r["pattern"] for r in rows.rows] == [RBS.name, *variants.rivals()]
    rbs, *rivals = rows.rows
    assert rbs["x_rbs"] == 1.0 and rbs["density"] == pytest.approx(density)
    for row in rivals:
        assert abs(row["density"] - density) <= 0.02 + 5e-4
        assert row["x_rbs"] == pytest.approx(row["ms"] / rbs["ms"])
    assert len(calls) == 1 + len(variants.rivals())


def test_the_summary_prints_the_race(tmp_path: Path, capsys):
    rows = variants.Rows(tmp_path / "variants.csv")
    for name, ms in (("rbs", 2.0), ("flashprefill", 1.5)):
        rows.add(kind="method", inputs="needles", n=131072, pattern=name, config=name, ms=ms,
                 density=0.05, x_rbs=ms / 2.0)  # fmt: skip
    capsys.readouterr()
    variants.summary(rows)
    out = capsys.readouterr().out
    assert "each method's whole selection" in out and "flashprefill" in out and "0.75" in out


def test_a_rival_that_cannot_be_calibrated_is_reported_and_skipped(
    tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.setattr(attention, "do_bench", lambda fn, rep_ms=200: 1.0)
    data = synthetic.generate(1, 4, 2, 1024, 64, seed=1, device="cpu", dtype=torch.float32)
    selector, density = attention.calibrate(RBS.name, data.q, data.k, 0.3, tol=0.02)
    first, *rest = variants.rivals()
    real = attention.calibrate

    def calibrate(name, *args, **kwargs):
        if name == first:
            raise ValueError("no knob value reaches the density")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(attention, "calibrate", calibrate)
    rows = variants.Rows(tmp_path / "variants.csv")
    variants.time_methods(rows, "synthetic", 1024, data.q, data.k, selector, density)
    assert [r["pattern"] for r in rows.rows] == [RBS.name, *rest]
    assert f"method {first}: failed (ValueError: no knob value" in capsys.readouterr().err
