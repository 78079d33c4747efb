"""The calibration store: the knob each method was calibrated to per model, target density and
setting, in `<calibration.dir>/<model>/<method>.yaml`.

One entry per target and setting (the method's fields other than its knob, and the calibration
prompts' benchmark, task and length), with the knob, mean/p50/p90 density over the prompts, the
achieved error and the cost (seconds, model forwards, prompts, device). `budget=<name>` in a run
reads the entry of its own setting (`load_knob`), and uses it only if its density lies within its
tolerance of its target (`entry_problem`). Writers hold the lock
`<calibration.dir>/<model>/<method>.yaml.lock` (filelock: `flock`, see records.py) while they
re-read, merge and replace the file, so parallel calibrations of one method keep every entry.
The search that makes an entry is `budget.KnobSearch`, driven by calibrate.py.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from pathlib import Path

import yaml
from filelock import FileLock
from omegaconf import OmegaConf

from rbs_bench import config
from rbs_bench.budget import knob_fields
from rbs_bench.config import UserError, group_options
from rbs_bench.models import weights_digest

IGNORED_FIELDS = ("impl",)  # fields that change how, not what, a method selects
# The farthest an entry the search could not bring within its tolerance (the density steps over
# the target) may lie from its target and still be used for it (entry_problem).
CLOSEST_SLACK = 0.01


def calibration_path(cfg) -> Path:
    return Path(cfg.calibration.dir) / cfg.model.name / f"{cfg.method.name}.yaml"


def setting(cfg, base) -> dict | None:
    """What a calibration holds for besides the target: the method's fields other than its knob,
    the prompts' benchmark, first task and first context length, and the weights' digest where the
    model has one (models.weights_digest). None without a benchmark."""
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


def read_entries(path: Path) -> list[dict]:
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


def find_entry(cfg, base) -> dict | None:
    """The stored entry for the run's target and setting. Without a benchmark in `cfg` (a bare
    lookup by model, method and target), the one entry at that target."""
    target = cfg.budget.target
    here = [
        e
        for e in read_entries(calibration_path(cfg))
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
    name, target = cfg.budget.name, cfg.budget.target
    args = f"budget.target={target:g}"
    return f"budget={name} {args}" if name in group_options("budget") else args


def load_knob(cfg, base) -> float:
    """The calibrated knob for the run's method (`base`, as configured) at `budget.target` in the
    run's setting, or a UserError naming the command that makes it."""
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

    if HydraConfig.initialized():
        given = list(HydraConfig.get().overrides.task)
    else:
        given = list(config.COMMAND_OVERRIDES or [])
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
