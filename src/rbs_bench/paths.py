"""The layout of a results directory, in one place: every module that reads or writes under
`results_dir` builds its paths here.

    <results>/runs/<experiment>/<model>/                   one experiment on one model: summary.md,
                                                           summary*.csv, plots (`experiment_dir`)
    <results>/runs/<experiment>/<model>/<method>/<budget>/ one cell (`cell_dir`): records.jsonl,
                                                           cell.json, .lock
    <results>/calibration/<model>/<method>.yaml            calibrated knobs (`calibration_file`;
                                                           calibration.dir moves the folder)
    <results>/speed/                                       timing CSVs and plots
    <results>/tables/  <results>/figures/  <results>/scale/  tables, figures, GPU cost reports
    <results>/paper/paper_values.csv                       the paper's numbers

Every name that becomes a folder or file name (experiment, model, method, budget) must be one path
component: not empty, not `.` or `..`, without a path separator or a NUL byte, and at most
NAME_BYTES long. A name that is not stops with one line (`component`), so nothing is ever written
outside its directory.

**Writes stay inside results_dir.** An entry point registers the folders it writes below
(`confine`: results_dir, a calibration or output folder given elsewhere); every write checks its
path first (`check_inside`): no folder on the way below a registered folder may be a symbolic link
that leads out of it, and the file itself may not be a link at all. Files are opened through
`opener`, which adds O_NOFOLLOW and O_NONBLOCK and accepts only a regular file: a FIFO, device,
socket or folder where a file is expected is refused with one line, never opened for a blocking
read. (A link inside results_dir that leads to another place inside it is followed.)
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from rbs_bench.errors import UserError

RUNS = "runs"
CALIBRATION = "calibration"
SPEED = "speed"
TABLES = "tables"
FIGURES = "figures"
SCALE = "scale"
PAPER_VALUES = ("paper", "paper_values.csv")
RECORDS = "records.jsonl"  # a cell's run records, one JSON line per sample
CELL_FILE = "cell.json"  # the settings the records of a cell were made with (a cache)
LOCK_NAME = ".lock"  # the lock a cell's writers hold (records.cell_lock)
SUMMARY = "summary.md"  # an experiment's summary on one model (report.write_summary)

_SEPARATORS = {"/", "\\", os.sep, os.altsep, "\0"} - {None}
# The longest name (in UTF-8 bytes) that becomes a folder or file name: file names are made of up
# to two names and a suffix (tables/<experiment>_<model>.md, their temp files), within the 255
# bytes a file system allows.
NAME_BYTES = 100


def component(value, key: str) -> str:
    """`value` as one path component, or a UserError naming `key` (the config key that set it)."""
    text = "" if value is None else str(value)
    size = len(text.encode("utf-8", "surrogateescape"))
    shown = text if size <= 60 else f"{text[:40]}..."
    bad = None
    if not text.strip():
        bad = "is empty"
    elif text in (".", ".."):
        bad = "names a directory of the path itself"
    elif any(s in text for s in _SEPARATORS):
        bad = "holds a path separator"
    elif size > NAME_BYTES:
        bad = f"is {size} bytes long, more than the {NAME_BYTES} a name may have"
    if bad:
        raise UserError(
            f"{key}={shown!r} {bad}; it becomes one folder or file name under results_dir, so "
            f"use a plain name such as {key}=d50 (letters, digits, '_', '-', '.')"
        )
    return text


RESULTS_HINT = "give --results the folder that holds runs/ (default: results)"


def results_folder(path, hint: str = RESULTS_HINT) -> Path:
    """`path`, an existing folder of results, registered with `confine`; otherwise a UserError
    naming it with `hint` (what to give instead): a missing folder is a mistyped path, not a
    folder without records."""
    if not Path(path).is_dir():
        what = "is not a folder" if os.path.lexists(path) else "does not exist"
        raise UserError(f"{path} {what}; {hint}")
    return confine(path)


def runs_dir(results) -> Path:
    return Path(results) / RUNS


def experiment_dir(results, experiment: str, model: str) -> Path:
    """<results>/runs/<experiment>/<model>: an experiment's cells on one model, and its summary."""
    return runs_dir(results) / component(experiment, "experiment") / component(model, "model.name")


def cell_dir(results, experiment: str, model: str, method: str, budget: str) -> Path:
    """<results>/runs/<experiment>/<model>/<method>/<budget>: one cell's records."""
    return (
        experiment_dir(results, experiment, model)
        / component(method, "method.name")
        / component(budget, "budget.name")
    )


def experiment_dirs(results) -> list[Path]:
    """Every <results>/runs/<experiment>/<model> folder, sorted."""
    return sorted(p for p in runs_dir(results).glob("*/*") if p.is_dir())


CELL_KEYS = ("experiment", "model", "method", "budget")  # what a cell's folders are named after


def cell_identity(records) -> dict[str, str]:
    """The cell a `<...>/<experiment>/<model>/<method>/<budget>/records.jsonl` belongs to, by
    its folders' names: what every record in it must carry (records.read_cell)."""
    return dict(zip(CELL_KEYS, Path(os.path.abspath(records)).parts[-5:-1]))


def cell_records(exp_dir) -> list[Path]:
    """The records file of every cell of an experiment folder, sorted."""
    return sorted(Path(exp_dir).glob(f"*/*/{RECORDS}"))


def calibration_dir(results) -> Path:
    return Path(results) / CALIBRATION


def calibration_file(cal_dir, model: str, method: str) -> Path:
    """<calibration dir>/<model>/<method>.yaml: the calibrated knobs of one method on one model."""
    name = component(method, "method.name")
    return Path(cal_dir) / component(model, "model.name") / f"{name}.yaml"


def speed_dir(results) -> Path:
    return Path(results) / SPEED


def tables_dir(results) -> Path:
    return Path(results) / TABLES


def figures_dir(results) -> Path:
    return Path(results) / FIGURES


def scale_dir(results) -> Path:
    return Path(results) / SCALE


def paper_values_file(results) -> Path:
    return Path(results).joinpath(*PAPER_VALUES)


# ------------------------------------------------------------------------------------------------
# Writes stay inside the registered folders; files are regular files, opened without following
# a final link.

_ROOTS: set[str] = set()  # absolute folders (as given, links unresolved) writes stay inside


def confine(root) -> Path:
    """Register `root` (a results folder, or an output folder given elsewhere): from now on a
    write below it that a symbolic link would carry out of it is refused (`check_inside`)."""
    _ROOTS.add(os.path.abspath(root))
    return Path(root)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_inside(path, file: bool = True) -> Path:
    """`path` if writing it stays where its name says: below every registered folder that holds
    it by name, no existing folder on the way is a symbolic link leading out of that folder; and
    (`file`) the path itself is not a symbolic link. Otherwise a UserError naming the link."""
    full = os.path.abspath(path)
    for root in sorted(r for r in _ROOTS if _under(full, r)):
        real_root, cur = os.path.realpath(root), root
        for part in Path(full).relative_to(root).parts:
            cur = os.path.join(cur, part)
            if os.path.islink(cur) and not _under(os.path.realpath(cur), real_root):
                raise UserError(
                    f"{cur} is a symbolic link to {os.readlink(cur)}, which leads out of {root}; "
                    "rbs-bench writes nothing outside its results folder: replace the link with "
                    "a folder, or point results_dir=... at the place itself"
                )
    if file and os.path.islink(full):
        raise UserError(
            f"{full} is a symbolic link (to {os.readlink(full)}); rbs-bench writes and reads no "
            "file of a results folder through a link: replace the link with the file, or delete it"
        )
    return Path(path)


def make_dirs(path) -> Path:
    """`os.makedirs(path, exist_ok=True)` once `check_inside` passes it."""
    check_inside(path, file=False)
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(path, mode: int) -> UserError | None:
    """The UserError for a file that is not a regular file (by its lstat mode), or None."""
    for test, kind in _KINDS:
        if test(mode):
            return UserError(
                f"{path} is {kind}, not a regular file; rbs-bench reads and writes only regular "
                "files in a results folder: put the file itself there, or delete it"
            )
    return None


def opener(path, flags: int) -> int:
    """An `opener` for `open()`: the file descriptor of `path` opened without following a final
    symbolic link and without blocking, once it is known to be a regular file (UserError naming
    it otherwise; a FIFO or device is never opened)."""
    try:
        problem = not_regular(path, os.lstat(path).st_mode)
    except FileNotFoundError:
        problem = None  # created by this open (O_CREAT) or missing: open says which
    if problem is not None:
        raise problem
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since the check
            raise not_regular(path, stat.S_IFLNK) from None
        raise
    problem = not_regular(path, os.fstat(fd).st_mode)
    if problem is not None:
        os.close(fd)
        raise problem
    return fd


def read_file(path) -> bytes:
    """The bytes of a regular file (`opener`'s checks); FileNotFoundError if there is none."""
    with open(path, "rb", opener=opener) as f:
        return f.read()


def read_text(path) -> io.StringIO:
    """A regular file's UTF-8 text (`read_file`) as a file object, for csv and pandas readers."""
    return io.StringIO(read_file(path).decode("utf-8"))
