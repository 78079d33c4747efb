"""Run records: one JSON line per finished sample, appended so that a kill loses at most one.

Each line is written with a single `write` of the whole line followed by fsync. A line cut short by
a kill (no trailing newline, or not valid JSON) is dropped when the file is next opened, so a rerun
of the same command resumes with exactly the samples that finished. A complete JSON line that is
not a record (no task, context length and index) is refused with its file and line number.

**Locks.** Every cell directory has a lock file, `<cell dir>/.lock` (beside `records.jsonl`),
taken with `filelock.FileLock`: an `flock` on the open file, which the kernel drops when the
process dies, so a killed run never leaves a stale lock. The lock must be shared by every machine
that writes the cell: local disks and NFS (Linux emulates `flock` with NFS byte-range locks) are;
Lustre only when mounted with `-o flock`. `RecordStore.append` takes the lock, reads the lines
other processes appended since this store last looked, and skips a record whose key is already
there, so no key is ever recorded twice; the runner holds the same lock over a whole cell run
(docs/design.md §2).

**Settings.** Every record carries the settings it was made with (`record_settings`); a rerun
compares them with its own before it appends (`check_settings`). `cell.json` holds the same
settings for the records of a cell, written after the first record: a cache of that check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from filelock import FileLock

from rbs_bench.config import UserError

KEY_FIELDS = ("task", "context_length", "index")
LOCK_NAME = ".lock"
CELL_FILE = "cell.json"
_LOCKS: dict[str, FileLock] = {}  # lock path -> the one FileLock of this process


def record_key(rec: dict) -> tuple:
    return tuple(rec[f] for f in KEY_FIELDS)


def cell_lock(cell_dir: Path) -> FileLock:
    """The lock of one cell directory (`<cell dir>/.lock`): one object per path in a process, so
    the runner's hold and `RecordStore.append`'s nest (a FileLock counts its holds; two objects
    on one file would wait for each other)."""
    cell_dir = Path(cell_dir)
    cell_dir.mkdir(parents=True, exist_ok=True)
    path = str((cell_dir / LOCK_NAME).resolve())
    if path not in _LOCKS:
        _LOCKS[path] = FileLock(path)
    return _LOCKS[path]


def _parse(path: Path, lineno: int, line: bytes | str) -> dict | None:
    """The record on one complete line; None for a line that is not JSON (a torn write)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or any(f not in rec for f in KEY_FIELDS):
        missing = (
            "not an object"
            if not isinstance(rec, dict)
            else "no " + ", ".join(f for f in KEY_FIELDS if f not in rec)
        )
        raise UserError(
            f"{path}:{lineno} is JSON but not a run record ({missing}); delete that line "
            f"(e.g. sed -i '{lineno}d' {path}) and rerun, which records that sample again"
        )
    return rec


def read_records(path: Path) -> list[dict]:
    """All complete records of a JSONL file ([] if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if line.endswith("\n"):
            rec = _parse(path, lineno, line)  # None: a torn write from a kill; RecordStore repairs
            if rec is not None:
                out.append(rec)
    return out


class RecordStore:
    """The records of one cell (experiment/model/method/budget), keyed by (task, length, index).

    `append` holds the cell's lock (`cell_lock`) while it reads what other processes appended
    and writes, so two stores of one file never record one key twice."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = cell_lock(self.path.parent)
        with self.lock:
            self._reopen()

    def _repair(self) -> None:
        """Drop a torn last line so new records start on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = [ln for ln in data.splitlines(keepends=True) if ln.endswith(b"\n") and _is_json(ln)]
        if sum(map(len, good)) != len(data):
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.repair")
            tmp.write_bytes(b"".join(good))
            os.replace(tmp, self.path)

    def _refresh(self) -> None:
        """Read the complete lines appended since the last read (by any process)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a write in progress elsewhere, or torn; read again next time
            self._offset += len(line)
            self._lines += 1
            rec = _parse(self.path, self._lines, line)
            if rec is not None:
                self.records.setdefault(record_key(rec), rec)

    def _reopen(self) -> None:
        self._repair()
        self.records, self._lines, self._offset = {}, 0, 0
        self._refresh()

    def done(self, key: tuple) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> bool:
        """Append `rec` unless its key is recorded (by this or another process); True if written."""
        line = json.dumps(rec, sort_keys=True, allow_nan=False) + "\n"
        with self.lock:
            self._refresh()
            if record_key(rec) in self.records:
                return False
            if self.path.exists() and self.path.stat().st_size != self._offset:
                self._reopen()  # a run killed mid-write left a torn line: drop it first
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._refresh()
        return True


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write a whole file so readers never see half of it (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_fingerprint(path: Path, fingerprint: dict) -> None:
    """Refuse to mix records made with different settings in one cell directory."""
    path = Path(path)
    if not path.exists():
        write_atomic(path, json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        return
    old = json.loads(path.read_text())
    diff = [k for k in sorted(set(old) | set(fingerprint)) if old.get(k) != fingerprint.get(k)]
    if diff:
        k = diff[0]
        raise UserError(
            f"{path.parent} holds records made with {k}={old.get(k)!r}, "
            f"not {fingerprint.get(k)!r}; "
            "use another budget name (budget.name=...) or results_dir=..., or delete that directory"
        )


# ------------------------------------------------------------------------------------------------
# Settings: what the records of one cell share.


def _flat(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def record_settings(rec: dict) -> tuple[dict, set[str]]:
    """The settings a record carries, flat as the runner's (`method.alpha_base`, `budget.target`,
    ...), and the groups it carries whole (`method`, `model`): a key of those that the record
    lacks differs from any value. Older records carry fewer keys; only theirs are compared."""
    out, whole = {}, set()
    if "method_fields" in rec:
        out.update(_flat(rec["method_fields"], "method."))
        whole.add("method.")
    if "model_identity" in rec:
        out.update(_flat(rec["model_identity"], "model."))
        whole.add("model.")
    for field, key in (
        ("method", "method.name"),
        ("model", "model.name"),
        ("budget_knob", "budget.knob"),
        ("budget_target", "budget.target"),
        ("benchmark", "benchmark.name"),
        ("benchmark_version", "benchmark.version"),
        ("benchmark_seed", "benchmark.seed"),
        ("max_new_tokens", "benchmark.max_new_tokens"),
    ):
        if field in rec:
            out[key] = rec[field]
    return out, whole


def _differences(have: dict, whole: set[str], want: dict) -> list[str]:
    keys = set(have) | {k for k in want if any(k.startswith(g) for g in whole)}
    return [k for k in sorted(keys) if have.get(k) != want.get(k)]


def _plain(settings: dict) -> dict:
    """As JSON stores it (tuples become lists), so that a reread compares equal."""
    return json.loads(json.dumps(settings))


# settings no override sets: the code's benchmark version and the weights' digest
_NOT_OVERRIDES = ("benchmark.version", "model.weights")


def _refuse(prefix: str, key: str, have, want) -> UserError:
    back = (
        "that cell was made by other code or weights"
        if key in _NOT_OVERRIDES
        else f"run with {key}={have!r} to add to that cell"
    )
    return UserError(
        f"{prefix} {key}={have!r}, but this run has {key}={want!r}; {back}, or give this run its "
        "own results_dir=... or budget.name=..."
    )


def check_settings(store: RecordStore, settings: dict) -> None:
    """Refuse to add to a cell whose records were made with other settings.

    Every record is compared (`record_settings`), and `cell.json` beside them, which also holds
    settings older records lack. With no record in the cell a `cell.json` is a failed run's
    leftover and is ignored (`write_settings` replaces it once a record exists)."""
    if not store.records:
        return
    want = _plain(settings)
    for rec in store.records.values():
        have, whole = record_settings(rec)
        diff = _differences(have, whole, want)
        if diff:
            k = diff[0]
            key = "/".join(map(str, record_key(rec)))
            others = sum(
                bool(_differences(*record_settings(r), want)) for r in store.records.values()
            )
            raise _refuse(
                f"{store.path} holds {len(store.records)} records, {others} made with other "
                f"settings; record {key} was made with",
                k,
                have.get(k),
                want.get(k),
            )
    cached = store.path.parent / CELL_FILE
    if cached.exists():
        try:
            old = json.loads(cached.read_text())
        except json.JSONDecodeError:
            return  # a cache: rebuilt from the records by write_settings
        diff = [k for k in sorted(set(old) | set(want)) if old.get(k) != want.get(k)]
        if diff:
            k = diff[0]
            raise _refuse(
                f"{cached} (the settings of the {len(store.records)} records beside it) has",
                k,
                old.get(k),
                want.get(k),
            )


def write_settings(store: RecordStore, settings: dict) -> None:
    """Write the cell's `cell.json` from `settings` once it has records (they were checked)."""
    if not store.records:
        return
    path = store.path.parent / CELL_FILE
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        write_atomic(path, text)
