"""`bench.moe_passes` on the CPU: the FP8 experts' row passes under Triton's interpreter, every
setting of its grid writing the default setting's bytes, one CSV row each."""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys

import pytest
from rbs_bench.kernels.triton_util import triton_available

from rbs_bench.bench import moe_passes


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_every_setting_writes_the_default_bytes(tmp_path):
    env = os.environ | {"TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "rbs_bench.bench.moe_passes", "--tokens", "6", "--repeats", "1"]
    res = subprocess.run(
        [*cmd, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "moe_passes_cpu.csv").open()))
    grid = {name: len(list(itertools.product(*g.values()))) for name, _, g in moe_passes.GRID}
    assert len(rows) == sum(grid.values())
    for name, count in grid.items():
        mine = [r for r in rows if r["pass"] == name]
        assert len(mine) == count and mine[0]["default"] == "True"
        assert float(mine[0]["x_default"]) == 1.0
    assert all(r["same_bytes"] == "True" and float(r["ms"]) > 0 for r in rows)


def test_a_changed_setting_is_restored():
    from rbs_bench.kernels import fp8_moe

    before = fp8_moe.SCATTER_ROWS
    with pytest.raises(RuntimeError), moe_passes.settings(fp8_moe, {"SCATTER_ROWS": 64}):
        assert fp8_moe.SCATTER_ROWS == 64
        raise RuntimeError
    assert fp8_moe.SCATTER_ROWS == before
