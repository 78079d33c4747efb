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

Results go to `<calibration.dir>/<model>/<method>.yaml`, one entry per target and setting (the
method's fields other than its knob, and the calibration prompts' benchmark, task and length), with
the knob, mean/p50/p90 density over the prompts, the achieved error and the cost (seconds, model
forwards, prompts, device). `budget=<name>` in a run reads the entry of its own setting, and uses it
only if its density lies within its tolerance of its target (`entry_problem`). An entry that
already meets the tolerance on as many prompts is kept: rerunning is a no-op. Writers hold the
lock `<calibration.dir>/<model>/<method>.yaml.lock` (filelock: `flock`, see records.py) while they
re-read, merge and replace the file, so parallel calibrations of one method keep every entry.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
import torch
import yaml
from filelock import FileLock
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rbs_bench.budget import MAX_STEPS, KnobSearch, LayerCurves, Unreachable, knob_fields
from rbs_bench.config import (
    CONFIG_MODULE,
    UserError,
    out_of_time,
    preflight,
    register_schemas,
    report_user_errors,
    validate,
)
from rbs_bench.models.memory import use_expandable_segments

register_schemas()
IGNORED_FIELDS = ("impl",)  # fields that change how, not what, a method selects
# The farthest an entry the search could not bring within its tolerance (the density steps over
# the target) may lie from its target and still be used for it (entry_problem).
CLOSEST_SLACK = 0.01


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


def calibration_path(cfg) -> Path:
    return Path(cfg.calibration.dir) / cfg.model.name / f"{cfg.method.name}.yaml"


def _base(cfg):
    """The method at its configured knob (no budget read: bare look-ups have none)."""
    from rbs_bench.runner import build_method

    return build_method(cfg)


def setting(cfg, base=None) -> dict | None:
    """What a calibration holds for besides the target: the method's fields other than its knob,
    the prompts' benchmark, first task and first context length, and the weights' digest where the
    model has one (models.weights_digest). None without a benchmark."""
    from rbs_bench.models import weights_digest

    base = base or _base(cfg)
    bench = OmegaConf.select(cfg, "benchmark")
    if bench is None or base.knob is None:
        return None
    skip = knob_fields(base) | set(IGNORED_FIELDS)
    out = {
        "method": {k: v for k, v in base.fields().items() if k not in skip},
        "benchmark": bench.name,
        "task": bench.tasks[0],
        "context_length": int(bench.context_lengths[0]),
    }
    digest = weights_digest(cfg.model)
    return out | {"weights": digest} if digest else out


def _describe(s: dict | None) -> str:
    if not s:
        return "any setting"
    fields = ", ".join(f"{k}={v}" for k, v in s["method"].items())
    return f"{fields}; {s['benchmark']} {s['task']} at {s['context_length']} tokens"


def _read(path: Path) -> dict | None:
    return yaml.safe_load(path.read_text()) if path.exists() else None


def _entries(path: Path) -> list[dict]:
    """The entries of a calibration file; a file that is not such YAML is a one-line UserError
    naming the file, the line and the repair."""
    fix = f"repair it, or delete {path} and rerun python -m rbs_bench.calibrate to remake it"
    try:
        data = yaml.safe_load(path.read_text()) if path.exists() else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}{where} is not valid YAML ({problem}); {fix}") from None
    entries = (data or {}).get("entries", []) if isinstance(data, dict) or data is None else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("target"), (int, float)) and "knob" in e
        for e in entries
    ):
        raise UserError(
            f"{path} is not a calibration file (a mapping whose 'entries' list holds mappings "
            f"with target and knob); {fix}"
        )
    return entries


def find_entry(cfg, base=None) -> dict | None:
    """The stored entry for the run's target and setting. Without a benchmark in `cfg` (a bare
    lookup by model, method and target), the one entry at that target."""
    target = cfg.budget.target
    here = [
        e
        for e in _entries(calibration_path(cfg))
        if math.isclose(e["target"], target, rel_tol=1e-9, abs_tol=1e-12)
    ]
    want = setting(cfg, base)
    if want is not None:
        return next((e for e in here if e.get("setting") == want), None)
    if len(here) > 1:
        raise UserError(
            f"{calibration_path(cfg)} holds {len(here)} calibrations at density {target}: "
            + "; ".join(f"[{_describe(e.get('setting'))}]" for e in here)
            + "; name the benchmark and method fields of the one to use"
        )
    return here[0] if here else None


def _budget_args(cfg) -> str:
    from rbs_bench.config import group_options

    name, target = cfg.budget.name, cfg.budget.target
    args = f"budget.target={target:g}"
    return f"budget={name} {args}" if name in group_options("budget") else args


def load_knob(cfg) -> float:
    """The calibrated knob for the run's method at `budget.target` in the run's setting, or a
    UserError naming the command that makes it."""
    base = _base(cfg)
    entry = find_entry(cfg, base)
    path = calibration_path(cfg)
    if entry is not None:
        problem = entry_problem(entry, cfg.calibration.tolerance)
        if problem is None:
            return float(entry["knob"])
        raise UserError(
            f"{path}: the calibration of {cfg.method.name} at density {cfg.budget.target} "
            f"({_describe(setting(cfg, base))}) {problem}; recalibrate it with: "
            f"{calibrate_command(cfg)}"
        )
    raise UserError(
        f"no calibration of {cfg.method.name} at density {cfg.budget.target} for model "
        f"{cfg.model.name} ({_describe(setting(cfg, base))}) in {path}; create it with: "
        f"{calibrate_command(cfg)}"
    )


def calibrate_command(cfg) -> str:
    """The command that calibrates this cell, ready to paste: the run's own command-line
    overrides (experiment, results_dir, model, lengths, fields), with the cell's method and
    budget in place of any method or budget choice (a sweep among them)."""
    from hydra.core.hydra_config import HydraConfig

    from rbs_bench import config

    if HydraConfig.initialized():
        given = list(HydraConfig.get().overrides.task)
    else:
        given = list(config.COMMAND_OVERRIDES or [])
    from rbs_bench.config import group_options

    key = lambda o: o.split("=", 1)[0].lstrip("+~")
    cell = {"method", "budget", "budget.name", "budget.target", "budget.knob"}
    keep = [o for o in given if key(o) not in cell]
    if "model" not in map(key, keep) and cfg.model.name in group_options("model"):
        keep.append(f"model={cfg.model.name}")  # the same model, whatever chose it
    args = keep + [f"method={cfg.method.name}", *_budget_args(cfg).split()]
    return " ".join(["python -m rbs_bench.calibrate", *map(shlex.quote, args)])


def entry_problem(entry: dict, tolerance: float) -> str | None:
    """Why a stored entry cannot stand for its target (None if it can).

    Its mean density must lie within its tolerance (the one it was calibrated under, else
    `tolerance`) of its target. An entry the search could not bring that close (the density steps
    over the target, or the steps ran out) is the closest the knob reaches and is used when its
    recorded error is the distance between its density and its target and that distance is at
    most CLOSEST_SLACK: an entry whose density belongs to another target fails both."""
    if not isinstance(entry.get("density_mean"), (int, float)):
        return "records no density_mean, so nothing shows its knob gives that density"
    target, density = float(entry["target"]), float(entry["density_mean"])
    tol = float(entry.get("tolerance", tolerance))
    err = abs(density - target)
    if err <= tol:
        return None
    closest = math.isclose(err, float(entry.get("abs_error", -1)), rel_tol=1e-6, abs_tol=1e-12)
    if closest and err <= CLOSEST_SLACK:
        return None
    return (
        f"records density {density:.4f}, {err:.4f} from its target (tolerance {tol:g}"
        + (f", recorded error {float(entry['abs_error']):.2g}" if "abs_error" in entry else "")
        + "), so its knob belongs to another density"
    )


def store(cfg, entry: dict) -> Path:
    """Add `entry` to the method's calibration file, replacing the entry of the same target and
    setting. Concurrent writers (a SLURM array of calibrations) each hold the file's lock
    `<method>.yaml.lock` while they re-read the file, merge and write it through their own temp
    file, so no writer's entry is lost."""
    path = calibration_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _read(path) or {"model": cfg.model.name, "method": cfg.method.name, "entries": []}
        same = lambda e: e["target"] == entry["target"] and e.get("setting") == entry.get("setting")
        data["entries"] = [e for e in data.get("entries") or [] if not same(e)] + [entry]
        data["entries"].sort(key=lambda e: (e["target"], yaml.safe_dump(e.get("setting"))))
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
        ) as tmp:
            tmp.write(yaml.safe_dump(data, sort_keys=False))
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    return path


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
    from rbs_bench import benchmarks
    from rbs_bench.execution import resolve_executor
    from rbs_bench.runner import _check_benchmark, _input_ids, build_selector

    if cfg.budget.target is None:
        return None
    base = build_selector(cfg, apply_budget=False)
    if base.knob is None:
        return None
    _check_benchmark(cfg)
    where = setting(cfg, base)
    old = find_entry(cfg, base)
    if (
        old is not None
        and entry_problem(old, cfg.calibration.tolerance) is None  # else it is redone
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
    prompts = [_input_ids(loaded, s) for s in samples]
    executor = resolve_executor(cfg.executor, loaded.device)
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
            "gpus": 1 if loaded.device.type == "cuda" else 0,
            "tolerance": float(cfg.calibration.tolerance),
            "date": time.strftime("%Y-%m-%d"),
            "setting": where,
        }
    )
    path = store(cfg, entry)
    print(
        f"{cfg.method.name} @ {cfg.budget.target:.4f}: {entry['knob_name']}={entry['knob']:.6g}"
        f" -> density {entry['density_mean']:.5f} (error {entry['abs_error']:.2e}, "
        f"{entry['steps']} steps, {entry['forwards']} forwards, {entry['seconds']} s) -> {path}"
    )
    return entry


def run(cfg: DictConfig) -> None:
    from rbs_bench.__main__ import grid_overrides
    from rbs_bench.checks import check_cell
    from rbs_bench.runner import Session

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
    use_expandable_segments()
    preflight(sys.argv[1:], calibrating=True)
    _hydra_main()


if __name__ == "__main__":
    main()
