"""The harness's one error type for bad input, and how a command reports it: one line on stderr
(`rbs-bench: error: ...`, what to change) and exit status 2, never a traceback.

This module imports nothing of the package and nothing outside the standard library, so that
modules which only read files (run records, loggers, tables) can raise it without loading torch,
Triton or Hydra.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable

PREFIX = "rbs-bench: error: "
STATUS = 2  # the exit status of a command stopped by bad input

# OSErrors that the user fixes outside the harness, and what to do about each.
_FIXES = {
    errno.ENOSPC: "free space there (or set results_dir=... elsewhere)",
    errno.EDQUOT: "free space within your quota there (or set results_dir=... elsewhere)",
    errno.EROFS: "set results_dir=... to a writable file system",
}


class UserError(Exception):
    """Bad input: printed as one line (what to change), never as a traceback."""


def os_error_line(exc: OSError) -> str | None:
    """One line for an OSError the user fixes (a full disk, a quota, a read-only file system),
    naming the file; None for any other OSError."""
    fix = _FIXES.get(exc.errno)
    if fix is None:
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return (
        f"{exc.strerror or errno.errorcode.get(exc.errno, exc.errno)}{where}; {fix}, then rerun "
        "the same command: what was recorded is kept and the rest resumes"
    )


def one_line(fn: Callable[[], int | None]) -> int:
    """Run a command's body: its own status (0 for None), or STATUS with one line on stderr for a
    UserError or an OSError that `os_error_line` explains."""
    try:
        return fn() or 0
    except UserError as e:
        print(f"{PREFIX}{e}", file=sys.stderr)
    except OSError as e:
        line = os_error_line(e)
        if line is None:
            raise
        print(f"{PREFIX}{line}", file=sys.stderr)
    return STATUS


def first_line(e: BaseException, typed: bool = False) -> str:
    """An exception's first line for a one-line message (its type's name when it has no text;
    `typed`: always led by the type's name, for errors raised inside someone else's code)."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0]}" if typed else lines[0]
