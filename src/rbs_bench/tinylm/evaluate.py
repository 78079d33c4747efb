"""Dense RULER accuracy of a trained model: `python -m rbs_bench.tinylm.evaluate --model DIR`.

Each (task, context length) runs as its own `python -m rbs_bench method=dense model.hf_id=DIR
...` process (several at once with --jobs; --time-limit stops what still runs then), writing run
records under `--out/<task>-<length>/`; the table (task x length, mean score and sample count) is
rebuilt from every record under --out, so calls with other tasks, lengths or sample counts into
subdirectories of one --out add to one table. Finished samples are skipped on a rerun, as in every
run of the harness. Essay-haystack tasks need a text (--essays).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rbs_bench.methods import DENSE

# RULER tasks that need no downloaded data, and those that need an essay haystack.
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
ESSAY_TASKS = (
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
)


def job_command(
    model: str,
    tasks: list[str],
    length: int,
    samples: int,
    results: Path,
    device: str,
    essays: str | None,
    max_new_tokens: int | None,
    dtype: str = "auto",
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "rbs_bench",
        f"method={DENSE}",
        f"model.hf_id={model}",
        f"benchmark.tasks=[{','.join(tasks)}]",
        f"benchmark.context_lengths=[{length}]",
        f"benchmark.num_samples={samples}",
        f"results_dir={results}",
        f"device={device}",
        f"model.dtype={dtype}",
        "progress=false",
    ]
    if essays:
        cmd.append(f"+benchmark.data.essays={essays}")
    if max_new_tokens:
        cmd.append(f"benchmark.max_new_tokens={max_new_tokens}")
    return cmd


def run_jobs(args) -> list[tuple[str, int]]:
    """Run every (length, task) job; returns (job name, exit code) pairs."""
    out = Path(args.out)
    jobs = []
    for length in args.lengths:
        for task in args.tasks:
            name = f"{task}-{length}"
            cmd = job_command(
                str(Path(args.model).resolve()),
                [task],
                length,
                args.samples,
                out / name,
                args.device,
                args.essays,
                args.max_new_tokens,
                args.dtype,
            )
            jobs.append((name, cmd))

    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    deadline = time.monotonic() + args.time_limit if args.time_limit else None

    def run(job):
        name, cmd = job
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            print(f"{name}: skipped (time limit)", flush=True)
            return name, -1
        (out / name).mkdir(parents=True, exist_ok=True)
        with (out / name / "log.txt").open("w") as log:
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=left
                ).returncode
            except subprocess.TimeoutExpired:  # the records written so far are kept
                rc = -1
        print(
            f"{name}: {'done' if rc == 0 else f'stopped (exit {rc}), see {out / name}/log.txt'}",
            flush=True,
        )
        return name, rc

    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(run, jobs))


def collect(out: Path) -> dict[tuple[str, int], list[dict]]:
    by_cell: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in sorted(out.rglob("records.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            by_cell[(rec["task"], rec["context_length"])].append(rec)
    return by_cell


def summary_rows(out: Path) -> list[dict]:
    """One row per (task, length): mean score and sample count, as table.csv holds them (the
    embedded model's card reads its committed copy, results/tinylm/ruler_dense_<gpu>.csv)."""
    cells = collect(out)
    return [
        {
            "task": t,
            "context_length": n,
            "score": round(sum(r["score"] for r in recs) / len(recs), 1),
            "samples": len(recs),
            "haystack": "essay" if t in ESSAY_TASKS else "built in",
        }
        for (t, n), recs in sorted(
            cells.items(), key=lambda kv: (kv[0][0] not in OFFLINE_TASKS, kv[0])
        )
    ]


def table(out: Path) -> str:
    """Markdown: mean score per task and length (samples in brackets), and failure examples."""
    cells = collect(out)
    if not cells:
        return "no records"
    tasks = sorted({t for t, _ in cells}, key=lambda t: (t not in OFFLINE_TASKS, t))
    lengths = sorted({n for _, n in cells})
    lines = [
        "| task | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for t in tasks:
        row = []
        for n in lengths:
            recs = cells.get((t, n), [])
            row.append(
                f"{sum(r['score'] for r in recs) / len(recs):.1f} ({len(recs)})" if recs else "-"
            )
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    lines += ["", "Wrong answers (first two per cell):", ""]
    for (t, n), recs in sorted(cells.items()):
        for r in [r for r in recs if r["score"] < 100][:2]:
            lines.append(f"- {t} @ {n}: refs {r['references']} -> {r['prediction'][:120]!r}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rbs_bench.tinylm.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", required=True, help="model directory (from_pretrained)")
    p.add_argument("--out", required=True, help="results directory (records, table.md/.csv)")
    p.add_argument("--tasks", nargs="+", default=list(OFFLINE_TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--dtype",
        default="auto",
        help="model.dtype (auto: the checkpoint's, bfloat16 for the shipped model)",
    )
    p.add_argument("--essays", help="essay haystack (text file or directory) for essay tasks")
    p.add_argument("--max-new-tokens", type=int, help="override the tasks' generation budget")
    p.add_argument("--jobs", type=int, default=4, help="processes at once")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per process")
    p.add_argument("--time-limit", type=float, help="seconds; jobs still running then are stopped")
    p.add_argument("--table-only", action="store_true", help="rebuild the table, run nothing")
    args = p.parse_args(argv)
    problem = None
    needs = sorted(set(args.tasks) & set(ESSAY_TASKS))
    if not args.table_only and not (Path(args.model) / "config.json").is_file():
        problem = f"--model {args.model} holds no config.json; give a trained model directory"
    elif needs and not args.essays and not args.table_only:
        problem = f"tasks {', '.join(needs)} need an essay haystack: give --essays PATH"
    if problem:
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    out = Path(args.out)
    failed = []
    if not args.table_only:
        failed = [name for name, rc in run_jobs(args) if rc != 0]
    text = table(out)
    (out / "table.md").write_text(text + "\n")
    rows = summary_rows(out)
    if rows:
        head = list(rows[0])
        lines = [",".join(head)] + [",".join(str(r[k]) for k in head) for r in rows]
        (out / "table.csv").write_text("\n".join(lines) + "\n")
    print(text)
    if failed:
        raise SystemExit(f"failed jobs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
