"""Seconds per sample of the quick start's cells, every method on the same samples in one process.

    python -m rbs_bench.bench.cpu_samples                      # d25, 6 samples, this machine
    python -m rbs_bench.bench.cpu_samples --samples 3 --methods dense rbs minference
    python -m rbs_bench.bench.cpu_samples --methods dense --samples 3 --name tiny_8k_float32_cpu \
        --set benchmark.tasks=[niah_single_1] --set benchmark.context_lengths=[8192]

The quick start (`make quickstart`, `+experiment=ruler_budget`) runs each cell in turn, so a busy
moment of the machine lands on one method. Here one process loads the embedded model once and runs
each sample with every method in turn, as the runner does (`models.generate` with the attention
hook installed, `recall=true`), using the committed calibrations of `--budget`
(results/calibration/<model>/). The methods are the experiment's grid (`--experiment`, default
ruler_budget): its reference cells (dense at `budget=default`) first, then the methods of its
sweep, each at `--budget`. Two times per sample: `wall` is what the sample costs the run
(selector, executor and the recall pass, which measures the kept share of the dense attention mass
with one more dense pass per layer), `request` is the prefill and decode alone, as the records'
`ttft_s` and `generate_s` count them (the runner leaves the recall pass out), and `prefill` is
the request's seconds to the first token. It prints each method's medians and their ratios to
dense's, measured in this one run, and writes them to results/speed/cpu_samples_<device>.csv
(`--name` for another file name; `--set KEY=VALUE` adds an override to the experiment's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from rbs_bench.errors import UserError, one_line
from rbs_bench.methods import DENSE
from rbs_bench.paths import speed_dir

EXPERIMENT = "ruler_budget"  # the quick start's grid


def grid_budgets(experiment: str, budget: str) -> dict[str, str]:
    """Method -> budget of the experiment's grid, in its order: each reference cell's method at
    its own budget (the table's reference line), then each method of the sweep at `budget`."""
    from rbs_bench.config import compose_cell, override_key, reference_cells, sweep_cells

    cfg = compose_cell([f"+experiment={experiment}"], hydra_config=True)
    values = lambda cell: {override_key(o): o.split("=", 1)[1] for o in cell}
    out: dict[str, str] = {}
    for cell in map(values, reference_cells(cfg, [])):
        out.setdefault(cell["method"], cell.get("budget", "default"))
    for cell in map(values, sweep_cells(cfg.hydra.sweeper.get("params"), [])):
        if "method" in cell:
            out.setdefault(cell["method"], budget)
    return out


def measure(
    names: list[str],
    budgets: dict[str, str],
    samples: int,
    device: str,
    experiment: str,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    """Per method: the seconds of each sample (the same samples for every method), each method at
    its budget (`budgets`; `grid_budgets` gives the experiment's); with dense among them, each
    median over dense's."""
    from rbs_bench.config import compose_cell
    from rbs_bench.models.generate import eos_ids, greedy_generate
    from rbs_bench.models.hf_attention import install, uninstall
    from rbs_bench.session import Session, build_selector, model_inputs

    base = [f"+experiment={experiment}", f"device={device}", f"benchmark.num_samples={samples}"]
    base += list(extra)
    methods = list(names)
    cfgs = {m: compose_cell([*base, f"method={m}", f"budget={budgets[m]}"]) for m in methods}
    session = Session()
    first = cfgs[methods[0]]
    loaded = session.load(first)
    eos = eos_ids(loaded.model, loaded.tokenizer)
    selectors = {m: build_selector(c) for m, c in cfgs.items()}
    task, length = first.benchmark.tasks[0], first.benchmark.context_lengths[0]
    work = session.samples(first, loaded, task, length)
    wall = {m: [] for m in methods}
    request = {m: [] for m in methods}
    prefill = {m: [] for m in methods}
    tokens = []
    for i, sample in enumerate(work):
        inputs = model_inputs(loaded, sample)
        ids = inputs.pop("input_ids")
        tokens.append(int(ids.shape[1]))
        for m in methods:
            recorder = install(loaded.model, selectors[m], "auto", recall=True)
            try:
                t0 = time.perf_counter()
                _, to_first, total, _ = greedy_generate(
                    loaded.model, ids, sample.max_new_tokens, eos, **inputs
                )
                stats = recorder.summary()
                wall[m].append(time.perf_counter() - t0)
                request[m].append(total - stats.get("recall_s", 0.0))
                prefill[m].append(to_first - stats.get("recall_s", 0.0))  # recall: in prefill
            finally:
                uninstall(loaded.model)
        line = "  ".join(f"{m} {wall[m][-1]:.2f}/{request[m][-1]:.2f}" for m in methods)
        print(f"sample {i + 1}/{len(work)} ({ids.shape[1]} tokens), wall/request s: {line}")
    med = statistics.median
    rows = []
    for m in methods:
        row = dict(
            method=m, budget=budgets[m], device=device,
            threads=torch.get_num_threads(), samples=len(wall[m]), task=task,
            context_length=length, wall_s=round(med(wall[m]), 4),
            request_s=round(med(request[m]), 4), prefill_s=round(med(prefill[m]), 4),
            input_tokens=int(med(tokens)), dtype=str(loaded.model.dtype).removeprefix("torch."),
            torch=torch.__version__,
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )  # fmt: skip
        if DENSE in wall:
            row["wall_over_dense"] = round(med(wall[m]) / med(wall[DENSE]), 3)
            row["request_over_dense"] = round(med(request[m]) / med(request[DENSE]), 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default=EXPERIMENT, help="whose grid (default %(default)s)")
    ap.add_argument("--methods", nargs="+", help="default: the experiment's grid, in its order")
    ap.add_argument("--budget", default="d25", help="the sweep's budget (default %(default)s)")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="folder of the CSV (default results/speed)")
    ap.add_argument("--name", help="the CSV file's stem (default cpu_samples_<device>)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="one more override"
    )
    args = ap.parse_args(argv)
    return one_line(lambda: _run(args))


def _run(args) -> int:
    import pandas as pd

    if args.samples < 1:
        raise UserError(f"--samples {args.samples}: at least 1")
    grid = grid_budgets(args.experiment, args.budget)
    names = args.methods or list(grid)
    budgets = {m: grid.get(m, args.budget) for m in names}
    rows = measure(names, budgets, args.samples, args.device, args.experiment, tuple(args.set))
    df = pd.DataFrame(rows)
    out = Path(args.out) if args.out else speed_dir("results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or f'cpu_samples_{args.device}'}.csv"
    df.to_csv(path, index=False)
    cols = ["method", "prefill_s", "wall_s", "wall_over_dense", "request_s", "request_over_dense"]
    print(df[[c for c in cols if c in df]].to_string(index=False))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
