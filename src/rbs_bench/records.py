"""Run records: one JSON line per finished sample, appended so that a kill loses at most one.

Each line is written with a single `write` of the whole line followed by fsync. A line cut short by
a kill (no trailing newline, or not valid JSON) is dropped when the file is next opened, so a rerun
of the same command resumes with exactly the samples that finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rbs_bench.config import UserError

KEY_FIELDS = ("task", "context_length", "index")


def record_key(rec: dict) -> tuple:
    return tuple(rec[f] for f in KEY_FIELDS)


def read_records(path: Path) -> list[dict]:
    """All complete records of a JSONL file ([] if it does not exist)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if line.endswith("\n"):
                out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a torn write from a kill; repaired by RecordStore
    return out


class RecordStore:
    """The records of one cell (experiment/model/method/budget), keyed by (task, length, index)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self.records = {record_key(r): r for r in read_records(self.path)}

    def _repair(self) -> None:
        """Drop a torn last line so new records start on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = [ln for ln in data.splitlines(keepends=True) if ln.endswith(b"\n") and _is_json(ln)]
        if sum(map(len, good)) != len(data):
            tmp = self.path.with_suffix(".repair")
            tmp.write_bytes(b"".join(good))
            os.replace(tmp, self.path)

    def done(self, key: tuple) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[record_key(rec)] = rec


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
