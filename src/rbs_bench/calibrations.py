"""The calibration store: the knob each method was calibrated to per model, target density and
setting, in `<calibration.dir>/<model>/<method>.yaml`.

One entry per target and setting (the method's fields other than its knob, and the calibration
prompts' benchmark, task and length), with the knob, mean/p50/p90 density over the prompts, the
achieved error and the cost (seconds, model forwards, prompts, device). `budget=<name>` in a run
reads the entry of its own setting (`load_knob`) and uses it only if

- it is the entry that was written: every entry carries `model_identity` (the model config it was
  measured with, as run records carry it) and `digest`, a digest of its target, knob, density,
  error, tolerance, prompt count, setting and model identity (`entry_digest`), so an entry whose
  knob or density was edited, or one copied from another model config, is refused with the
  command that recalibrates it (`provenance_problem`);
- its density lies within the run's `calibration.tolerance` of its target, or it is the closest
  density the search could reach (`entry_problem`); an entry's own tolerance never widens the
  run's.

Writers hold the lock `<calibration.dir>/<model>/<method>.yaml.lock` (filelock: `flock`, see
records.py) while they re-read, merge and replace the file (keeping its permissions), so parallel
calibrations of one method keep every entry. The search that makes an entry is
`budget.KnobSearch`, driven by calibrate.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from pathlib import Path

import yaml
from filelock import FileLock
from omegaconf import OmegaConf

from rbs_bench import config, paths
from rbs_bench.budget import knob_fields
from rbs_bench.config import group_options
from rbs_bench.errors import UserError
from rbs_bench.models import identity, weights_digest
from rbs_bench.records import write_atomic

IGNORED_FIELDS = ("impl",)  # fields that change how, not what, a method selects
# The farthest an entry the search could not bring within its tolerance (the density steps over
# the target) may lie from its target and still be used for it (entry_problem).
CLOSEST_SLACK = 0.01
# What an entry's digest covers: what it was measured with and what it found.
DIGEST_FIELDS = (
    "target",
    "knob_name",
    "knob",
    "density_mean",
    "abs_error",
    "tolerance",
    "prompts",
    "setting",
    "model_identity",
)
# Model fields that do not change a measured density: left out of an entry's model identity.
NOT_MEASURED = ("max_context",)
# Entry fields and the types they must have (None: optional); a file that breaks them is refused.
_NUMBER = (int, float)
ENTRY_SCHEMA = {
    "target": (_NUMBER, True),
    "knob": (_NUMBER, True),
    "knob_name": ((str,), True),
    "density_mean": (_NUMBER, True),
    "abs_error": (_NUMBER, True),
    "tolerance": (_NUMBER, False),
    "prompts": ((int,), False),
    "setting": ((dict, type(None)), False),
    "model_identity": ((dict,), False),
    "digest": ((str,), False),
}


def calibration_path(cfg) -> Path:
    """<calibration.dir>/<model>/<method>.yaml (paths.calibration_file)."""
    return paths.calibration_file(cfg.calibration.dir, cfg.model.name, cfg.method.name)


def calibration_identity(model_cfg) -> dict:
    """The model identity an entry is measured with: `models.identity`, less NOT_MEASURED."""
    return {k: v for k, v in identity(model_cfg).items() if k not in NOT_MEASURED}


def entry_digest(entry: dict) -> str:
    """The first 16 hex digits of the sha256 of an entry's DIGEST_FIELDS as sorted JSON."""
    body = {k: entry.get(k) for k in DIGEST_FIELDS}
    text = json.dumps(body, sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def seal(entry: dict, model_cfg) -> dict:
    """`entry` with the model identity it was measured with and its digest, its values as YAML
    reads them back (so that the digest holds for the stored entry)."""
    entry = yaml.safe_load(yaml.safe_dump(dict(entry), sort_keys=False))
    entry["model_identity"] = calibration_identity(model_cfg)
    entry.pop("digest", None)
    return entry | {"digest": entry_digest(entry)}


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


def _fix(path: Path) -> str:
    return f"repair it, or delete {path} and rerun python -m rbs_bench.calibrate to remake it"


def _load(path: Path) -> dict | None:
    """The mapping a calibration file holds (None if there is no file); a file that cannot be
    read as such (binary, not YAML, not a mapping of entries) is a one-line UserError naming the
    file, the line where it can, and the repair."""
    path = Path(path)
    try:
        raw = paths.read_file(path)  # a regular file: a FIFO or a link is refused, never read
    except FileNotFoundError:
        return None
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not a calibration file (byte {e.start} is not UTF-8 text: a binary "
            f"file); {_fix(path)}"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}{where} is not valid YAML ({problem}); {_fix(path)}") from None
    entries = (data or {}).get("entries", []) if isinstance(data, dict) or data is None else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UserError(
            f"{path} is not a calibration file (a mapping whose 'entries' list holds mappings "
            f"with target and knob); {_fix(path)}"
        )
    for i, entry in enumerate(entries, 1):
        _check_entry(path, i, entry)
    return data if isinstance(data, dict) else {"entries": []}


def _check_entry(path: Path, i: int, entry: dict) -> None:
    """UserError naming the file, the entry and the field unless `entry` has ENTRY_SCHEMA's
    fields with their types (numbers finite)."""
    for name, (types, required) in ENTRY_SCHEMA.items():
        if name not in entry:
            if not required:
                continue
            problem = "has no"
        else:
            value = entry[name]
            ok = isinstance(value, types) and not isinstance(value, bool)
            if ok and types is _NUMBER:
                ok = math.isfinite(value)
            if ok:
                continue
            problem = f"has {value!r} as its"
        want = {_NUMBER: "a finite number", (int,): "an integer", (str,): "a string"}.get(
            types, "a mapping"
        )
        raise UserError(
            f"{path}: entry {i} (target {entry.get('target')!r}) {problem} {name} ({want} "
            f"expected); {_fix(path)}"
        )


def read_entries(path: Path) -> list[dict]:
    """The entries of a calibration file ([] if there is none), each checked against
    ENTRY_SCHEMA; a file that is not such YAML is a one-line UserError naming the file, the line
    or entry and the repair."""
    data = _load(path)
    return list((data or {}).get("entries") or [])


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
        problem = provenance_problem(entry, cfg) or entry_problem(entry, cfg.calibration.tolerance)
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
    given = config.command_overrides()
    key = config.override_key
    cell = {"method", "budget", "budget.name", "budget.target", "budget.knob"}
    keep = [o for o in given if key(o) not in cell]
    if "model" not in map(key, keep) and cfg.model.name in group_options("model"):
        keep.append(f"model={cfg.model.name}")  # the same model, whatever chose it
    args = keep + [f"method={cfg.method.name}", *_budget_args(cfg).split()]
    return " ".join(["python -m rbs_bench.calibrate", *map(shlex.quote, args)])


def provenance_problem(entry: dict, cfg) -> str | None:
    """Why a stored entry is not the one calibration wrote for this model (None if it is): it
    has no digest, its digest does not match its values (an edited knob or density), or it was
    measured with another model config than the run's (compared where the run names a
    benchmark, i.e. has a full model config; a key the entry lacks counts as unset)."""
    if "digest" not in entry:
        return (
            "carries no digest of what it was measured with (written by hand, or by a version "
            "before entries carried one), so nothing vouches for its knob"
        )
    if entry["digest"] != entry_digest(entry):
        return (
            "does not match its digest: its knob, density or setting was changed after it was "
            "calibrated"
        )
    if OmegaConf.select(cfg, "benchmark") is None:
        return None  # a bare lookup by model name (serving/vllm.py): no model config to compare
    have, want = entry.get("model_identity") or {}, calibration_identity(cfg.model)
    for key in sorted(set(have) | set(want)):
        if have.get(key) != want.get(key):
            return (
                f"was measured with model.{key}={have.get(key)!r}, but this run has "
                f"model.{key}={want.get(key)!r} (an entry of another model config)"
            )
    return None


def entry_problem(entry: dict, tolerance: float) -> str | None:
    """Why a stored entry cannot stand for its target under the run's `tolerance` (None if it
    can).

    Its mean density must lie within `tolerance` of its target; the entry's own tolerance never
    widens it. An entry the search could not bring within its own tolerance (the density steps
    over the target, or the steps ran out) is the closest the knob reaches, and is used when its
    recorded error is the distance between its density and its target and that distance is at
    most CLOSEST_SLACK: an entry whose density belongs to another target fails both, and so
    does one that met a looser tolerance than the run's (a search under the run's could get
    closer)."""
    if not isinstance(entry.get("density_mean"), (int, float)):
        return "records no density_mean, so nothing shows its knob gives that density"
    target, density = float(entry["target"]), float(entry["density_mean"])
    err = abs(density - target)
    if err <= tolerance:
        return None
    own = entry.get("tolerance")
    closest = math.isclose(err, float(entry.get("abs_error", -1)), rel_tol=1e-6, abs_tol=1e-12)
    if closest and err <= CLOSEST_SLACK and (own is None or err > float(own)):
        return None
    looser = own is not None and err <= float(own)
    return (
        f"records density {density:.4f}, {err:.4f} from its target (tolerance {tolerance:g}"
        + (f", recorded error {float(entry['abs_error']):.2g}" if "abs_error" in entry else "")
        + (
            f"; it met its own looser tolerance {float(own):g}), so a calibration to this "
            "tolerance can come closer"
            if looser
            else "), so its knob belongs to another density"
        )
    )


def store(cfg, entry: dict) -> Path:
    """Add `entry` (sealed: `seal`) to the method's calibration file, replacing the entry of the
    same target and setting. Concurrent writers (a SLURM array of calibrations) each hold the
    file's lock `<method>.yaml.lock` while they re-read the file, merge and replace it
    (`records.write_atomic`: through their own temp file, keeping the file's permissions), so
    no writer's entry is lost."""
    path = calibration_path(cfg)
    if cfg.get("results_dir") is not None:
        paths.confine(cfg.results_dir)
    paths.confine(cfg.calibration.dir)  # also where calibration.dir lies outside results_dir
    paths.make_dirs(path.parent)
    entry = seal(entry, cfg.model)
    with FileLock(str(paths.check_inside(f"{path}.lock"))):
        data = _load(path) or {"model": cfg.model.name, "method": cfg.method.name, "entries": []}
        same = lambda e: e["target"] == entry["target"] and e.get("setting") == entry.get("setting")
        data["entries"] = [e for e in data.get("entries") or [] if not same(e)] + [entry]
        data["entries"].sort(key=lambda e: (e["target"], yaml.safe_dump(e.get("setting"))))
        write_atomic(path, yaml.safe_dump(data, sort_keys=False))
    return path
