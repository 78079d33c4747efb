"""Generated blocks of the embedded model's card (src/rbs_bench/tinylm/weights/README.md): its
training runs, its dense RULER accuracy and its cost on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from rbs_bench import paths
from rbs_bench.methods import DENSE
from rbs_bench.tables.blocks import MISSING, Sources, block, md_table, num, read_csv, sources_line
from rbs_bench.tables.blocks_accuracy import records
from rbs_bench.tables.render import context_label

WEIGHTS = Path("src") / "rbs_bench" / "tinylm" / "weights"
LAST_LOGS = 50  # the training summary's window: the last logs of each stage
TASKS = ("kv_single", "kv_lookup", "kv_multi", "var_chain")  # the exact answers it reports
EVAL_GPU = "nvidia_h100_80gb_hbm3"


def _stage(src: Sources, stage: int) -> tuple[dict, list[dict]]:
    """A training stage's run file and its log lines."""
    weights = src.root / WEIGHTS
    run = json.loads(src.need(weights / f"stage{stage}_run.json").read_text())
    text = src.need(weights / "train_log.jsonl").read_text()
    log = [json.loads(line) for line in text.splitlines() if line.strip()]
    return run, [r for r in log if r["stage"] == stage]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@block("tinylm_training")
def tinylm_training(src: Sources) -> str:
    """Both training runs: curriculum, steps, learning rate, time and the last logs' losses."""
    runs = [_stage(src, s) for s in (1, 2)]
    cols = []
    for run, log in runs:
        cfg, last = run["settings"], log[-LAST_LOGS:]
        exact = []
        for task in TASKS:
            vals = [r["exact_by_task"][task] for r in last if task in r["exact_by_task"]]
            exact.append(f"{task} {sum(vals) / len(vals):.2f}" if vals else f"{task} {MISSING}")
        cols.append([
            cfg["stages"].replace(",", ", "),
            f"{run['steps']:,} / {run['tokens'] / 1e6:.1f}M",
            f"{cfg['lr']:g}, warmup {cfg['warmup']}, cosine to {cfg['lr'] * cfg['min_lr_ratio']:g}",
            f"{log[-1]['elapsed_s']:.0f} s",
            " / ".join(f"{_mean(last, k):.3f}" for k in ("loss_answer", "loss_recall",
                                                          "loss_context")),
            ", ".join(exact),
        ])  # fmt: skip
    what = [
        "curriculum (length:steps)", "steps / tokens", "learning rate", "training time",
        f"last {LAST_LOGS} logs: answer / recall / context loss",
        f"last {LAST_LOGS} logs: exact answers (teacher forcing)",
    ]  # fmt: skip
    rows = [[w, a, b] for w, a, b in zip(what, cols[0], cols[1])]
    seeds = [run["settings"]["seed"] for run, _ in runs]
    head = ["", f"stage 1 (from scratch, seed {seeds[0]})"]
    head += [f"stage 2 (from stage 1, seed {seeds[1]})"]
    files = [src.root / WEIGHTS / f"stage{s}_run.json" for s in (1, 2)]
    files.append(src.root / WEIGHTS / "train_log.jsonl")
    return md_table(head, rows, keys=3) + "\n" + sources_line(src, files) + "\n"


@block("tinylm_ruler_dense")
def tinylm_ruler_dense(src: Sources) -> str:
    """Dense accuracy per RULER task and length, from the evaluation's table (the H100 run)."""
    path = src.results / "tinylm" / f"ruler_dense_{EVAL_GPU}.csv"
    df = read_csv(src, path)
    lengths = sorted(df["context_length"].unique())
    order = list(dict.fromkeys(df["task"]))
    cell = {(r.task, r.context_length): r for r in df.itertuples()}
    rows = []
    for task in order:
        star = " *" if cell[next(k for k in cell if k[0] == task)].haystack == "essay" else ""
        rows.append([task + star] + [
            f"{cell[(task, n)].score:.1f} ({cell[(task, n)].samples})" if (task, n) in cell
            else "-" for n in lengths
        ])  # fmt: skip
    means = df.groupby("context_length")["score"].agg(["mean", "size"])
    rows.append(["mean of the tasks run"] + [
        f"{means.loc[n, 'mean']:.1f} ({means.loc[n, 'size']} tasks)" for n in lengths
    ])  # fmt: skip
    head = ["task"] + [str(n) for n in lengths]
    return md_table(head, rows) + "\n" + sources_line(src, [path]) + "\n"


@block("tinylm_dense_records")
def tinylm_dense_records(src: Sources) -> str:
    """Dense accuracy of the embedded model in the committed run records, per task and length."""
    frames, files = [], []
    for folder in paths.experiment_dirs(src.results):
        if folder.name != "tiny" or not (folder / DENSE).is_dir():
            continue
        df = records(src, folder)
        if "method" not in df or "score" not in df:
            continue
        dense = df[(df["method"] == DENSE) & (df.get("benchmark") == "ruler")]
        if len(dense):
            frames.append(dense.assign(experiment=folder.parent.name))
            files.append(folder / DENSE)
    df = pd.concat(frames)
    gpu = df["gpu"].fillna("CPU") if "gpu" in df else "CPU"
    df = df.assign(ran_on=gpu)
    rows = []
    keys = ["experiment", "task", "context_length", "ran_on"]
    for (exp, task, n, dev), grp in df.groupby(keys, sort=True):
        rows.append([f"`{exp}`", task, context_label(int(n)), dev or "CPU", str(len(grp)),
                     num(grp["score"].mean())])  # fmt: skip
    head = ["experiment", "task", "length", "ran on", "samples", "accuracy"]
    return md_table(head, rows, keys=4) + "\n" + sources_line(src, files) + "\n"


@block("tinylm_cpu")
def tinylm_cpu(src: Sources) -> str:
    """One 8K RULER prompt, dense, on this repository's CPU in float32 and bfloat16."""
    rows, files = [], []
    for dtype in ("float32", "bfloat16"):
        path = src.results / "speed" / f"tiny_8k_{dtype}_cpu.csv"
        r = read_csv(src, path).iloc[0]
        files.append(path)
        rows.append([
            f"`{r['dtype']}`", f"{int(r['input_tokens']):,}", f"{r['prefill_s']:.2f} s",
            f"{r['request_s']:.2f} s", str(r["samples"]), f"{r['threads']}",
            f"torch {r['torch']}, {str(r['time'])[:10]}",
        ])  # fmt: skip
    head = ["dtype", "prompt tokens", "prefill", "prefill + greedy answer", "samples (median)"]
    head += ["threads", "software, date"]
    task = read_csv(src, files[0])["task"].iloc[0]
    note = f"RULER {task}, dense attention, `python -m rbs_bench.bench.cpu_samples` (its usage "
    note += "line gives the command). "
    return md_table(head, rows) + "\n" + note + sources_line(src, files) + "\n"
