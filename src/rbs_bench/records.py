"""Run records: one JSON line per finished sample, appended so that a kill loses at most one.

Each line is written with a single `write` of the whole line followed by fsync, with SIGINT and
SIGTERM held until it is done (`errors.deferred`). A line cut short by a kill (no trailing
newline, or not valid JSON) is dropped when the file is next opened, so a rerun of the same
command resumes with exactly the samples that finished. A write that fails (a full disk) is cut
back off the file before the error is reported. A complete JSON line that is not a record (no
task, context length and index) is refused with its file and line number.

**A record is bound to its cell.** Every record is written with `checksum`, a digest of all its
other values (`seal`), among them the cell it belongs to (experiment, model name and identity,
method and fields, budget, benchmark) and its sample (task, length, index). Every read of a
cell's file (`read_cell`: report, tables, figures and the runner's resume all read through it)
checks, line by line, and refuses with the file and line number:

- a record whose values do not match its checksum (edited after it was recorded);
- a record of another cell: its experiment, model, method or budget is not the folder's it sits
  in (`paths.cell_identity`), e.g. records moved from flexprefill/d30 into rbs/d30;
- a record made with other settings than the cell's first (`record_settings`);
- a second record of one sample key with other values. A line repeated exactly (same values,
  same checksum) counts once.

Records written before checksums existed carry none and are read as they are. An empty file is an
empty cell: it reads as no records, and the summaries and tables name it (report.load_records).

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

**Files.** Every file here is opened through `paths.opener` (a regular file, no final symbolic
link, never a blocking open) at a path `paths.check_inside` allows, so no write leaves the
results folder through a link. Whole files (cell.json, summaries, tables) are replaced atomically
by `write_atomic`, which keeps the file's permissions. This module imports neither torch nor
Triton: reading records is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from rbs_bench import paths
from rbs_bench.errors import UserError, deferred
from rbs_bench.paths import CELL_FILE, LOCK_NAME

KEY_FIELDS = ("task", "context_length", "index")
CHECKSUM = "checksum"  # the record's digest of its other values (`seal`)
_LOCKS: dict[str, FileLock] = {}  # lock path -> the one FileLock of this process


def record_key(rec: dict) -> tuple:
    return tuple(rec[f] for f in KEY_FIELDS)


def cell_lock(cell_dir: Path) -> FileLock:
    """The lock of one cell directory (`<cell dir>/.lock`): one object per path in a process, so
    the runner's hold and `RecordStore.append`'s nest (a FileLock counts its holds; two objects
    on one file would wait for each other)."""
    cell_dir = paths.make_dirs(cell_dir)
    paths.check_inside(cell_dir / LOCK_NAME)
    path = str((cell_dir / LOCK_NAME).resolve())
    if path not in _LOCKS:
        _LOCKS[path] = FileLock(path)
    return _LOCKS[path]


def checksum(rec: dict) -> str:
    """A digest of a record's values (all but its checksum): the first 16 hex digits of the
    sha256 of its JSON with sorted keys, as `RecordStore.append` writes it."""
    body = {k: v for k, v in rec.items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def seal(rec: dict) -> dict:
    """`rec` with its checksum."""
    return {k: v for k, v in rec.items() if k != CHECKSUM} | {CHECKSUM: checksum(rec)}


def _parse(path: Path, lineno: int, line: bytes | str) -> dict | None:
    """The record on one complete line; None for a line that is not JSON (a torn write)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
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
    if CHECKSUM in rec and rec[CHECKSUM] != checksum(rec):
        raise UserError(
            f"{path}:{lineno} was changed after it was recorded (its values do not match its "
            f"checksum); delete that line (e.g. sed -i '{lineno}d' {path}) and rerun, which "
            "records that sample again"
        )
    return rec


class _CellCheck:
    """What the lines of one records file must agree on, checked as they are read (the module's
    docstring): the cell they sit in, one setting, and one record per sample key."""

    def __init__(self, path: Path, cell: dict | None):
        self.path, self.cell = path, cell
        self.first: tuple[int, dict, set[str]] | None = None  # line, settings, whole groups
        self.seen: dict[tuple, tuple[int, str]] = {}  # key -> (line, digest of its values)

    def take(self, lineno: int, rec: dict) -> bool:
        """Whether `rec` (line `lineno`) is a sample not read yet; False for an exact repeat of
        an earlier line (counted once). UserError for a record that does not belong here."""
        self._check_place(lineno, rec)
        key, digest = record_key(rec), checksum(rec)
        if key in self.seen:
            first, first_digest = self.seen[key]
            if digest == first_digest:
                return False
            task, length, index = key
            raise UserError(
                f"{self.path}:{lineno} records {task} sample {index} at {length} tokens again, "
                f"with other values than line {first}; keep the one that is right: delete the "
                f"other line (e.g. sed -i '{lineno}d' {self.path})"
            )
        self._check_setting(lineno, rec)
        self.seen[key] = (lineno, digest)
        return True

    def _check_place(self, lineno: int, rec: dict) -> None:
        if not self.cell:
            return
        theirs = {k: str(rec.get(k, v)) for k, v in self.cell.items()}
        if theirs != self.cell:
            where = "/".join(theirs.values())
            raise UserError(
                f"{self.path}:{lineno} is a record of {where}, not of the cell it sits in "
                f"({'/'.join(self.cell.values())}); a record counts only in its own cell's folder: "
                f"move that line back to {where}/{self.path.name}, or delete it "
                f"(e.g. sed -i '{lineno}d' {self.path})"
            )

    def _check_setting(self, lineno: int, rec: dict) -> None:
        have, whole = record_settings(rec)
        if self.first is None:
            self.first = (lineno, have, whole)
            return
        first, want, first_whole = self.first
        # a record older or newer than the first carries fewer or more keys: compare those both
        # carry, and every key of a group (model., method.) both carry whole
        keys = have.keys() & want.keys()
        for group in whole & first_whole:
            keys |= {k for k in have.keys() | want.keys() if k.startswith(group)}
        diff = sorted(k for k in keys if have.get(k) != want.get(k))
        if diff:
            k = diff[0]
            raise UserError(
                f"{self.path}:{lineno} was made with {k}={have.get(k)!r}, but line {first} with "
                f"{k}={want.get(k)!r}; a cell holds the records of one setting: move that line "
                f"to a cell of its own, or delete it (e.g. sed -i '{lineno}d' {self.path})"
            )


def read_records(path: Path, cell: dict | None = None) -> list[dict]:
    """All complete records of a JSONL file ([] if it does not exist or is empty), each checked
    (`_parse`, `_CellCheck`; `cell`: the experiment, model, method and budget they must carry)."""
    path = Path(path)
    try:
        data = paths.read_file(path)
    except FileNotFoundError:
        return []
    out, check = [], _CellCheck(path, cell)
    for lineno, line in enumerate(data.splitlines(keepends=True), 1):
        if line.endswith(b"\n"):
            rec = _parse(path, lineno, line)  # None: a torn write from a kill; RecordStore repairs
            if rec is not None and check.take(lineno, rec):
                out.append(rec)
    return out


def read_cell(path: Path) -> list[dict]:
    """The records of a cell's `records.jsonl`, bound to the cell its folder names (the one read
    of a cell for report, tables, figures and the scale report)."""
    return read_records(path, paths.cell_identity(path))


class RecordStore:
    """The records of one cell (experiment/model/method/budget), keyed by (task, length, index).

    `append` holds the cell's lock (`cell_lock`) while it reads what other processes appended
    and writes, so two stores of one file never record one key twice. `cell` (the runner's:
    `paths.cell_identity`) binds the records to their cell as `read_cell` does."""

    def __init__(self, path: Path, cell: dict | None = None):
        self.path = paths.check_inside(path)
        self.cell = cell
        self.lock = cell_lock(self.path.parent)
        with self.lock:
            self._reopen()

    def _read(self, offset: int = 0) -> bytes:
        try:
            with open(self.path, "rb", opener=paths.opener) as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def _repair(self) -> None:
        """Drop a torn last line so new records start on a fresh line."""
        data = self._read()
        good = [ln for ln in data.splitlines(keepends=True) if ln.endswith(b"\n") and _is_json(ln)]
        if sum(map(len, good)) != len(data):
            write_atomic(self.path, b"".join(good))

    def _refresh(self) -> None:
        """Read the complete lines appended since the last read (by any process)."""
        for line in self._read(self._offset).splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a write in progress elsewhere, or torn; read again next time
            self._offset += len(line)
            self._lines += 1
            rec = _parse(self.path, self._lines, line)
            if rec is not None and self._check.take(self._lines, rec):
                self.records[record_key(rec)] = rec

    def _reopen(self) -> None:
        self._repair()
        self.records, self._lines, self._offset = {}, 0, 0
        self._check = _CellCheck(self.path, self.cell)
        self._refresh()

    def done(self, key: tuple) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> bool:
        """Append `rec` (sealed with its checksum) unless its key is recorded (by this or another
        process); True if written. A write that fails is cut back off the file and re-raised
        with the file's name. SIGINT and SIGTERM wait until the line is written whole."""
        line = json.dumps(seal(rec), sort_keys=True, allow_nan=False) + "\n"
        with self.lock, deferred():
            self._refresh()
            if record_key(rec) in self.records:
                return False
            if self.path.exists() and self.path.stat().st_size != self._offset:
                self._reopen()  # a run killed mid-write left a torn line: drop it first
            try:
                with open(self.path, "a", encoding="utf-8", opener=paths.opener) as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                self._cut_back()
                raise OSError(e.errno, e.strerror, str(self.path)) from e
            self._refresh()
        return True

    def _cut_back(self) -> None:
        """Drop what a failed write left past the last complete record (a full disk may still
        let part of a line through), so the file holds exactly the samples recorded."""
        try:
            if self.path.exists() and self.path.stat().st_size > self._offset:
                os.truncate(self.path, self._offset)
        except OSError:
            pass  # the torn line is dropped when the file is next opened (`_repair`)


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a whole file so readers never see half of it (temp file, fsync, rename).

    The file keeps its permissions (a new file gets the umask's, as `open` would give it), so a
    rewrite never locks out the colleagues of a shared results directory. If the write fails (a
    full disk) the old file stays as it was and the error names the file. The path must stay
    inside its results folder and not be a link (`paths.check_inside`); SIGINT and SIGTERM wait
    until the file is replaced."""
    path = paths.check_inside(path)
    paths.make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.lstat() if os.path.lexists(path) else None
    if old is not None and paths.not_regular(path, old.st_mode) is not None:
        raise paths.not_regular(path, old.st_mode)
    with deferred():
        try:
            # created as `open` creates a file (0o666 less the umask), then given the old file's
            # mode; never through a link left at the temp name
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            with open(os.open(tmp, flags, 0o666), "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            if old is not None:
                os.chmod(tmp, old.st_mode & 0o7777)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, e.strerror, str(path)) from e


_JSON_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def read_cell_file(path: Path, fix: str | None = None) -> dict | None:
    """The settings in a cell's `cell.json` (None if there is none), or a UserError naming the
    file and `fix` (default: delete it, for a cache the runner rebuilds from the records) when it
    holds anything but a JSON object."""
    path = Path(path)
    try:
        raw = paths.read_file(path)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        data, what = None, "bytes that are not UTF-8 text"
    except json.JSONDecodeError as e:
        data, what = None, f"text that is not JSON ({e.msg} at line {e.lineno})"
    else:
        if isinstance(data, dict):
            return data
        what = "JSON null" if data is None else f"a JSON {_JSON_KINDS.get(type(data), 'value')}"
    fix = fix or (
        f"delete it (rm {path}) and rerun: it is a cache, rebuilt from the records beside it"
    )
    raise UserError(f"{path} holds {what}, not the settings of the cell's records; {fix}")


def check_fingerprint(path: Path, fingerprint: dict) -> None:
    """Refuse to mix records made with different settings in one cell directory."""
    path = Path(path)
    if not os.path.lexists(path):
        write_atomic(path, json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        return
    old = read_cell_file(
        path, f"delete {path.parent} (no settings vouch for its records) or set results_dir=..."
    )
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
    old = read_cell_file(cached)
    if old is not None:
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
    text = (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()
    try:
        same = paths.read_file(path) == text
    except FileNotFoundError:
        same = False
    if not same:
        write_atomic(path, text)
