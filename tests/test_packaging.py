"""The wheel carries every module of kernels/ and baselines/ under rbs_bench, conf/, and the
shipped architectures of the rehearsal models."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_mapped_folders(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("rbs_bench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, package in (
        ("kernels", "rbs_bench/kernels"),
        ("baselines", "rbs_bench/baselines"),
        ("src/rbs_bench", "rbs_bench"),
    ):
        for path in (ROOT / folder).rglob("*.py"):
            expected.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    for path in (ROOT / "conf").rglob("*.yaml"):
        expected.add(f"rbs_bench/conf/{path.relative_to(ROOT / 'conf').as_posix()}")
    for path in (ROOT / "src/rbs_bench/models/architectures").glob("*.json"):
        expected.add(f"rbs_bench/models/architectures/{path.name}")
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("kernels/", "baselines/")) for n in names)  # no top-level names
