"""The variants bench's `arch` mode, CPU side: the forced-architecture test run (a fresh Python
that sees RBS_KERNEL_ARCH=sm80, its counts and log), resuming, and the summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from rbs_bench.bench import variants


def _run_probe(tmp_path: Path, source: str, timeout_s: float) -> dict:
    """arch_tests on one test file of `source`; its row."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(source)
    rows = variants.Rows(tmp_path / "arch.csv")
    variants.arch_tests(rows, tmp_path, [str(probe)], timeout_s=timeout_s)
    return rows.rows[-1]


def test_arch_tests_run_with_sm80_forced(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.delenv("RBS_KERNEL_ARCH", raising=False)
    source = (
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
    row = _run_probe(tmp_path, source, timeout_s=120)
    assert row["kind"] == "tests" and row["pattern"] == "RBS_KERNEL_ARCH=sm80"
    assert (row["passed"], row["failed"], row["rc"]) == (1, 1, 1)
    assert "test_fails" in (tmp_path / "arch_tests.log").read_text()
    resumed = variants.Rows(tmp_path / "arch.csv", resume=True)
    assert [r["kind"] for r in resumed.rows] == ["tests"]
    variants.arch_summary(resumed)
    assert "1 passed, 1 failed" in capsys.readouterr().out


def test_tests_stopped_by_the_budget_are_counted_from_their_progress(tmp_path: Path):
    """A run the time budget stops has no summary line: its progress characters still count,
    and its log is text (an H100 run stopped after 56 tests logged b'....' and 0 passed)."""
    source = (
        "import time, pytest\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_quick(i):\n"
        "    pass\n"
        "@pytest.mark.gpu\n"
        "def test_slow():\n"
        "    time.sleep(60)\n"
    )
    row = _run_probe(tmp_path, source, timeout_s=8)
    assert (row["rc"], row["passed"], row["failed"]) == (-1, 3, 0)
    log = (tmp_path / "arch_tests.log").read_text()
    assert log.startswith("...") and "timed out after 8 s" in log


def test_counts_read_the_summary_line_first():
    assert variants.counts_from_pytest_log("..F\n1 failed, 2 passed, 3 skipped in 1.0s") == {
        "passed": 2, "failed": 1, "skipped": 3, "error": 0,
    }  # fmt: skip
    assert variants.counts_from_pytest_log(".s.F [ 40%]\n.E") == {
        "passed": 3, "failed": 1, "skipped": 1, "error": 1,
    }  # fmt: skip


def test_arch_mode_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(variants.torch.cuda, "is_available", lambda: False)
    assert variants.main(["arch", "--out", "/nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("rbs-bench: error:")


@pytest.mark.parametrize("mode", ["time", "profile", "arch"])
def test_modes_parse(mode, monkeypatch):
    monkeypatch.setattr(variants.torch.cuda, "is_available", lambda: False)
    assert variants.main([mode]) == 2


def test_arch_tests_cover_every_kernel_that_reads_the_architecture():
    """The sm80 run tests the kernels whose configurations depend on `kernel_arch`; a kernel that
    starts reading it needs its tests added to ARCH_TESTS."""
    root = Path(__file__).resolve().parents[2]
    readers = {
        p.stem
        for p in (root / "kernels").glob("*.py")
        if p.stem != "triton_util" and "kernel_arch" in p.read_text()
    }
    tested = {
        Path(t).stem.removeprefix("test_").removesuffix("_triton") for t in variants.ARCH_TESTS
    }
    assert readers <= tested, readers - tested
    assert all((root / t).is_file() for t in variants.ARCH_TESTS)
