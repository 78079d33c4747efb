"""Calibration finds the knob for a target density, stores it, and runs read it back."""

import pytest
import yaml
from hydra import compose, initialize_config_module

from rbs_bench import calibrate, config
from rbs_bench.config import UserError
from rbs_bench.runner import Session, build_selector, run_cell

config.register_schemas()


def _cfg(tmp_path, *extra):
    overrides = [
        "method=rbs",
        "method.block_size=32",  # 2K tokens -> 64 blocks, so the forced floor is low
        "budget=d10",
        "budget.target=0.45",
        "benchmark.context_lengths=[2048]",
        "benchmark.num_samples=2",
        "benchmark.max_new_tokens=4",
        "calibration.num_prompts=2",
        "calibration.tolerance=0.002",
        "progress=false",
        f"results_dir={tmp_path}",
        *extra,
    ]
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.slow
def test_calibrated_knob_reproduces_its_density_in_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path)
    with pytest.raises(UserError, match=r"python -m rbs_bench.calibrate model=tiny method=rbs"):
        build_selector(cfg)  # nothing calibrated yet: the message names the command
    session = Session()
    entry = calibrate.calibrate_cell(cfg, session)
    assert entry["abs_error"] <= 0.002
    stored = yaml.safe_load((tmp_path / "calibration/tiny/rbs.yaml").read_text())
    assert stored["entries"][0]["knob"] == entry["knob"]
    sel = build_selector(cfg)
    assert sel.alpha_base == pytest.approx(0.22 * entry["knob"])
    # the run's prompts are the calibration prompts here: it measures the same density
    records = run_cell(cfg, "calib_test", session)
    dens = [yaml.safe_load(line)["density"] for line in records.read_text().splitlines()]
    assert abs(sum(dens) / len(dens) - 0.45) <= 0.002


@pytest.mark.slow
def test_unreachable_target_names_the_range(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, "budget.target=0.01")
    with pytest.raises(UserError, match=r"cannot reach density 0.0100.*spans densities 0\.\d+-1"):
        calibrate.calibrate_cell(cfg, Session())


def test_knob_grid_follows_the_knob_kind():
    from rbs_bench import methods

    geo = calibrate.knob_grid(methods.build("rbs"), 1e-2, 1e2, 5)
    assert geo == pytest.approx([1e-2, 1e-1, 1, 10, 100])
    lin = calibrate.knob_grid(methods.build("quest"), 0.0, 1.0, 5)
    assert lin == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_budget_with_knob_and_target_is_refused(tmp_path):
    with pytest.raises(UserError, match="sets both knob and target"):
        build_selector(_cfg(tmp_path, "budget.knob=0.5"))
