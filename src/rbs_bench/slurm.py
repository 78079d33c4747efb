"""An experiment's grid cells by array index, for plain `sbatch --array` jobs (slurm/grid.sbatch).

    python -m rbs_bench.slurm size  +experiment=ruler_budget [overrides]   # number of cells
    python -m rbs_bench.slurm array +experiment=ruler_budget [overrides]   # "0-8", for --array
    python -m rbs_bench.slurm cell 3 +experiment=ruler_budget [overrides]  # what task 3 runs
    python -m rbs_bench.slurm run 3 +experiment=ruler_budget [overrides]   # run cell 3

Cells are numbered the way `python -m rbs_bench -m ...` numbers its jobs (Hydra's basic sweeper:
the experiment's `hydra.sweeper.params`, then the command line's own keys, as one Cartesian
product; a command-line key replaces the experiment's axis of the same name). So array task i of
the sbatch template runs the same cell as job i of `hydra/launcher=slurm_h100`, and both resume
from the same records.
"""

from __future__ import annotations

import argparse
import os
import sys

from rbs_bench.config import compose_cell, explain
from rbs_bench.errors import UserError


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # a malformed override is the user's input
        raise UserError(explain(exc)) from None


def _sweeper_params(overrides: list[str]) -> dict:
    """`hydra.sweeper.params` of the config these (non-sweep) overrides compose."""
    cfg = compose_cell(overrides, hydra_config=True)
    return dict(cfg.hydra.sweeper.get("params") or {})


def grid(overrides: list[str]) -> tuple[list[list[str]], list[str]]:
    """(the cells' task overrides in job order, the hydra.* overrides every cell shares)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = _parse(overrides)
    hydra_ovs = [o.input_line for o in parsed if o.is_hydra_override()]
    task = [o.input_line for o in parsed if not o.is_hydra_override()]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    params = _sweeper_params(fixed)
    combined = _parse([f"{k}={v}" for k, v in params.items()] + task)
    try:
        (cells,) = BasicSweeper.split_arguments(combined, max_batch_size=None)
    except Exception as exc:  # e.g. a range or interval sweep, which has no fixed cells
        raise UserError(explain(exc)) from None
    return cells, hydra_ovs


def cell_args(index: int, overrides: list[str]) -> list[str]:
    """The full `python -m rbs_bench` arguments of cell `index`."""
    cells, hydra_ovs = grid(overrides)
    if not 0 <= index < len(cells):
        raise UserError(
            f"array index {index} is outside this grid of {len(cells)} cells; "
            f"submit with --array={array_spec(len(cells))}"
        )
    return cells[index] + hydra_ovs


def array_spec(size: int) -> str:
    return "0" if size == 1 else f"0-{size - 1}"


def _index(text: str | None) -> int:
    text = text if text is not None else os.environ.get("SLURM_ARRAY_TASK_ID")
    if text is None:
        raise UserError("give the cell index, or run inside an array task (SLURM_ARRAY_TASK_ID)")
    try:
        return int(text)
    except ValueError:
        raise UserError(f"cell index {text!r} is not an integer") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rbs_bench.slurm", description=__doc__.splitlines()[0]
    )
    ap.add_argument("command", choices=("size", "array", "cell", "run"))
    ap.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="cell/run: [index] then overrides (index defaults to $SLURM_ARRAY_TASK_ID)",
    )
    ns = ap.parse_args(argv)
    args = list(ns.args)
    try:
        if ns.command in ("size", "array"):
            size = len(grid(args)[0])
            print(size if ns.command == "size" else array_spec(size))
            return 0
        given = args.pop(0) if args and args[0].lstrip("-").isdigit() else None
        run_args = cell_args(_index(given), args)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    if ns.command == "cell":
        print("\n".join(run_args))
        return 0
    from rbs_bench import __main__ as cli

    print(f"cell {_index(given)} ({sys.executable}): {' '.join(run_args)}", flush=True)
    sys.argv = [sys.argv[0], *run_args]
    cli.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
