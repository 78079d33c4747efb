"""The SLURM launcher configs and the array-index -> grid-cell helper (no scheduler needed)."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from rbs_bench import config
from rbs_bench import slurm as helper

ROOT = Path(__file__).resolve().parents[2]
config.register_schemas()


def _hydra_cfg(*overrides):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("name,partition", [("slurm_h100", "h100"), ("slurm_a100", "a100")])
def test_launcher_configs_compose_from_the_package(name, partition):
    launcher = _hydra_cfg(f"hydra/launcher={name}").hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.partition == partition and launcher.gpus_per_node == 1
    assert launcher.max_num_timeout > 0  # timeouts requeue; the rerun resumes the cell
    for field in ("cpus_per_task", "mem_gb", "timeout_min", "array_parallelism"):
        assert launcher[field] > 0
    pinned = _hydra_cfg(
        f"hydra/launcher={name}", "hydra.launcher.partition=gpu", "hydra.launcher.mem_gb=32"
    ).hydra.launcher
    assert (pinned.partition, pinned.mem_gb) == ("gpu", 32)


def _axes(experiment: str) -> dict[str, list[str]]:
    params = _hydra_cfg(f"+experiment={experiment}").hydra.sweeper.params or {}
    return {k: str(v).split(",") for k, v in params.items()}


@pytest.mark.parametrize("experiment", config.group_options("experiment"))
def test_grid_is_the_product_of_the_experiment_sweep(experiment):
    cells, hydra_ovs = helper.grid([f"+experiment={experiment}"])
    axes = _axes(experiment)
    expected = [
        [f"{k}={v}" for k, v in zip(axes, combo)] + [f"+experiment={experiment}"]
        for combo in itertools.product(*axes.values())
    ]
    assert cells == expected and hydra_ovs == []


def test_command_line_keys_replace_or_extend_axes():
    axes = _axes("ruler_budget")
    assert "method" in axes
    cells, hydra_ovs = helper.grid(
        [
            "+experiment=ruler_budget",
            "method=dense,rbs",
            "benchmark.num_samples=1,2",
            "hydra.run.dir=/x",
        ]
    )
    n_other = len(list(itertools.product(*(v for k, v in axes.items() if k != "method"))))
    assert len(cells) == 2 * n_other * 2
    assert {c[0] for c in cells} == {"method=dense", "method=rbs"}  # same position as the axis
    assert {c[-1] for c in cells} == {"benchmark.num_samples=1", "benchmark.num_samples=2"}
    assert hydra_ovs == ["hydra.run.dir=/x"]
    assert helper.cell_args(1, ["+experiment=ruler_budget", "hydra.run.dir=/x"])[-1] == (
        "hydra.run.dir=/x"
    )


def test_cli_size_array_cell_and_bad_index(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    args = ["+experiment=ruler_budget", "method=dense,rbs", "budget=default"]
    assert helper.main(["size", *args]) == 0
    assert capsys.readouterr().out.strip() == "2"
    assert helper.main(["array", *args]) == 0
    assert capsys.readouterr().out.strip() == "0-1"
    assert helper.main(["cell", "1", *args]) == 0
    assert capsys.readouterr().out.split() == ["method=rbs", "budget=default", args[0]]
    assert helper.main(["cell", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "rbs-bench: error: array index 2 is outside this grid of 2 cells; submit with --array=0-1"
    )
    assert helper.main(["cell", *args]) == 2  # no index and not inside an array task
    assert "SLURM_ARRAY_TASK_ID" in capsys.readouterr().err


def test_unknown_experiment_is_one_line(capsys):
    assert helper.main(["size", "+experiment=nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rbs-bench: error: unknown experiment 'nosuch'; valid:")
    assert "\n" not in err


def test_sbatch_template_is_valid_bash():
    template = ROOT / "slurm" / "grid.sbatch"
    subprocess.run(["bash", "-n", str(template)], check=True)
    directives = [ln for ln in template.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives  # preempted tasks come back and resume
