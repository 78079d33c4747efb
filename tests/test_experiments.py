"""Every experiment config composes, its grid expands into distinct cells, and the paper tables'
experiments run end to end on the embedded model (small settings)."""

import csv
import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from rbs_bench import config
from rbs_bench.records import read_records
from rbs_bench.session import build_selector, cell_dir
from rbs_bench.tables import build, specs

config.register_schemas()

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "results" / "paper" / "paper_values.csv"
# The experiments of the paper's tables, and the table each regenerates.
PAPER_TABLES = {
    "ruler_budget": ["tab:ruler_budget"],
    "longbench_v2": ["tab:longbench_dual"],
    "ruler_main": ["tab:ruler"],
    "infinitebench": ["tab:InfiniteBench"],
    "videomme": ["tab:videomme"],
    "selector_ablation": ["tab:selector_ablation", "tab:selector_breakdown"],
    "strict_density": ["tab:strict_density"],
    "block_size": ["tab:block_sensitivity"],
    "thresholds": ["tab:threshold_sensitivity"],
    "calibration_cost": ["tab:calibration"],
}
GRID_EXPERIMENTS = [e for e in config.group_options("experiment") if e in PAPER_TABLES]


def _covering(grids: list[list[str]]) -> list[list[str]]:
    """Cells such that every value of every axis is in one of them (composing all is slow)."""
    seen, out = set(), []
    for g in grids:
        if not out or not set(g) <= seen:
            out.append(g)
            seen |= set(g)
    return out


@functools.cache
def _expand(experiment: str, pinned: tuple[str, ...] = (), every: bool = False) -> tuple:
    """(the sweep params, the grid's override lists, composed cells: all of them with `every`,
    else a set that covers every value of every axis)."""
    over = [f"+experiment={experiment}", *pinned]
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        hc = compose(config_name="config", overrides=over, return_hydra_config=True).hydra
        grids = config.grid_overrides(hc)
        picked = grids if every else _covering(grids)
        cells = [compose(config_name="config", overrides=over + g) for g in picked]
    for cell in cells:
        config.validate(cell)
    return dict(hc.sweeper.params or {}), grids, cells


def _cells(experiment: str, *pinned: str, every: bool = False) -> list:
    return _expand(experiment, pinned, every)[2]


def _axis_sizes(experiment: str) -> int:
    """The grid's size by its rule: the product of the sweep axes' value counts."""
    return math.prod(len(str(v).split(",")) for v in _expand(experiment)[0].values())


@pytest.mark.parametrize("experiment", GRID_EXPERIMENTS)
def test_every_grid_expands_into_distinct_valid_cells(experiment):
    _, grids, cells = _expand(experiment)
    assert len(grids) == _axis_sizes(experiment)
    assert len({tuple(sorted(g)) for g in grids}) == len(grids)
    dirs = [cell_dir(c, experiment) for c in cells]
    assert len(set(dirs)) == len(dirs)  # no two cells share a records file
    for c in cells:
        OmegaConf.resolve(c)  # interpolated budget names resolve
        build_selector(c, apply_budget=False)
        assert c.model.name in ("tiny", "tiny_vl")  # every default runs on the embedded model
        assert max(c.benchmark.context_lengths) <= 8192  # and on a CPU in minutes


@pytest.mark.parametrize("experiment", sorted(PAPER_TABLES))
def test_each_experiment_names_its_paper_table_and_setting(experiment):
    text = (ROOT / "conf" / "experiment" / f"{experiment}.yaml").read_text()
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    with open(VALUES, newline="") as f:
        labels = {r["table"] for r in csv.DictReader(f)}
    for label in PAPER_TABLES[experiment]:
        assert label in header and label in labels
    assert "CPU default" in header and "Paper setting" in header
    assert re.search(r"model=qwen3_\w+", header)  # the paper's model, as an override


def test_ruler_budget_is_five_methods_and_the_oracle_by_four_targets():
    _, grids, cells = _expand("ruler_budget")
    methods = {c.method.name for c in cells}
    assert methods == {"flashprefill", "xattn", "flexprefill", "minference", "rbs", "oracle"}
    targets = sorted({c.budget.target for c in cells})
    assert len(targets) == 4 and len(grids) == 24
    assert all(c.recall for c in cells)  # the CPU default records attention recall
    (dense,) = _cells("ruler_budget", "method=dense", "budget=default")  # the reference line
    assert dense.budget.target is None


def test_ruler_budget_runs_its_dense_reference_unless_the_method_is_pinned():
    cell = _cells("ruler_budget")[0]
    assert config.reference_cells(cell, ["+experiment=ruler_budget", "budget=d50"]) == [
        ["method=dense", "budget=default"]
    ]
    assert config.reference_cells(cell, ["+experiment=ruler_budget", "method=rbs"]) == []


def test_thresholds_pairs_move_together():
    cells = _cells("thresholds", every=True)
    pairs = {c.budget.name: (c.method.alpha_base, c.method.alpha_rescue) for c in cells}
    assert pairs == {
        "conservative": (0.16, 0.24),
        "default": (0.22, 0.18),
        "aggressive": (0.24, 0.16),
    }


def test_anchor_budgets_are_named_after_their_target():
    for experiment in ("strict_density", "selector_ablation", "block_size"):
        for c in _cells(experiment):
            assert c.budget.name.startswith(f"anchor{c.budget.target}")
    cells = _cells("block_size", every=True)
    names = {(c.method.name, c.budget.name): c.method.block_size for c in cells}
    assert sorted(names.values()) == [32, 32, 64, 64, 128, 128]  # one name per block size


LONG = [e for e in config.group_options("experiment") if e.endswith("_16k")]


def test_every_accuracy_experiment_has_its_long_setting():
    assert sorted(LONG) == sorted(
        f"{e}_16k" for e in ("ruler_budget", "strict_density", "selector_ablation", "block_size")
    ) + ["thresholds_16k"]


@pytest.mark.parametrize("experiment", LONG)
def test_long_settings_run_the_trained_length_in_bf16_at_n_200_with_dense(experiment):
    base = experiment.removesuffix("_16k")
    text = (ROOT / "conf" / "experiment" / f"{experiment}.yaml").read_text()
    assert all(label in text for label in PAPER_TABLES[base])  # the paper table it regenerates
    assert specs.spec_for(experiment) is specs.spec_for(base)
    params, grids, cells = _expand(experiment, every=True)
    assert len(grids) == math.prod(len(str(v).split(",")) for v in params.values())
    over = [f"+experiment={experiment}"]
    refs = config.reference_cells(cells[0], over)
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        (dense,) = [compose(config_name="config", overrides=over + r) for r in refs]
    assert dense.method.name == "dense" and cell_dir(dense, experiment).name == "default"
    dirs = [cell_dir(c, experiment) for c in [*cells, dense]]
    assert len(set(dirs)) == len(dirs)
    for c in [*cells, dense]:
        config.validate(c)
        OmegaConf.resolve(c)
        assert c.model.name == "tiny" and c.model.dtype == "bfloat16"
        assert list(c.benchmark.context_lengths) == [16384]
        assert len(c.benchmark.tasks) * c.benchmark.num_samples >= 200  # per reported accuracy
        # the diagonal block alone is forced: 1.55% of the causal pairs at 16K
        assert dict(c.forced) == dict(
            sink_blocks=0, window_blocks=1, last_q_blocks=0, min_budget=128
        )
        target = c.budget.target
        assert target is None or target in (0.05, 0.1, 0.0534, 0.1103)  # the paper's densities


def test_calibration_cost_keeps_its_calibrations_apart(tmp_path):
    (cell, *_) = _cells("calibration_cost", f"results_dir={tmp_path}")
    assert Path(cell.calibration.dir) == tmp_path / "runs" / "calibration_cost"


# --- end to end on the embedded model ---------------------------------------------------------


def _run(tmp_path, module, *args):
    cmd = [sys.executable, "-m", module, *args, "progress=false", f"results_dir={tmp_path}"]
    env = dict(os.environ, RBS_BENCH_CACHE=str(tmp_path / "cache"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


TINY = ["benchmark.context_lengths=[1024]", "benchmark.num_samples=1", "benchmark.max_new_tokens=2"]


@pytest.mark.slow
def test_thresholds_runs_builds_its_table_and_reruns_as_a_no_op(tmp_path):
    _run(tmp_path, "rbs_bench", "+experiment=thresholds", *TINY)
    exp = tmp_path / "runs" / "thresholds" / "tiny" / "rbs"
    recs = {b: read_records(exp / b / "records.jsonl") for b in specs.THRESHOLD_ORDER}
    assert all(len(r) == 1 for r in recs.values())
    assert recs["aggressive"][0]["method_fields"]["alpha_rescue"] == 0.16
    before = {p: p.read_bytes() for p in exp.rglob("records.jsonl")}
    res = _run(tmp_path, "rbs_bench", "+experiment=thresholds", *TINY)
    assert res.stdout.count("already recorded") == 3
    assert {p: p.read_bytes() for p in exp.rglob("records.jsonl")} == before
    assert build.main(["--results", str(tmp_path), "--paper-values", str(VALUES)]) == 0
    md = (tmp_path / "tables" / "thresholds_tiny.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == ["| Setting", "| Conservative", "| Default"] + [
        "| Aggressive"
    ]
    assert "| Aggressive | 0.24 | 0.16 |" in md
    for b in specs.THRESHOLD_ORDER:
        assert f"{exp / b / 'records.jsonl'}` (1 records)" in md


@pytest.mark.slow
def test_calibrated_grid_cell_runs_at_its_target(tmp_path):
    """ruler_budget for one method and target: calibrate, run, table. The run's prompts are the
    calibration prompts, so the run measures the calibration's density."""
    import yaml

    args = ["+experiment=ruler_budget", "method=xattn", "budget=d80", *TINY]
    res = _run(tmp_path, "rbs_bench.calibrate", *args)
    assert "xattn @ 0.8000" in res.stdout
    (entry,) = yaml.safe_load((tmp_path / "calibration/tiny/xattn.yaml").read_text())["entries"]
    assert entry["abs_error"] == pytest.approx(abs(entry["density_mean"] - 0.8))
    _run(tmp_path, "rbs_bench", *args)
    (rec,) = read_records(tmp_path / "runs/ruler_budget/tiny/xattn/d80/records.jsonl")
    assert rec["density"] == pytest.approx(entry["density_mean"], abs=1e-12)
    assert rec["method_fields"]["tau"] == entry["knob"]
    res = _run(tmp_path, "rbs_bench.calibrate", *args)  # a rerun keeps the calibration
    assert "already calibrated" in res.stdout or "warning" in res.stderr
    assert build.main(["--results", str(tmp_path), "--paper-values", str(VALUES)]) == 0
    md = (tmp_path / "tables" / "ruler_budget_tiny.md").read_text()
    from rbs_bench.report import wilson

    lo, hi = wilson(rec["score"], 1)  # the accuracy's 95% interval from one sample
    cell = f"| 80% | {100 * rec['density']:.2f} / {rec['score']:.2f} [{lo:.1f}, {hi:.1f}]"
    assert cell in md.replace("**", "")
