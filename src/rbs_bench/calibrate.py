"""Calibrate each method's knob to a target measured density, and store the result.

    python -m rbs_bench.calibrate method=rbs budget=d5          # one method, one target
    python -m rbs_bench.calibrate +experiment=ruler_budget      # every method x budget of the grid

Density is measured as the runs measure it: kept / causal block pairs, averaged over the layers and
heads of a prompt, then over `calibration.num_prompts` prompts of the run's benchmark at its first
context length.

The search runs the method inside the model, one forward per prompt and step, and scores every
layer's blocks once per step: from the stored scores it evaluates the layer's density at many knob
values at once (a density curve), and the next step's knob is where the curve meets the target.
For the relative-threshold selectors (rbs, centroid, full_l2, flashprefill) the curve is exact:
each candidate block pair enters at one critical knob, L[i, b] - max_b' L[i, b'] against
log(alpha), so a sorted list of those critical values gives the density at any knob. Other methods
select once per knob value of a short grid. Because the curve is taken on the layer's activations
as they are with the method running, its value at the step's knob is exactly the density the run
measures; the in-run densities of the steps also bracket the knob, and a step whose curve guess
falls outside the bracket bisects it instead. The search stops within `calibration.tolerance`.

Results go to the calibration store (calibrations.py): `<calibration.dir>/<model>/<method>.yaml`,
one entry per target and setting. An entry that already meets the tolerance on as many prompts is
kept: rerunning is a no-op.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from rbs_bench import benchmarks, models
from rbs_bench.budget import MAX_STEPS, KnobSearch, LayerCurves, Unreachable
from rbs_bench.calibrations import (
    calibration_path,
    entry_problem,
    find_entry,
    provenance_problem,
    setting,
    store,
)
from rbs_bench.checks import check_cell, preflight
from rbs_bench.config import (
    CONFIG_MODULE,
    grid_overrides,
    out_of_time,
    register_schemas,
    report_user_errors,
    validate,
)
from rbs_bench.errors import UserError, stop_on_signals
from rbs_bench.execution import resolve_executor
from rbs_bench.models.memory import use_expandable_segments
from rbs_bench.session import Session, build_selector, check_benchmark, input_ids

register_schemas()


@dataclass
class CurveProbe:
    """Runs `run` in every prefill layer and records `base`'s density at each of `values` there.

    Per prompt, `curves` gets the mean over layers of the layer densities [V]. The layer attends
    `run`'s selection, so the curve is taken on the activations of a real run at that knob.
    """

    run: object
    base: object
    values: list[float]
    curves: list[np.ndarray] = field(default_factory=list)
    _layers: LayerCurves | None = None

    is_dense = False
    name = "curve_probe"

    @property
    def block_size(self) -> int:
        return self.run.block_size

    def select(self, q, k, scale=None):
        sel = self.run.select(q, k, scale=scale)
        if self._layers is None:
            self._layers = LayerCurves({0: (self.base, self.values)})
        self._layers.add(q, k, scale)
        return sel

    def end_prompt(self) -> None:
        self.curves.append(self._layers.mean(0))
        self._layers = None


def probe(loaded, prompts, base, knob: float, values, executor: str):
    """One in-run step: (per-prompt density [P] with `base` at `knob` running, curves [P, V])."""
    from rbs_bench.models.hf_attention import install, uninstall

    sweep = CurveProbe(base.with_knob(knob), base, list(values))
    recorder = install(loaded.model, sweep, executor)
    dens = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                recorder.reset()
                # the logits of the last position only: a long prompt's full logits would not fit
                loaded.model(input_ids=ids.to(loaded.device), use_cache=False, logits_to_keep=1)
                dens.append(recorder.summary()["density_mean"])
                sweep.end_prompt()
    finally:
        uninstall(loaded.model)
    return np.asarray(dens), np.asarray(sweep.curves)


def calibrate_target(
    loaded, prompts, base, target: float, tol: float, executor: str, progress: bool = False
) -> dict:
    """Find the knob whose in-run mean density over the prompts is within `tol` of `target`.

    With `progress`, a bar counts the steps (at most MAX_STEPS) and shows each step's knob and
    measured density."""
    search = KnobSearch(base, target, tol)
    bar = tqdm(
        total=MAX_STEPS,
        desc=f"calibrate {base.name} @ {target:.4f}",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    )
    try:
        while not search.done:
            knob = search.knob
            dens, curves = probe(loaded, prompts, base, knob, search.values, executor)
            search.update(dens, curves.mean(0))
            bar.update(1)
            bar.set_postfix({base.knob: f"{knob:.5g}", "density": f"{dens.mean():.5f}"})
    except Unreachable as e:
        raise UserError(str(e)) from None
    finally:
        bar.close()
    warning = search.warning()
    if warning:
        print(f"rbs-bench: warning: {warning}", file=sys.stderr)
    entry = search.result()
    return entry | {"forwards": entry["steps"] * len(prompts)}


# ------------------------------------------------------------------------------------------------
# Stored calibrations.


def _wanted_prompts(cfg) -> int:
    n = cfg.benchmark.num_samples
    return cfg.calibration.num_prompts if n <= 0 else min(cfg.calibration.num_prompts, n)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def calibrate_cell(cfg, session) -> dict | None:
    """Calibrate one (method, budget) cell of the config; None when there is nothing to fit.

    An entry for the same target and setting that meets `calibration.tolerance` on as many
    prompts is returned as it is, without loading the model."""
    if cfg.budget.target is None:
        return None
    base = build_selector(cfg, apply_budget=False)
    if base.knob is None:
        return None
    check_benchmark(cfg)
    where = setting(cfg, base)
    old = find_entry(cfg, base)
    if (
        old is not None
        and provenance_problem(old, cfg) is None  # an edited or foreign entry is redone
        and entry_problem(old, cfg.calibration.tolerance) is None  # and so is a poor one
        # met the tolerance, or was the closest reachable under this same tolerance (the density
        # steps over the target): either way a rerun would find the same knob
        and (
            old["abs_error"] <= cfg.calibration.tolerance
            or old.get("tolerance") == cfg.calibration.tolerance
        )
        and old.get("prompts", 0) >= _wanted_prompts(cfg)
    ):
        print(
            f"{cfg.method.name} @ {cfg.budget.target:.4f}: already calibrated "
            f"({old['knob_name']}={old['knob']:.6g}, error {old['abs_error']:.2e}) in "
            f"{calibration_path(cfg)}"
        )
        return old
    loaded = session.load(cfg)
    task, length = cfg.benchmark.tasks[0], cfg.benchmark.context_lengths[0]
    benchmarks.get(cfg.benchmark.name)  # fails early on an unknown benchmark
    samples = session.samples(cfg, loaded, task, length)[: cfg.calibration.num_prompts]
    if not samples:
        raise UserError("no calibration prompts: raise benchmark.num_samples")
    prompts = [input_ids(loaded, s) for s in samples]
    executor = resolve_executor(cfg.executor, loaded.device)
    # the compiled layers' graphs and their autotuning, once per process and prompt length, are
    # not part of a calibration's cost: its seconds scale with the prompts (scale report)
    session.warm_once(loaded, samples[0])
    t0 = time.perf_counter()
    entry = calibrate_target(
        loaded,
        prompts,
        base,
        cfg.budget.target,
        cfg.calibration.tolerance,
        executor,
        progress=cfg.progress,
    )
    entry.update(
        {
            "prompts": len(prompts),
            "task": task,
            "context_length": length,
            "seconds": round(time.perf_counter() - t0, 2),
            "device": _device_name(loaded.device),
            "gpus": len(models.cuda_devices(loaded.model)),  # several with device_map=auto
            "tolerance": float(cfg.calibration.tolerance),
            "date": time.strftime("%Y-%m-%d"),
            "setting": where,
        }
    )
    path = store(cfg, entry)
    print(
        f"{cfg.method.name} @ {cfg.budget.target:.4f}: {entry['knob_name']}={entry['knob']:.6g}"
        f" -> density {entry['density_mean']:.5f} (error {entry['abs_error']:.2e}, "
        f"{entry['steps']} steps, {entry['forwards']} forwards, {entry['seconds']} s; "
        f"{entry['prompts']} prompts of {entry['context_length']} tokens on {entry['gpus'] or 1} "
        f"{entry['device']}) -> {path}"
    )
    return entry


def run(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    cells = [
        hydra.compose(config_name="config", overrides=list(hc.overrides.task) + grid)
        for grid in grid_overrides(hc)
    ]
    experiment = hc.runtime.choices.get("experiment") or "adhoc"
    for cell in cells:  # every cell, before the first one loads a model
        validate(cell)
        check_cell(cell, experiment, calibrating=True)
    session = Session()
    done = 0
    for i, cell in enumerate(cells):
        if out_of_time(cell):
            print(
                f"time_budget_s={cell.time_budget_s:g} reached with {len(cells) - i} cells left; "
                "rerun the same command to continue (finished calibrations are kept)"
            )
            return
        done += calibrate_cell(cell, session) is not None
    if not done:
        raise UserError(
            "nothing to calibrate: pick a budget with a target (e.g. budget=d5) "
            "and a method with a knob"
        )


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    report_user_errors(run, cfg)


def main() -> None:
    stop_on_signals()  # SIGINT, SIGTERM: one line, exit status 130 / 143
    use_expandable_segments()
    preflight(sys.argv[1:], calibrating=True)
    _hydra_main()


if __name__ == "__main__":
    main()
