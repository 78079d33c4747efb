"""The knob search: which knob value gives a method a target measured density.

Every caller drives the same search (`KnobSearch`) with its own measurement:

- `rbs_bench.calibrate` runs the method inside the model on the calibration prompts and reads the
  density each prompt measures at the step's knob (the run's own definition);
- `rbs_bench.bench.ttft` scores every layer of one dense prefill, one layer at a time, for several
  methods at once.

A step measures two things: the density at the step's knob, and a density curve, the same
activations' density at many knob values at once (`density_curve`). A selector may bring its own
curve from one scoring (a `density_curve` method); one whose curve is exact at every knob value
(`exact_curve = True`: the relative-threshold family of methods/rbs.py, where each candidate block
pair enters at one critical knob) is read on a fine grid. Other methods select once per knob
value of a short grid. The next knob is where the curve meets the target, inside the bracket that
the steps' measured densities leave (bisection otherwise), until the density is within the
tolerance.

Nothing here imports Hydra: the benchmarks under `bench/` run on GPU machines without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

GRID = 12  # knob values per step for methods that select once per value
FINE_GRID = 1025  # knob values per step of an exact (threshold) density curve
MAX_STEPS = 16  # steps before giving up on the tolerance
MIN_BRACKET = 1e-4  # a knob bracket this narrow (share of the range) holds a step of the density


class Unreachable(ValueError):
    """The target lies outside the densities the knob can give on these inputs."""


def knob_range(selector) -> tuple[float, float]:
    """Where calibration searches the knob: the selector's own `knob_range`, which every method
    with a knob declares (the registry checks it against the knob field's check)."""
    return tuple(selector.knob_range)


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
    """Whether the selector's own `density_curve` is exact at every knob value (the RBS family):
    the search then reads it on a fine grid."""
    return bool(getattr(selector, "exact_curve", False))


def density_curve(selector, q, k, scale, values) -> np.ndarray:
    """Density [V] of `selector` at each knob value on one layer's q [B, Hq, N, D], k (a selector
    with its own `density_curve` computes it from one scoring)."""
    own = getattr(selector, "density_curve", None)
    if own is not None:
        return own(q, k, scale, values)
    return np.asarray([selector.with_knob(v).select(q, k, scale=scale).density() for v in values])


@dataclass
class LayerCurves:
    """Mean over layers of `density_curve` for several searches at once: call `add` in every
    layer of a forward (it reads the layer and keeps only the curve), then `mean(key)`."""

    wanted: dict  # key -> (selector, values)
    _sum: dict = field(default_factory=dict)
    _count: int = 0

    def add(self, q, k, scale=None) -> None:
        """Score one layer for every search."""
        for key in self.wanted:
            self.add_one(key, q, k, scale)
        self.next_layer()

    def add_one(self, key, q, k, scale=None) -> None:
        """Score one layer for one search (call `next_layer` once the layer is done)."""
        selector, values = self.wanted[key]
        curve = density_curve(selector, q, k, scale, values)
        self._sum[key] = curve if key not in self._sum else self._sum[key] + curve

    def next_layer(self) -> None:
        self._count += 1

    def mean(self, key) -> np.ndarray:
        if not self._count:
            raise RuntimeError("no layer was scored: the model ran no prefill attention")
        return self._sum[key] / self._count


# ------------------------------------------------------------------------------------------------
# The search.


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


class KnobSearch:
    """The search for one method and target. Drive it as

        search = KnobSearch(base, target, tol)
        while not search.done:
            densities, curve = measure(search.knob, search.values)
            search.update(densities, curve)
        entry = search.result()

    where `densities` [P] are the measured densities at `search.knob` (one per prompt) and `curve`
    [V] the mean density at each of `search.values` on the same activations (which include the
    knob). The first step checks that the target is in the curve's range: outside it the search
    raises `Unreachable`, or with `closest=True` ends at the curve's point nearest the target.
    """

    def __init__(self, base, target: float, tol: float, closest: bool = False):
        self.base, self.target, self.tol, self.closest = base, float(target), float(tol), closest
        self.range = knob_range(base)
        self.log = self.range[0] > 0
        self.n_values = FINE_GRID if exact_curve_supported(base) else GRID
        start = knob_value(base)
        lo, hi = self.range
        self.knob = min(max(start if start is not None else _mid(lo, hi, self.log), lo), hi)
        self.values = _grid(base, lo, hi, self.n_values, self.knob)
        self.bracket = [lo, hi]
        self.steps = 0
        self.done = False
        self.reached = True
        self.stop_reason = ""
        # side of the target ("below"/"above") -> the closest (knob, per-prompt densities)
        self.near: dict[str, tuple[float, np.ndarray]] = {}

    def update(self, densities, curve) -> None:
        dens, curve = np.atleast_1d(np.asarray(densities, float)), np.asarray(curve, float)
        self.steps += 1
        mean, target, tol = float(dens.mean()), self.target, self.tol
        side = "below" if mean < target else "above"
        if side not in self.near or abs(mean - target) < abs(self.near[side][1].mean() - target):
            self.near[side] = (self.knob, dens)
        if self.steps == 1 and not curve.min() - tol <= target <= curve.max() + tol:
            if not self.closest:
                raise Unreachable(
                    f"{self.base.name} cannot reach density {target:.4f} here: its knob "
                    f"{self.base.knob} spans densities {curve.min():.4f}-{curve.max():.4f} on "
                    "these prompts (the forced blocks set the floor, and the knob saturates at "
                    "its range's ends); pick a target in that range"
                )
            # the closest point; among equals the end of the knob range toward the target (the
            # sparsest end when even it keeps more than the target)
            dist = np.abs(curve - target)
            ties = np.flatnonzero(dist == dist.min())
            last = (self.base.knob_direction < 0) == (curve.min() > target)  # values ascend
            j = int(ties[-1] if last else ties[0])
            self.near = {"end": (self.values[j], np.full_like(dens, curve[j]))}
            self.done, self.reached, self.stop_reason = True, False, "unreachable"
            return
        if abs(mean - target) <= tol or self.steps >= MAX_STEPS:
            self.done = True
            self.stop_reason = "" if abs(mean - target) <= tol else "steps"
            return
        lo, hi = self.bracket
        if (mean > target) == (self.base.knob_direction < 0):
            lo = self.knob  # too dense, and a larger knob keeps fewer (or too sparse, the reverse)
        else:
            hi = self.knob
        self.bracket = [lo, hi]
        if not _open(lo, hi, self.range, self.log):
            self.done, self.stop_reason = True, "step"  # the density steps over the target here
            return
        guess = invert(self.values, curve, target, self.log)
        self.knob = guess if guess is not None and lo < guess < hi else _mid(lo, hi, self.log)
        exact = self.n_values == FINE_GRID
        wlo, whi = (lo, hi) if exact else _window(self.values, curve, target, lo, hi)
        self.values = _grid(self.base, wlo, whi, self.n_values, self.knob)

    def result(self) -> dict:
        """The closest step: knob, mean/p50/p90 density over the prompts, error, steps; with
        `neighbours` (the closest density on each side) when the tolerance was not met."""
        knob, per_prompt = min(self.near.values(), key=lambda kd: abs(kd[1].mean() - self.target))
        error = abs(float(per_prompt.mean()) - self.target)
        out = {
            "target": self.target,
            "knob": float(knob),
            "knob_name": self.base.knob,
            "density_mean": float(per_prompt.mean()),
            "density_p50": float(np.median(per_prompt)),
            "density_p90": float(np.quantile(per_prompt, 0.9)),
            "abs_error": error,
            "steps": self.steps,
        }
        if error > self.tol and self.stop_reason != "unreachable":
            out["neighbours"] = {
                side: {
                    "knob": float(self.near[side][0]),
                    "density_mean": float(self.near[side][1].mean()),
                }
                for side in ("below", "above")
                if side in self.near
            }
        return out

    def warning(self) -> str | None:
        """Why the tolerance was not met, in one line (None when it was)."""
        res = self.result()
        if res["abs_error"] <= self.tol:
            return None
        if self.stop_reason == "unreachable":
            return (
                f"{self.base.name} cannot reach density {self.target:.4f}; closest "
                f"{res['density_mean']:.5f} at {self.base.knob}={res['knob']:.6g}"
            )
        sides = "; ".join(
            f"{v['density_mean']:.5f} at {self.base.knob}={v['knob']:.6g}"
            for v in res["neighbours"].values()
        )
        why = (
            f"the density steps over the target between {sides}; no knob value gives a density "
            "in between on these prompts"
            if self.stop_reason == "step"
            else f"stopped after {MAX_STEPS} steps; closest on each side: {sides}"
        )
        return (
            f"{self.base.name} at density {self.target:.4f}: closest {res['density_mean']:.5f} "
            f"(error {res['abs_error']:.2e} > tolerance {self.tol:g}); {why}"
        )


def search_on(base, q, k, target: float, tol: float, scale: float | None = None):
    """(selector, measured density): `KnobSearch` on one input's q/k (one layer), ending at the
    closest density where the target is out of reach or between two steps of the density."""
    search = KnobSearch(base, target, tol, closest=True)
    while not search.done:
        curve = density_curve(base, q, k, scale, search.values)
        search.update([curve[search.values.index(search.knob)]], curve)
    res = search.result()
    selector = base.with_knob(res["knob"])
    return selector, float(res["density_mean"])
