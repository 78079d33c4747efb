"""Time to first token, prefill attention and memory of every method inside an HF model.

    python -m rbs_bench.bench.ttft                    # this device's default run (below)
    python -m rbs_bench.bench.ttft --methods dense rbs --contexts 131072 --out /tmp/ttft
    python -m rbs_bench +experiment=speed             # or memory, throughput, selector_time

Model (`ttft_model`): on CUDA a shipped architecture with random weights and `--layers` decoder
layers (default 4 of the Qwen3-30B-A3B-shaped MoE's 48), bf16; on a CPU the embedded tiny Qwen3;
or a `--checkpoint` directory. Every table states the model and its layer count.

Per context N (default 32K/64K/96K/128K on CUDA, 1K/2K on a CPU), largest first:
1. Calibration (`ttft_calibrate`): each method's knob searched on dense prefills of the seeded
   random prompt until its density is within 0.002 of `--target` (5%); a method that cannot reach
   it keeps its closest density and is flagged.
2. Timing, per method (dense first) and batch size (`ttft_measure.time_row`): `--warmup` untimed
   requests, then `--repeats` timed ones (`--batch-repeats` for batches > 1); the CSV holds their
   median. Batches > 1 run after every batch-1 row, at `--batch-contexts`, with the batch-1 knob
   (also when read back from the CSV); each sequence of a batch is selected and attended on its
   own.

Outputs in --out (default results/speed): ttft_<device>.csv, one row per (model, batch, N,
method, target), rewritten after each row (its columns: `ttft_rows`); a rerun skips finished rows.
ttft_calibrations_<device>.jsonl: each calibration as it finishes, so a rerun of a killed run
calibrates only what it had not. speedup_<device>.png: the three panels (standalone attention from
attention_<device>.csv, prefill attention inside the model, TTFT). With --time-budget-s the run
starts no new row after that many seconds and says how to continue.

The pieces, each importing only those before it: ttft_setup (settings and their checks),
ttft_model (the timed model), ttft_measure (a request, a row, memory), ttft_rows (the CSV),
ttft_calibrate (calibration and its store), and this module (the run and the command line).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from tqdm import tqdm

from rbs_bench import methods, paths
from rbs_bench.bench.ttft_calibrate import (
    Calibrated,
    cal_columns,
    calibrate_methods,
    known,
    save_calibrations,
    saved_calibrations,
)
from rbs_bench.bench.ttft_measure import layer_gemm_ms, time_row
from rbs_bench.bench.ttft_model import Loaded, build_model, gpus, peak_mib, prompts, release
from rbs_bench.bench.ttft_rows import (
    device_name,
    experts_impl,
    load_rows,
    plan,
    row_key,
    row_line,
    summary_markdown,
    target_of,
    versions,
    write_rows,
)
from rbs_bench.bench.ttft_setup import MODELS, SDPA_BACKENDS, Settings, resolve, throughput_methods
from rbs_bench.config import TimingCfg
from rbs_bench.errors import UserError, positive_seconds
from rbs_bench.models.memory import use_expandable_segments
from rbs_bench.paths import speed_dir, tables_dir

Row = tuple[int, int, str]  # (batch, N, method)


@dataclass
class Progress:
    """What a run carries from row to row: the model, the calibrations it has (or tried), the
    current context's prompts, each token count's GEMM reference and the rows that failed."""

    s: Settings
    lm: Loaded
    pending: list[Row]
    cals: dict[tuple[int, str], Calibrated]
    tried: set[tuple[int, str]] = field(default_factory=set)
    prompts: dict[int, Tensor] = field(default_factory=dict)
    gemm_ms: dict[int, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    common: dict = field(default_factory=dict)  # the columns every row of the run shares


def run(s: Settings) -> pd.DataFrame:
    """Every pending row of the plan; returns the whole CSV (old rows included) as a frame."""
    t_start = time.perf_counter()
    paths.make_dirs(s.out)  # no write leaves the results folder through a link
    rows = load_rows(s.csv)
    if s.retry_oom:  # run again; the new row replaces the oom one
        rows = [r for r in rows if r.get("status") != "oom"]
    pending = _pending(s, rows)
    print(
        f"ttft: {s.model} with {s.layers} layers on {device_name(s.device)}: {len(pending)} rows "
        f"to run ({len(plan(s)) - len(pending)} already in {s.csv})",
        flush=True,
    )
    if not pending:
        return _rewrite(s, rows, plot=False)
    p = _start(s, rows, pending)
    bar = tqdm(
        total=len(pending), desc="ttft", unit="row", disable=not s.progress, dynamic_ncols=True
    )
    stopped = False
    for b, n, name in pending:
        if s.time_budget_s is not None and time.perf_counter() - t_start > s.time_budget_s:
            stopped = True
            break
        if name != methods.DENSE and (n, name) not in p.tried:
            bar.set_postfix_str(f"calibrating at N={n}")
            _calibrate_at(p, n)
        bar.set_postfix_str(f"b={b} N={n} {name}")
        row = _time(p, b, n, name)
        if row is not None:
            rows.append(row)
            tqdm.write(row_line(write_rows(s.csv, rows).iloc[-1]))
        bar.update()
    bar.close()
    df = _rewrite(s, rows, plot=True)
    _report(s, rows, pending, stopped, p.failed)
    return df


def _common(s: Settings) -> dict:
    """The key columns every row of this run shares."""
    return {
        "model": s.model, "layers": s.layers, "dtype": s.dtype,
        "ffn_chunk_tokens": s.ffn_chunk_tokens or 0, "compile": s.compile,
    }  # fmt: skip


def _key(s: Settings, b: int, n: int, m: str) -> tuple:
    return row_key({**_common(s), "batch": b, "n": n, "method": m, "target": target_of(s, m)})


def _pending(s: Settings, rows: list[dict]) -> list[Row]:
    """The plan's rows that the CSV does not hold yet."""
    done = {row_key(r) for r in rows}
    return [(b, n, m) for b, n, m in plan(s) if _key(s, b, n, m) not in done]


def _start(s: Settings, rows: list[dict], pending: list[Row]) -> Progress:
    """Build the model and gather the calibrations that earlier runs left."""
    lm = build_model(s)
    cals = {**saved_calibrations(s, lm), **known(rows, s, lm)}
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")  # rows of one process share it
    common = {**_common(s), **versions(), "run": run_id}
    return Progress(s, lm, pending, cals, tried=set(cals), common=common)


def _calibrate_at(p: Progress, n: int) -> None:
    """One capture at N calibrates every method still pending there (workspace measures for
    those with a batch-1 row)."""
    names = [m for _, nn, m in p.pending if nn == n and m != methods.DENSE]
    names = list(dict.fromkeys(m for m in names if (n, m) not in p.tried))
    measure = {m for b, nn, m in p.pending if nn == n and b == 1}
    got = calibrate_methods(p.s, p.lm, _prompts(p, n)[:1], names, measure)
    save_calibrations(p.s, p.lm, n, got)
    p.cals.update({(n, m): c for m, c in got.items()})
    p.tried.update((n, m) for m in names)


def _prompts(p: Progress, n: int) -> Tensor:
    """The seeded prompts of context N (one context's kept at a time)."""
    if n not in p.prompts:
        p.prompts = {n: prompts(p.s, n, p.lm.vocab)}
    return p.prompts[n]


def _time(p: Progress, b: int, n: int, name: str) -> dict | None:
    """One row: its settings and the timed requests' columns (status oom where memory ran out);
    None where the method is uncalibrated or failed, which `p.failed` then names."""
    s, lm = p.s, p.lm
    cal = p.cals.get((n, name))
    if name != methods.DENSE and cal is None:
        p.failed.append(f"b={b} N={n} {name}: not calibrated (see the error above)")
        return None
    t0 = time.perf_counter()
    row = _settings_columns(p, b, n, name, cal)
    if lm.device.type == "cuda":
        for d in gpus():
            torch.cuda.reset_peak_memory_stats(d)
    try:
        row.update(status="ok", **time_row(s, lm, _prompts(p, n)[:b], name, cal and cal.fields))
    except torch.cuda.OutOfMemoryError as e:
        # what was held when it failed, for results/scale and the memory estimate
        row.update(status="oom", oom_peak_allocated_mib=peak_mib(lm.device))
        row.update(oom_error=str(e).splitlines()[0][:200])
        tqdm.write(f"ttft: b={b} N={n} {name}: {row['oom_error']}", file=sys.stderr)
        release(lm.device)
    except (KeyboardInterrupt, UserError):
        raise
    except Exception as e:  # one method failing must not lose the others' rows
        p.failed.append(f"b={b} N={n} {name}: {type(e).__name__}: {e}")
        tqdm.write(f"ttft: {p.failed[-1]}", file=sys.stderr)
        release(lm.device)
        return None
    row.update(_software_columns(p, b, name))
    return {**row, "seconds": round(time.perf_counter() - t0, 2)}


def _settings_columns(p: Progress, b: int, n: int, name: str, cal: Calibrated | None) -> dict:
    """The columns before the timings: model, device, method, its calibration, GEMM reference."""
    s, lm = p.s, p.lm
    row = {**{k: p.common[k] for k in _common(s)}, "device": device_name(lm.device)}
    row["model_desc"] = lm.description
    row["gpus"] = len(gpus(lm.model)) if lm.device.type == "cuda" else 0
    row.update(heads=lm.heads, kv_heads=lm.kv_heads, head_dim=lm.head_dim)
    row.update(batch=b, n=n, method=name, target=target_of(s, name), **cal_columns(cal, b))
    if b * n not in p.gemm_ms:
        p.gemm_ms[b * n] = layer_gemm_ms(lm, b * n)
    row["gemm_ms_per_layer"] = p.gemm_ms[b * n]
    return row


def _software_columns(p: Progress, b: int, name: str) -> dict:
    """The columns after the timings: how the row ran (executor, repeats) and the software."""
    from rbs_bench.execution import resolve_executor

    s, lm = p.s, p.lm
    return dict(
        model_mib=lm.model_mib,
        executor=resolve_executor(s.executor, s.device) if name != methods.DENSE else "sdpa",
        sdpa_backend=s.sdpa_backend,
        knob_name=methods.method_class(name).knob or "",
        experts_impl=experts_impl(lm.model.config),
        warmup=s.warmup,
        repeats=s.repeats if b == 1 else s.batch_repeats,
        **{k: v for k, v in p.common.items() if k not in _common(s)},  # versions, run
    )


def _rewrite(s: Settings, rows: list[dict], plot: bool) -> pd.DataFrame:
    """The CSV rewritten with its derived columns, and the figure (when asked or missing)."""
    df = write_rows(s.csv, rows) if rows else pd.DataFrame()
    if not df.empty and (plot or not s.figure.exists()):
        _plot(s, df)
        if plot:
            print(f"wrote {s.csv} and {s.figure}")
    return df


def _report(s: Settings, rows: list[dict], pending: list[Row], stopped: bool, failed) -> None:
    """How to continue a run stopped by its time budget, and which rows failed."""
    finished = {row_key(r) for r in rows}
    left = sum(1 for b, n, m in pending if _key(s, b, n, m) not in finished)
    if stopped:
        print(
            f"ttft: time budget of {s.time_budget_s:.0f} s reached with {left} rows left; run the "
            "same command again to continue (finished rows are skipped)",
            flush=True,
        )
    if failed:
        print(
            f"ttft: {len(failed)} rows failed (rerun to retry):\n  " + "\n  ".join(failed),
            file=sys.stderr,
        )


def _plot(s: Settings, df: pd.DataFrame) -> None:
    """The three-panel figure of this run's setting (the CSV may hold others)."""
    from rbs_bench.tables import timing

    same = (df["model"] == s.model) & (df["layers"] == s.layers)
    same &= (df["dtype"] == s.dtype) & (
        (df["method"] == methods.DENSE) | (df["target"] == s.target)
    )
    standalone = timing.standalone_rows(s.out, s.tag, s.target)
    timing.plot_speedup(df[same], standalone, s.figure)


# ------------------------------------------------------------------------------------------------
# Entry points.


def run_experiment(cfg, experiment: str) -> list[Path]:
    """`python -m rbs_bench +experiment=<speed|memory|throughput|selector_time>`: run the pending
    rows, then write the experiment's tables (all four for another name) to <results_dir>/tables."""
    from rbs_bench.tables import timing

    if cfg.model.name != "tiny":
        raise UserError(
            f"model={cfg.model.name} is not used by the timing experiments: they build a "
            "random-weight model; choose it with timing.model=tiny|qwen3_30b_a3b"
        )
    tc = cfg.timing
    out = Path(tc.out_dir) if tc.out_dir else speed_dir(cfg.results_dir)
    s = resolve(tc, cfg.device, cfg.executor, out, progress=cfg.progress)
    df = run(s)
    if df.empty:
        raise UserError("no rows were timed; see the errors above")
    names = [experiment] if experiment in timing.EXPERIMENTS else timing.EXPERIMENTS
    paths = timing.build_tables(s.csv, Path(cfg.results_dir), tables_dir(cfg.results_dir), names)
    for p in paths:
        if p.suffix == ".md":
            print(f"\n{p}:\n{p.read_text()}")
    return paths


def main(argv: list[str] | None = None) -> int:
    d = TimingCfg()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        help=f"one of {', '.join(MODELS)} (default: qwen3_30b_a3b on CUDA, else tiny); with "
        "--checkpoint, the name of its rows",
    )
    ap.add_argument("--layers", type=int, help="decoder layers (default 4; tiny: 2)")
    ap.add_argument(
        "--device-map", choices=["auto"], help="a --checkpoint's layers over every visible GPU"
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        help="a checkpoint directory (e.g. written by rbs_bench.models.rehearsal) loaded "
        "through from_pretrained instead of a random model; --model names its rows",
    )
    ap.add_argument("--contexts", type=int, nargs="+", help="default 32K-128K on CUDA, 1K 2K")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--batch-contexts",
        type=int,
        nargs="+",
        help="contexts of batches > 1 (default 32K 64K 128K on CUDA, 1K on a CPU)",
    )
    ap.add_argument("--batch-methods", nargs="+", default=throughput_methods())
    ap.add_argument("--methods", nargs="+", default=d.methods)
    ap.add_argument("--target", type=float, default=d.target)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--repeats", type=int, help="timed requests per row (default 3; CPU 1)")
    ap.add_argument("--batch-repeats", type=int, help="timed requests of batch > 1 rows")
    ap.add_argument(
        "--ffn-chunk-tokens",
        type=int,
        default=d.ffn_chunk_tokens,
        help="feed-forward blocks over this many tokens at once (0: all at once)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=d.compile,
        help="compile each layer's regions outside attention (default: on CUDA only)",
    )
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--sdpa-backend", default=d.sdpa_backend, choices=SDPA_BACKENDS)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    ap.add_argument(
        "--time-budget-s",
        type=positive_seconds,
        help="start no new row after this many seconds (default 450 on CUDA)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--retry-oom", action="store_true", help="rerun rows recorded as out of memory")
    args = ap.parse_args(argv)
    use_expandable_segments()
    tc = TimingCfg(
        model=args.model,
        checkpoint=str(args.checkpoint) if args.checkpoint else None,
        device_map=args.device_map,
        layers=args.layers,
        contexts=args.contexts,
        batches=args.batches,
        batch_contexts=args.batch_contexts,
        batch_methods=args.batch_methods,
        methods=args.methods,
        target=args.target,
        warmup=args.warmup,
        repeats=args.repeats,
        batch_repeats=args.batch_repeats,
        ffn_chunk_tokens=args.ffn_chunk_tokens,
        compile=args.compile,
        sdpa_backend=args.sdpa_backend,
        seed=args.seed,
        time_budget_s=args.time_budget_s,
        retry_oom=args.retry_oom,
    )
    try:
        s = resolve(tc, args.device, args.executor, args.out, progress=not args.no_progress)
        df = run(s)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    print(summary_markdown(df))
    return 0 if not df.empty else 1


if __name__ == "__main__":
    sys.exit(main())
