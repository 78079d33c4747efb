"""Calibration inside a TTFT run, and the calibrations it keeps.

Per context N, dense prefills of the seeded random prompt score each layer as the prefill reaches
it and then drop it (`calibrate_methods`: every method still searching scores the layer at once,
and `rbs_bench.budget.KnobSearch` picks its next knob from the mean over layers), until each
method's density is within CALIBRATION_TOL of the target: exact threshold curves settle in one
prefill, the other methods' short grids in a few. A method that cannot reach it (at short N its
forced blocks alone exceed 5%) keeps its closest density, the knob's sparsest end, and is flagged
(`target_reached` False). The first layer's Q/K give each method's block statistics and selector
workspace. The density that the timed prefill measures can differ a little: its later layers see
sparse layers' outputs.

Each finished calibration is appended to ttft_calibrations_<device>.jsonl (`save_calibrations`),
so a rerun of a killed run calibrates only what it had not; rows already in the CSV give theirs
back too (`known`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from torch import Tensor
from tqdm import tqdm

from rbs_bench import methods, paths
from rbs_bench.bench.ttft_measure import (
    block_statistics,
    dense_prefill,
    describe_stats,
    selector_memory,
)
from rbs_bench.bench.ttft_model import Loaded, MiB, release, tensor_bytes
from rbs_bench.bench.ttft_rows import as_bool
from rbs_bench.bench.ttft_setup import Settings
from rbs_bench.budget import knob_value
from rbs_bench.errors import UserError

CALIBRATION_TOL = 0.002  # absolute density error at which the knob search stops


@dataclass
class Calibrated:
    """One method at one context: its selector fields and what calibration and the capture gave."""

    fields: dict
    knob: float | None
    calibration_density: float
    target_reached: bool
    block_stats_mib: float | None = None
    block_stats: str | None = None
    selector_workspace_mib: float | None = None
    selection_mib: float | None = None


def calibrate_methods(
    s: Settings, lm: Loaded, ids: Tensor, names: list[str], measure: set[str]
) -> dict[str, Calibrated]:
    """Each method in `names` calibrated to the target on one prompt's dense prefill; for those
    in `measure`, block statistics and selector workspace on the first layer.

    Every step is one dense prefill in which each layer is scored as it runs, for all methods
    still searching at once (`budget.LayerCurves`), and each method's `budget.KnobSearch` takes
    its next knob from the mean over layers; no layer's Q/K outlives its layer, except the first
    layer's, which the workspace measures need. A method that cannot reach the target (at short
    N its forced blocks alone exceed it) ends at its closest density and is flagged."""
    from rbs_bench.budget import KnobSearch, LayerCurves

    searches = {
        m: KnobSearch(methods.build(m), s.target, CALIBRATION_TOL, closest=True) for m in names
    }
    first: list = []
    while pending := [m for m, search in searches.items() if not search.done]:
        curves = LayerCurves({m: (searches[m].base, searches[m].values) for m in pending})
        failed: dict[str, Exception] = {}
        keep = first if measure and not first else None
        on_layer = functools.partial(_score_layer, curves, pending, failed, keep)
        try:
            dense_prefill(lm, ids, on_layer)
        finally:
            release(lm.device)
        for m in pending:
            search = searches[m]
            if m in failed:
                e = failed[m]
                tqdm.write(f"ttft: calibrating {m}: {type(e).__name__}: {e}", file=sys.stderr)
                del searches[m]
                continue
            curve = curves.mean(m)
            search.update([curve[search.values.index(search.knob)]], curve)
    out = {}
    try:
        for name, search in searches.items():
            res = search.result()
            selector = search.base.with_knob(res["knob"])
            cal = Calibrated(
                fields=selector.fields(),
                knob=knob_value(selector),
                calibration_density=res["density_mean"],
                target_reached=search.reached and res["abs_error"] <= CALIBRATION_TOL,
            )
            if name in measure and first:
                _measure(cal, selector, *first[0])
            out[name] = cal
    finally:
        first.clear()
        release(lm.device)
    return out


def _score_layer(curves, names: list[str], failed: dict, keep: list | None, q, k, scale) -> None:
    """One layer of a calibration prefill: each method's density curve on it (a method that
    fails, e.g. out of memory, is set aside with its error); the first layer's q/k go to `keep`."""
    if keep is not None and not keep:
        keep.append((q, k))
    for m in names:
        if m in failed:
            continue
        try:
            curves.add_one(m, q, k, scale)
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # that method's rows fail, not the run
            failed[m] = e
    curves.next_layer()


def _measure(cal: Calibrated, selector, q: Tensor, k: Tensor) -> None:
    """Block statistics and selector workspace of one layer's q/k into `cal`."""
    parts = block_statistics(selector, k)
    if parts is not None:
        cal.block_stats_mib = tensor_bytes([t for _, t in parts]) / MiB
        cal.block_stats = describe_stats(parts)
        del parts
    cal.selector_workspace_mib, cal.selection_mib = selector_memory(selector, q, k)


def known(rows: list[dict], s: Settings, lm: Loaded) -> dict[tuple[int, str], Calibrated]:
    """Calibrations recorded by earlier rows of this model and target (batch 1 rows preferred)."""
    out = {}
    for r in sorted(rows, key=lambda r: -int(r["batch"])):  # batch 1 last: it wins
        if (
            r["method"] == methods.DENSE
            or r["model"] != s.model
            or int(r["layers"]) != s.layers
            or r["dtype"] != lm.dtype
            or float(r["target"]) != s.target
            or not isinstance(r.get("fields"), str)
        ):
            continue
        out[(int(r["n"]), r["method"])] = Calibrated(
            fields=json.loads(r["fields"]),
            knob=None if pd.isna(r.get("knob")) else float(r["knob"]),
            calibration_density=float(r["calibration_density"]),
            target_reached=as_bool(r["target_reached"]),
        )
    return out


def cal_key(s: Settings, lm: Loaded, n: int, method: str) -> dict:
    """What a saved calibration was measured on: model, weights, prompt, context and target."""
    return {
        "model": s.model,
        "layers": s.layers,
        "dtype": lm.dtype,
        "checkpoint": str(s.checkpoint or ""),
        "seed": s.seed,
        "target": s.target,
        "n": n,
        "method": method,
    }


def save_calibrations(s: Settings, lm: Loaded, n: int, got: dict[str, Calibrated]) -> None:
    """Append `got` to the run's calibration file in one flushed write, after a line break where
    a kill cut the last line (so the new lines stay whole)."""
    lines = "".join(
        json.dumps({**cal_key(s, lm, n, m), **dataclasses.asdict(cal)}) + "\n"
        for m, cal in got.items()
    )
    with open(paths.check_inside(s.calibrations), "ab", opener=paths.opener) as f:
        if f.tell() and not _ends_with_newline(s.calibrations):
            lines = "\n" + lines
        f.write(lines.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def saved_calibrations(s: Settings, lm: Loaded) -> dict[tuple[int, str], Calibrated]:
    """This setting's calibrations from the run's calibration file; a line cut by a kill, or of
    another setting, is passed over."""
    if not s.calibrations.exists():
        return {}
    names = {f.name for f in dataclasses.fields(Calibrated)}
    out = {}
    for line in s.calibrations.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
            if not isinstance(e, dict):
                continue
            key = cal_key(s, lm, int(e["n"]), str(e["method"]))
            if any(e.get(k) != v for k, v in key.items()):
                continue
            out[(key["n"], key["method"])] = Calibrated(**{k: e[k] for k in names if k in e})
        except (ValueError, KeyError, TypeError):
            continue
    return out


def cal_columns(cal: Calibrated | None, batch: int) -> dict:
    """The calibration's columns; selector-only measures belong to batch-1 rows."""
    if cal is None:  # dense
        return {"fields": "{}", "calibration_density": 1.0, "target_reached": True}
    out = {
        "fields": json.dumps(cal.fields, sort_keys=True),
        "knob": cal.knob,
        "block_size": cal.fields.get("block_size"),
        "calibration_density": cal.calibration_density,
        "target_reached": cal.target_reached,
    }
    if batch == 1:
        out.update(
            block_stats_mib=cal.block_stats_mib,
            block_stats=cal.block_stats,
            selector_workspace_mib=cal.selector_workspace_mib,
            selection_mib=cal.selection_mib,
        )
    return out
