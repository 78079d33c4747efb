"""The harness's one error type for bad input, and how a command reports it: one line on stderr
(`rbs-bench: error: ...`, what to change) and exit status 2, never a traceback. And how a command
ends on SIGINT or SIGTERM: one line (`rbs-bench: stopped by SIGTERM ...`) and exit status
128 + the signal's number (130, 143), once the record or file being written is whole.

Exit statuses of every command: 0 done (or stopped by its time budget: rerun to continue);
1 some work failed and the others finished (`parallel`: a cell; `report`: a folder without
records); 2 bad input, nothing run; 130 SIGINT and 143 SIGTERM: stopped, what was recorded is
kept, rerun to continue.

This module imports nothing of the package and nothing outside the standard library, so that
modules which only read files (run records, loggers, tables) can raise it without loading torch,
Triton or Hydra.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import sys
import threading
from collections.abc import Callable

PREFIX = "rbs-bench: error: "
STATUS = 2  # the exit status of a command stopped by bad input
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# OSErrors that the user fixes outside the harness, and what to do about each.
_FIXES = {
    errno.ENOSPC: "free space there (or set results_dir=... elsewhere)",
    errno.EDQUOT: "free space within your quota there (or set results_dir=... elsewhere)",
    errno.EROFS: "set results_dir=... to a writable file system",
    errno.EACCES: "fix the permissions there (or set results_dir=... elsewhere)",
    errno.EPERM: "fix the permissions there (or set results_dir=... elsewhere)",
}


class UserError(Exception):
    """Bad input: printed as one line (what to change), never as a traceback."""


def os_error_line(exc: OSError) -> str | None:
    """One line for an OSError the user fixes (a full disk, a quota, a read-only file system, a
    file or folder without permission), naming the file; None for any other OSError."""
    fix = _FIXES.get(exc.errno)
    if fix is None:
        return None
    where = f" at {exc.filename}" if exc.filename else ""
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


def positive_seconds(text: str) -> float:
    """A time budget given on a command line: a finite number of seconds above 0 (an argparse
    `type`; a bad one is argparse's one-line usage error, exit status 2)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


# ------------------------------------------------------------------------------------------------
# SIGINT and SIGTERM: one line, exit status 128 + the signal, never half a record or file.


class _Stop:
    owner: int | None = None  # the process that installed the handlers (not a forked child)
    depth = 0  # nested `deferred` blocks running now
    pending: int | None = None  # a signal that arrived inside one
    signum: int | None = None  # the signal the command is stopping on


def stop_on_signals() -> None:
    """End the command on SIGINT (Ctrl-C) or SIGTERM (what `timeout`, SLURM and `kill` send) with
    one line on stderr and exit status 128 + the signal's number. The stop is a SystemExit raised
    where the program is: every `finally` and `with` runs, so locks are released and the sample
    in flight is discarded whole; a record or file being written (`deferred`) is finished first.
    Later signals are ignored while the command unwinds. Installed by every entry point (and on
    `python -m rbs_bench...` when the package is imported); a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    _Stop.owner, _Stop.depth, _Stop.pending, _Stop.signum = os.getpid(), 0, None, None
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def stopping() -> int | None:
    """The signal the command is stopping on, or None: code that turns other people's
    exceptions into one line (plugins) lets this stop through."""
    return _Stop.signum


def _on_signal(signum: int, frame) -> None:
    if os.getpid() != _Stop.owner:  # a forked worker (a data loader's): the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _Stop.signum is not None:
        return  # already stopping: let it finish
    if _Stop.depth:
        _Stop.pending = signum
        return
    _stop(signum)


def _stop(signum: int) -> None:
    _Stop.signum = signum
    status = 128 + signum
    print(
        f"rbs-bench: stopped by {signal.Signals(signum).name} (exit status {status}); what was "
        "recorded is kept: rerun the same command to continue",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(status)


@contextlib.contextmanager
def deferred():
    """Hold SIGINT and SIGTERM while the block runs (a record's append, a file's replacement):
    one that arrives meanwhile stops the command right after the block, so no stop leaves half
    of a write."""
    _Stop.depth += 1
    try:
        yield
    finally:
        _Stop.depth -= 1
        if not _Stop.depth and _Stop.pending is not None and _Stop.signum is None:
            signum, _Stop.pending = _Stop.pending, None
            _stop(signum)
