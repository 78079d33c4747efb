"""The attention benchmark's CPU-side pieces: calibration to a density, FLOP count, plot."""

import pandas as pd
import pytest

from rbs_bench import synthetic
from rbs_bench.bench import attention


def test_causal_flops_counts_the_triangle():
    assert attention.causal_flops(2, 1, 1) == 4 * 3
    assert attention.causal_flops(1024, 32, 128) == pytest.approx(4 * 32 * 128 * 1024 * 1025 / 2)


@pytest.mark.parametrize("name", ["rbs", "centroid"])
def test_calibrate_hits_a_reachable_target(name):
    data = synthetic.generate(seq_len=8192, seed=1)  # 64 blocks: forced ones are ~20%
    sel, density = attention.calibrate(name, data.q, data.k, target=0.4, tol=0.01)
    assert abs(density - 0.4) <= 0.01
    assert sel.select(data.q, data.k).density() == pytest.approx(density)


def test_calibrate_returns_the_closest_when_unreachable():
    data = synthetic.generate(seq_len=2048, seed=1)  # 16 blocks: forced blocks alone exceed 5%
    sel, density = attention.calibrate("rbs", data.q, data.k, target=0.05)
    forced_only = sel.with_knob(1e3).select(data.q, data.k).density()
    assert density == pytest.approx(forced_only, abs=1e-3)


def test_plot_from_rows(tmp_path):
    rows = []
    for n in (16384, 32768):
        rows.append(
            {
                "gpu": "X",
                "n": n,
                "method": "sdpa_fa2",
                "target": 1.0,
                "density": 1.0,
                "executor": "sdpa_fa2",
                "selector_ms": 0.0,
                "total_ms": 10.0,
            }
        )
        rows.append(
            {
                "gpu": "X",
                "n": n,
                "method": "rbs",
                "target": 0.05,
                "density": 0.05,
                "executor": "flex",
                "selector_ms": 0.1,
                "total_ms": 1.0,
                "speedup_vs_sdpa_fa2": 10.0,
            }
        )
    attention.plot(pd.DataFrame(rows), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_main_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: False)
    assert attention.main(["--lengths", "1024"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
