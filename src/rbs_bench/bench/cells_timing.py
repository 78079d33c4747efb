"""Time a set of cells run as the harness runs them (`python -m rbs_bench.parallel`), from a fresh
results folder, and write one CSV row per method from the records the run wrote.

    python -m rbs_bench.bench.cells_timing --results /tmp/cells --label warm_cache \\
        --csv seven_cells_16k --calibration results/calibration -- \\
        ruler_budget_16k=60 --jobs 7 -- budget=d10 device=cuda 'benchmark.tasks=[niah_multikey_2]'

Everything after the first `--` is `parallel`'s command line; its `--results` is this command's.
The folder must hold no records of these cells (a timing of a resumed run would count only part
of them); `--calibration DIR` copies calibrations into it first. Rows are appended to
OUT/<csv>_<gpu>.csv: the run's label, the wall time of the whole command (process start-up
included), `parallel`'s own time, and per method n, accuracy, density and the medians of a
sample's first token, decoding and recall pass, the dtype, how its tokens were decoded, and the
seconds from the start to its first and its last record; then `parallel`'s start-up as it reports
it (composing the cells, importing the harness before the first fork) and whether Python could keep
the bytecode it compiles (`bytecode`: kept, or not written where PYTHONDONTWRITEBYTECODE is set: an
image without bytecode then compiles torch's and transformers' sources in every process). A CSV
with fewer columns gets them, empty on its older rows.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from rbs_bench import paths
from rbs_bench.errors import UserError, one_line
from rbs_bench.records import read_cell
from rbs_bench.scale import gpu_slug

COLUMNS = [
    "run", "gpu", "processes", "cells", "samples", "wall_s", "parallel_s", "method", "n",
    "accuracy", "density", "ttft_s_median", "decode_s_median", "recall_s_median",
    "new_tokens_median", "dtype", "compiled", "decode", "first_record_s", "last_record_s",
    "compose_s", "import_s", "bytecode",
]  # fmt: skip
# parallel's start-up line (`parallel.run`)
STARTUP = re.compile(
    r"cells composed and their records read in (\d+(?:\.\d+)?) s; the harness imported for "
    r"forking in (\d+(?:\.\d+)?) s"
)


def _cell_files(results: Path) -> list[Path]:
    """The records file of every cell under results/runs (<experiment>/<model>/ folders)."""
    experiments = sorted(paths.runs_dir(results).glob("*/*"))
    return [path for exp in experiments for path in paths.cell_records(exp)]


def _records(results: Path) -> dict[str, list[dict]]:
    """Every record under results/runs, by method."""
    by_method: dict[str, list[dict]] = {}
    for path in _cell_files(results):
        for rec in read_cell(path):
            by_method.setdefault(rec["method"], []).append(rec)
    return by_method


def _stamp(rec: dict) -> float:
    """A record's wall-clock time (its `time`, local, to the second) as seconds since the epoch."""
    return time.mktime(time.strptime(rec["time"], "%Y-%m-%dT%H:%M:%S"))


def startup(stdout: str) -> tuple[float | None, float | None]:
    """(composing s, importing s) from parallel's output; None where it forked no cell."""
    found = STARTUP.search(stdout)
    return (float(found.group(1)), float(found.group(2))) if found else (None, None)


def rows(
    label: str,
    jobs: int,
    wall: float,
    parallel_s: float | None,
    results: Path,
    t0: float,
    started: tuple = (None, None),
) -> list:
    """The CSV rows of one timed run, from its records; `t0`: the run's start (time.time()), from
    which each method's first and last records are timed (to the second): the first is the cell's
    start-up and its first sample, the span between them its sampling. `started`: parallel's
    (composing, importing) seconds."""
    bytecode = "not written" if sys.flags.dont_write_bytecode else "kept"
    by_method = _records(results)
    samples = sum(len(r) for r in by_method.values())
    cells = len({(r["budget"], m) for m, recs in by_method.items() for r in recs})
    out = []
    for method, recs in by_method.items():

        def med(key, recs=recs):
            return median(r.get(key) or 0.0 for r in recs)

        dtypes = {r.get("model_identity", {}).get("dtype") for r in recs} - {None}
        decode = {r.get("decode", "eager") for r in recs}
        out.append([
            label, recs[0].get("gpu") or "cpu", jobs, cells, samples, round(wall, 1),
            parallel_s, method, len(recs), round(sum(r["score"] for r in recs) / len(recs), 4),
            round(sum(r["density"] for r in recs) / len(recs), 5), med("ttft_s"), med("decode_s"),
            med("recall_s"), med("new_tokens"), "/".join(sorted(map(str, dtypes))),
            any(r.get("compiled") for r in recs), "/".join(sorted(decode)),
            round(min(map(_stamp, recs)) - t0), round(max(map(_stamp, recs)) - t0), *started,
            bytecode,
        ])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise UserError(
            "give parallel's command line after --, e.g. -- ruler_budget_16k=60 --jobs 7"
        )
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m rbs_bench.bench.cells_timing")
    p.add_argument("--results", required=True, help="a results folder without these cells' records")
    p.add_argument("--label", required=True, help="the run's name in the CSV (e.g. warm_cache)")
    p.add_argument("--csv", required=True, help="the CSV's name before _<gpu>.csv")
    p.add_argument("--out", default="results/speed", help="where the CSV goes")
    p.add_argument("--calibration", help="a calibration folder to copy into --results first")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    results = Path(args.results)
    if _cell_files(results):
        raise UserError(f"{results} already holds records; time a run from an empty folder")
    if args.calibration:
        shutil.copytree(args.calibration, results / "calibration", dirs_exist_ok=True)
    jobs = 1
    if "--jobs" in command:
        jobs = int(command[command.index("--jobs") + 1])
    cmd = [sys.executable, "-m", "rbs_bench.parallel", *_with_results(command, results)]
    started, t0 = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(proc.stdout[-4000:])
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        return proc.returncode
    found = re.search(r"(\d+(?:\.\d+)?) s: every cell complete", proc.stdout)
    parallel_s = float(found.group(1)) if found else None
    table = rows(args.label, jobs, wall, parallel_s, results, started, startup(proc.stdout))
    if not table:
        raise UserError(f"the run wrote no records under {results}/runs")
    out = Path(args.out) / f"{args.csv}_{gpu_slug(table[0][1])}.csv"
    append(out, table)
    print(f"{args.label}: {table[0][4]} samples in {wall:.1f} s -> {out}")
    return 0


def append(out: Path, table: list) -> None:
    """Append rows to the CSV, first giving an older file (fewer columns) today's, empty on its
    rows, so that every row lines up with the header."""
    out.parent.mkdir(parents=True, exist_ok=True)
    old: list[dict] = []
    rewrite = not out.exists()
    if not rewrite:
        with open(out, newline="") as f:
            reader = csv.DictReader(f)
            rewrite = reader.fieldnames != COLUMNS
            old = list(reader) if rewrite else []
    if rewrite:
        tmp = out.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS)
            w.writeheader()
            w.writerows({k: row.get(k, "") for k in COLUMNS} for row in old)
        os.replace(tmp, out)
    with open(out, "a", newline="") as f:
        csv.writer(f).writerows(table)


def _with_results(command: list[str], results: Path) -> list[str]:
    """parallel's arguments with --results set to this run's folder (before its own --)."""
    cut = command.index("--") if "--" in command else len(command)
    head, tail = command[:cut], command[cut:]
    if "--results" in head:
        i = head.index("--results")
        head = head[:i] + head[i + 2 :]
    return [*head, "--results", str(results), *tail]


if __name__ == "__main__":
    sys.exit(one_line(lambda: main()))
