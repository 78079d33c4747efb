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
forwards, prompts, device). `budget=<name>` in a run reads the entry of its own setting. An entry
that already meets the tolerance on as many prompts is kept: rerunning is a no-op.
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
from omegaconf import DictConfig, OmegaConf

from rbs_bench.config import (
    CONFIG_MODULE,
    UserError,
    preflight,
    register_schemas,
    report_user_errors,
    validate,
)
from rbs_bench.kernels.block_scores import block_scores_ref
from rbs_bench.kernels.block_stats import block_stats_ref, rescue_beta_ref
from rbs_bench.methods.rbs import ALPHA_BASE, ALPHA_RESCUE, RBS, Centroid, FullL2
from rbs_bench.methods.selection import (
    candidate_mask,
    causal_block_mask,
    forced_mask,
    num_blocks,
)

register_schemas()
GRID = 12  # knob values per step for methods that select once per value
FINE_GRID = 1025  # knob values per step of an exact (threshold) density curve
MAX_STEPS = 16  # in-run steps before giving up on the tolerance
MIN_BRACKET = 1e-4  # a knob bracket this narrow (share of the range) holds a step of the density
DEFAULT_RANGE = (1e-4, 1e3)  # knob range of methods that do not declare one (thresholds)
IGNORED_FIELDS = ("impl",)  # fields that change how, not what, a method selects


def knob_range(selector) -> tuple[float, float]:
    return tuple(getattr(selector, "knob_range", DEFAULT_RANGE))


def knob_grid(selector, lo: float, hi: float, n: int = GRID) -> list[float]:
    """n knob values spanning [lo, hi]: geometric for open-ended knobs, linear for fractions."""
    if knob_range(selector)[0] > 0:
        return np.geomspace(lo, hi, n).tolist()
    return np.linspace(lo, hi, n).tolist()


def knob_value(selector) -> float | None:
    """The knob value a selector is set to (rbs: its scale s), or None."""
    value = getattr(selector, selector.knob, None)
    return float(value) if isinstance(value, (int, float)) else None


def knob_fields(selector) -> set[str]:
    """The fields that moving the knob changes (rbs: both thresholds)."""
    lo, hi = knob_range(selector)
    a, b = knob_grid(selector, lo, hi, 5)[1:4:2]
    fa, fb = selector.with_knob(a).fields(), selector.with_knob(b).fields()
    return {f for f in fa if fa[f] != fb.get(f)}


# ------------------------------------------------------------------------------------------------
# Density curves: the density of one layer at many knob values from one scoring.


def exact_curve_supported(selector) -> bool:
    return isinstance(selector, (RBS, Centroid, FullL2))


def threshold_curve(selector, q, k, scale, values) -> np.ndarray | None:
    """Density [V] of `selector` re-knobbed to each of `values`, exact, for the relative-threshold
    selectors (None for any other method).

    q [B, Hq, N, D], k [B, Hkv, N, D]. A candidate pair (i, b) is kept at threshold alpha iff
    log(alpha) <= L[i, b] - max_b' L[i, b']; for rbs at scale s iff log(s) is at most the larger
    of the two branches' gaps less log(0.22) and log(0.18). A branch's top block (gap 0) and the
    forced pairs are kept at every knob value of the range.
    """
    if not exact_curve_supported(selector):
        return None
    bs, n, dev = selector.block_size, q.shape[2], q.device
    centroid, radius = block_stats_ref(k, bs)
    if isinstance(selector, RBS):
        uplifts = [None, radius * rescue_beta_ref(radius)]
        offsets = [math.log(ALPHA_BASE), math.log(ALPHA_RESCUE)]
    else:
        uplifts = [radius if selector.full_bound else None]
        offsets = [0.0]
    scores = block_scores_ref(q, centroid, uplifts, bs, scale)  # each fp32 [B, Hq, M, M]
    m = num_blocks(n, bs)
    cand = candidate_mask(m, dev)
    causal = causal_block_mask(n, bs, bs, dev)
    forced = forced_mask(
        m, selector.sink_blocks, selector.window_blocks, selector.last_q_blocks, dev
    )
    forced = forced & causal
    free = cand & ~forced
    crit = None
    for s, offset in zip(scores, offsets):
        masked = s.masked_fill(~cand, -math.inf)
        gap = masked - masked.amax(-1, keepdim=True)
        # a branch's top block is kept over the whole knob range (alpha is at most 1)
        gap = torch.where(gap == 0, math.inf, gap - offset)
        crit = gap if crit is None else torch.maximum(crit, gap)
    heads = q.shape[0] * q.shape[1]
    critical = crit[..., free].reshape(-1).sort().values  # [heads * free pairs]
    log_v = torch.log(torch.as_tensor(values, dtype=torch.float64, device=dev)).to(critical.dtype)
    kept = critical.numel() - torch.searchsorted(critical, log_v)  # pairs with log(v) <= critical
    total = heads * int(causal.sum())
    return ((heads * int(forced.sum()) + kept).double() / total).cpu().numpy()


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
    _sum: np.ndarray | None = None
    _count: int = 0

    is_dense = False
    name = "curve_probe"

    @property
    def block_size(self) -> int:
        return self.run.block_size

    def select(self, q, k, scale=None):
        sel = self.run.select(q, k, scale=scale)
        curve = threshold_curve(self.base, q, k, scale, self.values)
        if curve is None:
            curve = np.asarray(
                [self.base.with_knob(v).select(q, k, scale=scale).density() for v in self.values]
            )
        self._sum = curve if self._sum is None else self._sum + curve
        self._count += 1
        return sel

    def end_prompt(self) -> None:
        self.curves.append(self._sum / self._count)
        self._sum, self._count = None, 0


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
                loaded.model(input_ids=ids.to(loaded.device), use_cache=False)
                dens.append(recorder.summary()["density_mean"])
                sweep.end_prompt()
    finally:
        uninstall(loaded.model)
    return np.asarray(dens), np.asarray(sweep.curves)


def _grid(selector, lo: float, hi: float, n: int, knob: float) -> list[float]:
    return sorted(set(knob_grid(selector, lo, hi, n)) | {knob})


def _x(v: float, log: bool) -> float:
    return math.log(v) if log else v


def _mid(lo: float, hi: float, log: bool) -> float:
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def _open(lo: float, hi: float, full: tuple[float, float], log: bool) -> bool:
    """Whether the bracket [lo, hi] is still wider than MIN_BRACKET of the knob's range."""
    if log:
        return math.log(hi / lo) > MIN_BRACKET * math.log(full[1] / full[0])
    return hi - lo > MIN_BRACKET * (full[1] - full[0])


def invert(values, curve, target: float, log: bool) -> float | None:
    """The knob where the piecewise-linear curve (in log knob for open-ended knobs) first meets
    `target`, or None when the curve stays on one side of it."""
    v, c = np.asarray(values, dtype=float), np.asarray(curve, dtype=float) - target
    hits = np.flatnonzero(c == 0)
    if len(hits):
        return float(v[hits[0]])
    cross = np.flatnonzero(np.sign(c[:-1]) != np.sign(c[1:]))
    if not len(cross):
        return None
    j = cross[0]
    x0, x1 = _x(v[j], log), _x(v[j + 1], log)
    x = x0 + (x1 - x0) * c[j] / (c[j] - c[j + 1])
    return float(math.exp(x) if log else x)


def _window(values, curve, target: float, lo: float, hi: float) -> tuple[float, float]:
    """Where the next short grid goes: two grid steps either side of the curve's crossing of
    the target, inside the bracket [lo, hi] (the whole bracket when it does not cross)."""
    c = np.asarray(curve, dtype=float) - target
    cross = np.flatnonzero((np.sign(c[:-1]) != np.sign(c[1:])) | (c[:-1] == 0))
    if not len(cross):
        return lo, hi
    j = int(cross[0])
    wlo, whi = values[max(j - 2, 0)], values[min(j + 3, len(values) - 1)]
    return max(lo, wlo), min(hi, whi)


def calibrate_target(loaded, prompts, base, target: float, tol: float, executor: str) -> dict:
    """Find the knob whose in-run mean density over the prompts is within `tol` of `target`."""
    lo, hi = knob_range(base)
    log = lo > 0
    n_values = FINE_GRID if exact_curve_supported(base) else GRID
    start = knob_value(base)
    knob = min(max(start if start is not None else _mid(lo, hi, log), lo), hi)
    values = _grid(base, lo, hi, n_values, knob)
    blo, bhi, steps = lo, hi, 0
    near = {}  # side of the target ("below"/"above") -> the closest (knob, per-prompt densities)
    while steps < MAX_STEPS:
        dens, curves = probe(loaded, prompts, base, knob, values, executor)
        steps += 1
        mean, curve = float(dens.mean()), curves.mean(0)
        side = "below" if mean < target else "above"
        if side not in near or abs(mean - target) < abs(near[side][1].mean() - target):
            near[side] = (knob, dens)
        if steps == 1 and not curve.min() - tol <= target <= curve.max() + tol:
            raise UserError(
                f"{base.name} cannot reach density {target:.4f} here: its knob {base.knob} "
                f"spans densities {curve.min():.4f}-{curve.max():.4f} on these prompts (the "
                "forced blocks set the floor, and the knob saturates at its range's ends); pick "
                "a target in that range"
            )
        if abs(mean - target) <= tol:
            break
        if (mean > target) == (base.knob_direction < 0):
            blo = knob  # too dense, and a larger knob keeps fewer (or too sparse, and the reverse)
        else:
            bhi = knob
        if not _open(blo, bhi, (lo, hi), log):
            break  # the density steps over the target inside a bracket this narrow
        guess = invert(values, curve, target, log)
        knob = guess if guess is not None and blo < guess < bhi else _mid(blo, bhi, log)
        wlo, whi = _window(values, curve, target, blo, bhi) if n_values == GRID else (blo, bhi)
        values = _grid(base, wlo, whi, n_values, knob)
    knob, per_prompt = min(near.values(), key=lambda kd: abs(kd[1].mean() - target))
    error = abs(float(per_prompt.mean()) - target)
    extra = {}
    if error > tol:
        extra["neighbours"] = {
            side: {"knob": float(near[side][0]), "density_mean": float(near[side][1].mean())}
            for side in ("below", "above")
            if side in near
        }
        sides = "; ".join(
            f"{v['density_mean']:.5f} at {base.knob}={v['knob']:.6g}"
            for v in extra["neighbours"].values()
        )
        why = (
            f"the density steps over the target between {sides}; no knob value gives a "
            "density in between on these prompts"
            if not _open(blo, bhi, (lo, hi), log)
            else f"stopped after {MAX_STEPS} steps; closest on each side: {sides}"
        )
        print(
            f"rbs-bench: warning: {base.name} at density {target:.4f}: closest "
            f"{per_prompt.mean():.5f} (error {error:.2e} > calibration.tolerance {tol:g}); {why}",
            file=sys.stderr,
        )
    return {
        "target": float(target),
        "knob": float(knob),
        "knob_name": base.knob,
        "density_mean": float(per_prompt.mean()),
        "density_p50": float(np.median(per_prompt)),
        "density_p90": float(np.quantile(per_prompt, 0.9)),
        "abs_error": error,
        "steps": steps,
        "forwards": steps * len(prompts),
        **extra,
    }


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


def _entries(path: Path) -> list[dict]:
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    return (data or {}).get("entries", [])


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
    if entry is not None:
        return float(entry["knob"])
    path = calibration_path(cfg)
    raise UserError(
        f"no calibration of {cfg.method.name} at density {cfg.budget.target} for model "
        f"{cfg.model.name} ({_describe(setting(cfg, base))}) in {path}; create it with: "
        f"python -m rbs_bench.calibrate model={cfg.model.name} method={cfg.method.name} "
        f"{_budget_args(cfg)} and the run's other arguments (e.g. its +experiment=...)"
    )


def store(cfg, entry: dict) -> Path:
    path = calibration_path(cfg)
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    data = data or {"model": cfg.model.name, "method": cfg.method.name, "entries": []}
    same = lambda e: e["target"] == entry["target"] and e.get("setting") == entry.get("setting")
    data["entries"] = [e for e in data["entries"] if not same(e)] + [entry]
    data["entries"].sort(key=lambda e: (e["target"], yaml.safe_dump(e.get("setting"))))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
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
        loaded, prompts, base, cfg.budget.target, cfg.calibration.tolerance, executor
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
