"""The variants bench's `arch` mode, CPU side: the forced-architecture test run (a fresh Python
that sees RBS_KERNEL_ARCH=sm80, its counts and log), resuming, and the summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from rbs_bench.bench import variants


def test_arch_tests_run_with_sm80_forced(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.delenv("RBS_KERNEL_ARCH", raising=False)
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os, pytest\n"
        "@pytest.mark.gpu\n"
        "def test_forced():\n"
        "    assert os.environ['RBS_KERNEL_ARCH'] == 'sm80'\n"
        "@pytest.mark.gpu\n"
        "def test_fails():\n"
        "    assert False\n"
        "def test_not_gpu():\n"
        "    assert False\n"
    )
    rows = variants.Rows(tmp_path / "arch.csv")
    variants.arch_tests(rows, tmp_path, [str(probe)], timeout_s=120)
    row = rows.rows[-1]
    assert row["kind"] == "tests" and row["pattern"] == "RBS_KERNEL_ARCH=sm80"
    assert (row["passed"], row["failed"], row["rc"]) == (1, 1, 1)
    assert "test_fails" in (tmp_path / "arch_tests.log").read_text()
    resumed = variants.Rows(tmp_path / "arch.csv", resume=True)
    assert [r["kind"] for r in resumed.rows] == ["tests"]
    variants.arch_summary(resumed)
    assert "1 passed, 1 failed" in capsys.readouterr().out


def test_arch_mode_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(variants.torch.cuda, "is_available", lambda: False)
    assert variants.main(["arch", "--out", "/nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("rbs-bench: error:")


@pytest.mark.parametrize("mode", ["time", "profile", "arch"])
def test_modes_parse(mode, monkeypatch):
    monkeypatch.setattr(variants.torch.cuda, "is_available", lambda: False)
    assert variants.main([mode]) == 2
