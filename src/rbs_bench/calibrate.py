"""Calibrate each method's knob to a target measured density, and store the result.

    python -m rbs_bench.calibrate method=rbs budget=d5          # one method, one target
    python -m rbs_bench.calibrate +experiment=ruler_budget      # every method x budget of the grid

Density is measured as the runs measure it: kept / causal block pairs, averaged over the layers and
heads of a prompt, then over `calibration.num_prompts` prompts of the run's benchmark at its first
context length. Search in two stages: (1) sweeps, each one model forward per prompt in which every
layer's Q/K are scored at every knob value of a grid while the layer attends densely, narrow the
knob to a bracket; (2) bisection inside the bracket with the method itself running, one forward per
prompt and step, until the in-run mean density is within `calibration.tolerance` of the target.

Results go to `<calibration.dir>/<model>/<method>.yaml`, one entry per target (knob, mean/p50/p90
density, achieved error); `budget=<name>` in a run reads them.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rbs_bench.config import (
    CONFIG_MODULE,
    UserError,
    preflight,
    register_schemas,
    report_user_errors,
    validate,
)
from rbs_bench.methods.selection import BlockSelection

register_schemas()
GRID = 12  # knob values per sweep


def knob_grid(selector, lo: float, hi: float, n: int = GRID) -> list[float]:
    """n knob values spanning [lo, hi]: geometric for open-ended knobs, linear for fractions."""
    if getattr(selector, "knob_range", (1e-4, 1e3))[0] > 0:
        return np.geomspace(lo, hi, n).tolist()
    return np.linspace(lo, hi, n).tolist()


@dataclass
class KnobSweep:
    """A selector that measures `base` at many knob values and keeps every block.

    Each prefill layer's Q/K are selected once per value; per prompt, the mean head density of
    every value is collected in `densities`. The full selection it returns makes the layer dense.
    """

    base: object
    values: list[float]
    densities: list[list[float]] = field(default_factory=list)  # [prompt][value]
    _sums: np.ndarray | None = None
    _count: int = 0

    is_dense = False
    name = "knob_sweep"

    @property
    def block_size(self) -> int:
        return self.base.block_size

    def select(self, q, k, scale=None) -> BlockSelection:
        dens = [self.base.with_knob(v).select(q, k, scale=scale).density() for v in self.values]
        self._sums = np.asarray(dens) if self._sums is None else self._sums + dens
        self._count += 1
        b, h, n, _ = q.shape
        return BlockSelection.full(b, h, n, self.block_size, q.device)

    def end_prompt(self) -> None:
        self.densities.append((self._sums / self._count).tolist())
        self._sums, self._count = None, 0


def sweep(loaded, prompts, base, values, executor: str) -> np.ndarray:
    """Mean density [prompt, value] of `base` at each knob value over the calibration prompts."""
    from rbs_bench.models.hf_attention import install, uninstall

    probe = KnobSweep(base, list(values))
    install(loaded.model, probe, executor)
    try:
        with torch.inference_mode():
            for ids in prompts:
                loaded.model(input_ids=ids.to(loaded.device), use_cache=False)
                probe.end_prompt()
    finally:
        uninstall(loaded.model)
    return np.asarray(probe.densities)


def in_run_density(loaded, prompts, selector, executor: str) -> np.ndarray:
    """Per-prompt mean density with `selector` running sparse, exactly as a run measures it."""
    from rbs_bench.models.hf_attention import install, uninstall

    recorder = install(loaded.model, selector, executor)
    out = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                recorder.reset()
                loaded.model(input_ids=ids.to(loaded.device), use_cache=False)
                out.append(recorder.summary()["density_mean"])
    finally:
        uninstall(loaded.model)
    return np.asarray(out)


def calibrate_target(loaded, prompts, base, target: float, tol: float, executor: str) -> dict:
    """Find the knob whose in-run mean density over the prompts is within `tol` of `target`.

    Dense-activation sweeps bracket the knob cheaply (one forward scores every grid value); the
    bracket is then bisected on the density measured with the method running, since each
    layer's sparse output shifts the next layer's selection a little.
    """
    lo, hi = getattr(base, "knob_range", (1e-4, 1e3))
    log = lo > 0
    sweeps = 0
    while True:
        values = knob_grid(base, lo, hi)
        means = sweep(loaded, prompts, base, values, executor).mean(0)
        sweeps += 1
        if sweeps == 1 and not means.min() - tol <= target <= means.max() + tol:
            raise UserError(
                f"{base.name} cannot reach density {target:.4f} here: its knob {base.knob} "
                f"spans densities {means.min():.4f}-{means.max():.4f} on these prompts (forced "
                "blocks alone set the floor); pick a target in that range"
            )
        # bracket the target between neighbouring grid values (density is monotone in the knob)
        order = np.argsort(values)
        v, m = np.asarray(values)[order], means[order]
        above = (m >= target) if base.knob_direction < 0 else (m <= target)
        j = int(np.flatnonzero(above).max()) if above.any() else 0
        lo, hi = float(v[j]), float(v[min(j + 1, len(v) - 1)])
        if sweeps >= 3 or np.abs(m - target).min() <= tol / 4 or lo == hi:
            break
    # widen by one grid step each side: the in-run density may sit just outside the bracket
    step = (hi / lo) if log and lo > 0 else (hi - lo)
    lo, hi = (lo / step, hi * step) if log and lo > 0 else (lo - step, hi + step)
    lo, hi = max(lo, base.knob_range[0] if hasattr(base, "knob_range") else 0.0), hi
    best = None
    for _ in range(24):
        mid = math.sqrt(lo * hi) if log and lo > 0 else (lo + hi) / 2
        dens = in_run_density(loaded, prompts, base.with_knob(mid), executor)
        if best is None or abs(dens.mean() - target) < abs(best[1].mean() - target):
            best = (mid, dens)
        if abs(dens.mean() - target) <= tol:
            break
        too_dense = dens.mean() > target
        if too_dense == (base.knob_direction < 0):
            lo = mid
        else:
            hi = mid
    knob, per_prompt = best
    return {
        "target": float(target),
        "knob": float(knob),
        "knob_name": base.knob,
        "density_mean": float(per_prompt.mean()),
        "density_p50": float(np.median(per_prompt)),
        "density_p90": float(np.quantile(per_prompt, 0.9)),
        "abs_error": float(abs(per_prompt.mean() - target)),
        "sweeps": sweeps,
    }


def calibration_path(cfg) -> Path:
    return Path(cfg.calibration.dir) / cfg.model.name / f"{cfg.method.name}.yaml"


def load_knob(cfg) -> float:
    """The calibrated knob for the run's method at `budget.target`, or a UserError saying how to
    make it."""
    path = calibration_path(cfg)
    entries = yaml.safe_load(path.read_text()) if path.exists() else None
    for e in (entries or {}).get("entries", []):
        if math.isclose(e["target"], cfg.budget.target, rel_tol=1e-9):
            return float(e["knob"])
    raise UserError(
        f"no calibration of {cfg.method.name} at density {cfg.budget.target} for model "
        f"{cfg.model.name} in {path}; create it with: python -m rbs_bench.calibrate "
        f"model={cfg.model.name} method={cfg.method.name} budget={cfg.budget.name}"
    )


def store(cfg, entry: dict) -> Path:
    path = calibration_path(cfg)
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    data = data or {"model": cfg.model.name, "method": cfg.method.name, "entries": []}
    data["entries"] = [e for e in data["entries"] if e["target"] != entry["target"]] + [entry]
    data["entries"].sort(key=lambda e: e["target"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path


def calibrate_cell(cfg, session) -> dict | None:
    """Calibrate one (method, budget) cell of the config; None when there is nothing to fit."""
    from rbs_bench import benchmarks
    from rbs_bench.execution import resolve_executor
    from rbs_bench.runner import _input_ids, build_selector

    if cfg.budget.target is None:
        return None
    base = build_selector(cfg, apply_budget=False)
    if base.knob is None:
        return None
    t0 = time.perf_counter()
    loaded = session.load(cfg)
    task, length = cfg.benchmark.tasks[0], cfg.benchmark.context_lengths[0]
    benchmarks.get(cfg.benchmark.name)  # fails early on an unknown benchmark
    samples = session.samples(cfg, loaded, task, length)[: cfg.calibration.num_prompts]
    if not samples:
        raise UserError("no calibration prompts: raise benchmark.num_samples")
    prompts = [_input_ids(loaded, s) for s in samples]
    executor = resolve_executor(cfg.executor, loaded.device)
    entry = calibrate_target(
        loaded, prompts, base, cfg.budget.target, cfg.calibration.tolerance, executor
    )
    entry.update(
        {
            "prompts": len(prompts),
            "task": task,
            "context_length": length,
            "seconds": round(time.perf_counter() - t0, 2),
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    path = store(cfg, entry)
    print(
        f"{cfg.method.name} @ {cfg.budget.target:.4f}: {entry['knob_name']}={entry['knob']:.6g}"
        f" -> density {entry['density_mean']:.5f} (error {entry['abs_error']:.2e}, "
        f"{entry['sweeps']} sweeps, {entry['seconds']} s) -> {path}"
    )
    return entry


def run(cfg: DictConfig) -> None:
    from rbs_bench.__main__ import grid_overrides
    from rbs_bench.runner import Session

    hc = HydraConfig.get()
    cells = [
        hydra.compose(config_name="config", overrides=list(hc.overrides.task) + grid)
        for grid in grid_overrides(hc)
    ]
    session = Session()
    done = 0
    for cell in cells:
        validate(cell)
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
    preflight(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
