"""`python -m rbs_bench +experiment=<name> [overrides]`: run an experiment's grid of cells.

Without -m, the experiment's sweep (`hydra.sweeper.params`) runs in this process, one cell after
another, and the summary table and plot are rebuilt at the end. With -m, Hydra's launcher runs
each cell as its own job (locally, or as a SLURM array with hydra/launcher=submitit_slurm); every
job rebuilds the summary from the records present when it finishes.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rbs_bench.checks import check_cell, check_run_settings, preflight
from rbs_bench.config import (
    CONFIG_MODULE,
    grid_overrides,
    out_of_time,
    reference_cells,
    register_schemas,
    report_user_errors,
    validate,
)
from rbs_bench.errors import stop_on_signals
from rbs_bench.models.memory import use_expandable_segments
from rbs_bench.paths import SUMMARY, confine

register_schemas()


def run(cfg: DictConfig) -> None:
    check_run_settings(cfg)  # also for a cell a launcher hands over without the preflight
    confine(cfg.results_dir)  # no write leaves results_dir through a link
    if cfg.get("observations") is not None:  # +experiment=observations: an analysis, not a grid
        from rbs_bench import observations

        validate(cfg)
        observations.run(cfg, HydraConfig.get().runtime.choices.get("experiment") or "adhoc")
        return
    if cfg.get("timing") is not None:  # speed, memory, throughput, selector_time: timed requests
        from rbs_bench.bench import ttft

        validate(cfg)
        ttft.run_experiment(cfg, HydraConfig.get().runtime.choices.get("experiment") or "adhoc")
        return
    from rbs_bench import report
    from rbs_bench.loggers import make_logger
    from rbs_bench.runner import run_cell
    from rbs_bench.session import Session, cell_dir, experiment_dir

    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment") or "adhoc"
    if experiment == "adhoc":
        print(
            f"rbs-bench: no +experiment given: one cell, recorded under "
            f"{experiment_dir(cfg, experiment)}/ (+experiment=<name> runs an experiment's grid "
            "into runs/<name>/)",
            flush=True,
        )
    if hc.mode == RunMode.MULTIRUN:
        cells = [cfg]  # the launcher already expanded the grid: this job is one cell
    else:
        grids = reference_cells(cfg, list(hc.overrides.task)) + grid_overrides(hc)
        cells = [
            hydra.compose(config_name="config", overrides=list(hc.overrides.task) + grid)
            for grid in grids
        ]
        # a reference cell the grid also sweeps (dense among the methods) runs once
        unique = {cell_dir(cell, experiment): cell for cell in reversed(cells)}
        cells = [c for c in cells if unique.get(cell_dir(c, experiment)) is c]
    for cell in cells:
        validate(cell)  # `+key=value` overrides pass composition; catch misspelt ones here
        check_cell(cell, experiment)  # every cell, before the first one loads a model
    logger = make_logger(cfg, experiment_dir(cfg, experiment), experiment)
    session = Session()
    for i, cell in enumerate(cells):
        if out_of_time(cell):
            print(
                f"time_budget_s={cell.time_budget_s:g} reached with {len(cells) - i} of "
                f"{len(cells)} cells to run; rerun the same command to continue (finished "
                "samples are kept)"
            )
            break
        run_cell(cell, experiment, session, logger)
    exp_dir = experiment_dir(cfg, experiment)
    overall = report.write_summary(exp_dir)
    logger.log_summary(exp_dir)
    logger.finish()
    if overall is None:  # no record yet: a time budget spent first says so already
        if not out_of_time(cfg):
            print(f"{exp_dir}: no run records yet, so no summary")
        return
    summary = exp_dir / SUMMARY
    print(f"summary: {summary}")
    print(summary.read_text().split("\n## ")[0])


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    report_user_errors(run, cfg)


def main() -> None:
    stop_on_signals()  # SIGINT, SIGTERM: one line, exit status 130 / 143
    use_expandable_segments()
    # Compose once up front so a bad override (unknown option, misspelt field) is one clear line.
    preflight(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
