"""Generated blocks of the paper-scale runs on GPUs (docs/cluster.md): the 48-layer rehearsal,
calibration cost against the paper's Table 11, what ran at full size from the checkpoint layouts,
the oracle and attention recall at 128K, and the memory estimates (`rbs_bench.models.memory`)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from rbs_bench import methods, paths
from rbs_bench.methods import DENSE
from rbs_bench.methods.oracle import Oracle
from rbs_bench.methods.rbs import RBS
from rbs_bench.models import memory
from rbs_bench.scale import calibration_entries as _calibration_entries
from rbs_bench.scale import run_cells as _run_cells
from rbs_bench.tables.blocks import (
    MISSING,
    Sources,
    block,
    md_table,
    memo,
    num,
    read_csv,
    sources_line,
    span,
    times,
)
from rbs_bench.tables.blocks_speed import H200, LONG, ttft_rows
from rbs_bench.tables.paper import PaperValues

GiB = 1024  # MiB per GiB: the records and CSVs keep MiB
REHEARSAL = "qwen3_30b_a3b_random"  # the 48-layer rehearsal model
PAPER_PROMPTS = 50  # Table 11 calibrates on 50 prompts
TABLE11_H200 = "table11_h200_fp8"  # the FP8 checkpoint's Table 11 set on one H200 (results/scale)
CHECKPOINT_RE = re.compile(r"^\S+: (\S+), (\d+) tensors in (\d+) file\(s\), ([\d.]+) GiB$")


def _estimate(
    model: str, chunk: int | None, batch: int = 1, gpus: int = 1, context: int = LONG, **kw
) -> str:
    """The memory estimate (GiB, on the busiest GPU) of a model's prefill of `context` tokens."""
    e = memory.estimate_model(model, context, batch, ffn_chunk_tokens=chunk or None, **kw)
    return f"{(e.total if gpus <= 1 else memory.per_gpu(e, gpus)) / memory.GiB:.1f}"


def run_cells(results: Path) -> pd.DataFrame:
    """One row per GPU cell of the records (`scale.run_cells`), read once per pass."""
    return memo(("cells", str(results)), lambda: _run_cells(results))


def calibration_entries(results: Path) -> pd.DataFrame:
    """Every calibration entry with its cost (`scale.calibration_entries`), once per pass."""
    return memo(("calibrations", str(results)), lambda: _calibration_entries(results))


def _gib(mib) -> str:
    return num(None if mib is None else mib / GiB, ".1f")


def _cells(src: Sources, gpu: str, model: str) -> pd.DataFrame:
    cells = run_cells(src.results)
    return cells[(cells["gpu"] == gpu) & (cells["model"] == model)]


# ------------------------------------------------------------------------------------------------
# The 48-layer rehearsal on one H200.


@block("rehearsal_h200")
def rehearsal_h200(src: Sources) -> str:
    """Each step of the rehearsal: its time per unit, peak memory and the estimate."""
    gpu = "NVIDIA H200"
    cal = calibration_entries(src.results)
    cal = cal[(cal["gpu"] == gpu) & (cal["model"] == REHEARSAL)]
    cells = _cells(src, gpu, REHEARSAL)
    cells = cells[cells["experiment"] == "ruler_budget"]
    dense = cells[cells["method"] == DENSE].iloc[0]
    sparse = cells[(cells["method"] != DENSE) & (cells["method"] != Oracle.name)]
    oracle = cells[cells["method"] == Oracle.name]
    est = _estimate(REHEARSAL, 0)
    peak = lambda c: f"{_gib(c['peak_allocated_mib'].max())} / {_gib(c['peak_reserved_mib'].max())}"
    rows = [
        [f"calibration to 5%, {int(cal['prompts'].iloc[0])} prompts, one method",
         f"{span(cal['seconds'], '.0f')} s ({span(cal['forwards'], '.0f')} forwards)",
         "not recorded", est],
        ["ruler_budget sample, dense",
         f"{dense['prefill_s']:.1f} s prefill + {dense['decode_s']:.1f} s decode",
         peak(cells[cells["method"] == DENSE]), est],
        ["ruler_budget sample, sparse at 5%",
         f"{span(sparse['prefill_s'], '.1f')} s prefill (oracle "
         f"{span(oracle['prefill_s'], '.1f')} s) + {span(sparse['decode_s'], '.1f')} s decode",
         peak(cells[cells["method"] != DENSE]), est],
    ]  # fmt: skip
    for compiled, chunk, batch, label in ((True, 0, 1, ""), (False, 16384, 4, " (eager)")):
        sub, path = ttft_rows(src, H200, "qwen3_30b_a3b", 48, compiled, chunk)
        sub = sub[sub["batch"] == batch].set_index("method")
        d, r = sub.loc[DENSE], sub.loc[RBS.name]
        rows.append([
            f"TTFT, batch {batch}, dense / RBS at 5%{label}",
            f"{d['ttft_ms'] / 1e3:.1f} s / {r['ttft_ms'] / 1e3:.1f} s",
            f"{_gib(sub['peak_allocated_mib'].max())} / {_gib(sub['peak_reserved_mib'].max())}",
            _estimate("qwen3_30b_a3b", chunk, batch, compiled=compiled),
        ])  # fmt: skip
    head = ["step", "per unit", "peak allocated / reserved (GiB)", "estimate (GiB)"]
    files = sorted(set(cal["source"])) + sorted(set(cells["source"])) + [path]
    note = "Qwen3-30B-A3B shape, bf16 random weights, 48 layers, 128K tokens; compiled layers "
    note += "with unchunked feed-forward blocks except where marked. "
    return md_table(head, rows, keys=2) + "\n" + note + sources_line(src, files) + "\n"


@block("calibration_cost_h200")
def calibration_cost_h200(src: Sources) -> str:
    """Calibration seconds on the H200, scaled to the paper's 50 prompts beside its Table 11."""
    return _calibration_cost(src, "NVIDIA H200", REHEARSAL)


@block("calibration_cost_h100_fp8")
def calibration_cost_h100_fp8(src: Sources) -> str:
    """The FP8 checkpoint's calibrations on one H100 (`fp8-calibrate`), scaled the same way: the
    paper's own model, on the GPU kind of its TTFT claims."""
    return _calibration_cost(src, "NVIDIA H100 80GB HBM3", "qwen3_30b_a3b_fp8")


@block("calibration_cost_h200_fp8")
def calibration_cost_h200_fp8(src: Sources) -> str:
    """The FP8 checkpoint's calibrations on one H200, the side set `results/scale/table11_h200_fp8`
    (its ruler_budget cells are in `full_size_runs`)."""
    return _calibration_cost(src, "NVIDIA H200", "qwen3_30b_a3b_fp8", TABLE11_H200)


def _calibration_cost(src: Sources, gpu: str, model: str, side: str = "") -> str:
    """Each method's calibration of `model` on `gpu` (in the side results set `side`; "": the
    main records): seconds, forwards, seconds per forward and GPU-hours scaled to the paper's 50
    prompts (one knob, one target), beside Table 11."""
    cal = calibration_entries(src.results)
    cal = cal[(cal["gpu"] == gpu) & (cal["model"] == model) & (cal["set"] == side)]
    pv = PaperValues.load(paths.paper_values_file(src.results))
    paper = {}
    for (table, row, column), cell in pv.cells.items():
        if table == "tab:calibration" and column in ("GPU-hours", "Configurations"):
            paper.setdefault(row, {})[column] = cell["value"]
    rows = []
    order = sorted(cal.itertuples(), key=lambda c: methods.order_key(c.method))
    for c in order:
        name = methods.display(c.method)
        scaled = c.seconds * c.gpus / 3600 / c.prompts * PAPER_PROMPTS
        p = paper.get(name, {})
        per = c.seconds / c.forwards if c.forwards else float("nan")
        rows.append([
            name, f"{c.seconds:.1f}", str(c.forwards), num(per, ".1f"), f"{scaled:.2f}",
            p.get("GPU-hours", MISSING), p.get("Configurations", MISSING),
        ])  # fmt: skip
    head = ["method", f"seconds ({int(cal['prompts'].iloc[0])} prompts)", "forwards"]
    head += ["s per forward", f"GPU-hours for {PAPER_PROMPTS} prompts (one knob, one target)"]
    head += ["paper GPU-hours (Table 11)", "paper configurations"]
    files = sorted(set(cal["source"])) + [paths.paper_values_file(src.results)]
    dates = ", ".join(sorted(set(cal["date"]) - {""}))
    note = f"{gpu}, {model}" + (f", calibrated {dates}" if dates else "") + ". "
    note += "The paper's figures are for all its configurations on two A100s with the FP8 model. "
    return md_table(head, rows) + "\n" + note + sources_line(src, files) + "\n"


# ------------------------------------------------------------------------------------------------
# What ran at full size from the checkpoint layouts.


def _checkpoints(src: Sources) -> dict[str, tuple[str, Path]]:
    """Model -> ('N tensors in F shards, S GiB', log) from the calls' logs."""
    out = {}
    for log in sorted((paths.scale_dir(src.results) / "logs").glob("*.txt")):
        for line in log.read_text(errors="replace").splitlines():
            m = CHECKPOINT_RE.match(line.strip())
            if m and m.group(1) not in out:
                model, tensors, files, gib = m.groups()
                out[model] = (f"{int(tensors):,} tensors in {files} shards, {gib} GiB", log)
    return out


def _calibrated(src: Sources, gpu_model: pd.DataFrame) -> str:
    parts = [
        f"{c.method} {c.seconds:.0f} s ({c.forwards} forwards, error {100 * c.abs_error:.4f} pp)"
        for c in gpu_model.itertuples()
    ]
    return "; ".join(parts)


def _per_sample(cells: pd.DataFrame) -> str:
    parts = []
    for c in sorted(cells.itertuples(), key=lambda c: (c.method != DENSE, c.method)):
        text = f"{c.method} {c.prefill_s:.2f} s prefill + {c.decode_s:.1f} s decode"
        if c.visual_tokens:
            text += f" ({c.tokens:,} tokens, {100 * c.visual_share:.0f}% video; "
            text += f"density {c.density_mean:.2f})"
        parts.append(text)
    return "; ".join(parts)


@block("full_size_runs")
def full_size_runs(src: Sources) -> str:
    """The paper models rehearsed from random weights in their checkpoint layout at full size."""
    cells, cal = run_cells(src.results), calibration_entries(src.results)
    checkpoints = _checkpoints(src)
    rows, files = [], []
    for model in ("qwen3_30b_a3b_fp8", "qwen3_32b", "qwen3_vl_30b_a3b_thinking_fp8"):
        if model in checkpoints:
            rows.append([model, "write", checkpoints[model][0], ""])
            files.append(checkpoints[model][1])
        for (gpu, side), grp in cal[cal["model"] == model].groupby(["gpu", "set"]):
            n = int(grp["gpus"].max())
            step = f"calibrate, {n} {gpu}" + (f" ({side})" if side else "")
            rows.append([model, step, _calibrated(src, grp), ""])
            files += list(grp["source"])
        mine = cells[cells["model"] == model]
        for (gpu, n_gpus, side), grp in mine.groupby(["gpu", "gpus", "set"]):
            peak = f"{_gib(grp['peak_allocated_mib'].max())} (busiest GPU)"
            visual = int(grp["visual_tokens"].max()) or None
            tokens = int(grp["tokens"].max())
            est = _estimate(model, 32768, 1, int(n_gpus), tokens, visual_tokens=visual)
            step = f"run, per sample, {n_gpus} {gpu}" + (f" ({side})" if side else "")
            rows.append([model, step, _per_sample(grp), f"{peak} / {est}"])
            files += list(grp["source"])
    for gpu_tag in ("nvidia_h100_80gb_hbm3",):
        path = src.results / "speed" / f"ttft_{gpu_tag}.csv"
        df = read_csv(src, path)
        df = df[(df["layers"] >= 48) & (df["model"] != "qwen3_30b_a3b") & (df["status"] == "ok")]
        df = df.drop_duplicates(["model", "batch", "n", "method", "ffn_chunk_tokens"], keep="last")
        for model, grp in df.groupby("model", sort=False):
            chunk = grp["ffn_chunk_tokens"].iloc[-1]  # one setting: the latest run's
            one = grp[(grp["batch"] == 1) & (grp["ffn_chunk_tokens"] == chunk)]
            parts = [
                f"{r.method} {r.ttft_ms / 1e3:.2f} s ({times(r.ttft_speedup)}; attention "
                f"{times(r.attention_speedup, '.1f')})"
                for r in sorted(one.itertuples(), key=lambda r: (r.method != DENSE, r.ttft_ms))
            ]
            n_gpus = int(one["gpus"].max()) if "gpus" in one else 1
            rows.append([model, f"TTFT, {int(one['layers'].iloc[0])} layers, {n_gpus} "
                         f"{one['device'].iloc[0]}, {_chunking(chunk)}", "; ".join(parts),
                         f"{_gib(one['peak_allocated_mib'].max())} (busiest GPU)"])  # fmt: skip
            files.append(path)
    head = ["model", "step (GPUs)", "measured", "peak allocated / estimate (GiB)"]
    note = "Random weights in each model's checkpoint layout, 128K tokens unless the row says "
    note += "otherwise, batch 1. "
    return md_table(head, rows, keys=4) + "\n" + note + sources_line(src, files) + "\n"


def _chunking(chunk) -> str:
    chunk = int(chunk) if pd.notna(chunk) else 0
    return "feed-forward unchunked" if chunk in (0, 131072) else f"{chunk // 1024}K-token chunks"


# ------------------------------------------------------------------------------------------------
# The oracle and attention recall at 128K (H200).


@block("oracle_recall_128k")
def oracle_recall_128k(src: Sources) -> str:
    """Block-mass kernel against SDPA, the oracle's and the recall pass's cost at 128K."""
    path = src.results / "speed" / "block_mass_nvidia_h200.csv"
    df = read_csv(src, path)
    t = df[df["kind"] == "time"].set_index("n")
    token = df[df["kind"] == "recall_minference"].set_index("n")
    checks = df[df["kind"] == "check"]
    rows = [[
        f"{n // 1024}K", num(t.loc[n, "ms_block_mass"], ".0f"), num(t.loc[n, "ms_sdpa_fa2"], ".0f"),
        num(t.loc[n, "ms_oracle_select"], ".0f"), num(t.loc[n, "ms_recall_pass"], ".0f"),
        num(token.loc[n, "ms_recall_pass"] / 1e3, ".1f") if n in token.index else MISSING,
        num(token.loc[n, "workspace_mib"] / GiB, ".1f") if n in token.index else MISSING,
    ] for n in sorted(t.index)]  # fmt: skip
    head = ["N", "block mass ms", "SDPA-FA2 ms", "oracle select ms", "recall pass ms (RBS)"]
    head += ["MInference recall pass s", "its workspace GiB"]
    ok = (checks["check"].astype(str).str.lower() == "ok").sum() if "check" in checks else 0
    text = md_table(head, rows) + "\n"
    text += "Per layer, 32 query / 4 KV heads, bf16. Kernel checks within tolerance of the fp32 "
    text += f"reference: {ok} of {len(checks)}. "
    cells = run_cells(src.results)
    side = cells[cells["experiment"].str.contains("recall_128k") & (cells["method"] == RBS.name)]
    main = cells[(cells["model"] == REHEARSAL) & (cells["experiment"] == "ruler_budget")]
    oracle = main[main["method"] == Oracle.name]
    lines = []
    for c in side.itertuples():
        rec = "on" if pd.notna(c.recall) else "off"
        extra = (
            f": recall {100 * c.recall:.2f}%, {c.recall_s:.1f} s of recall passes"
            if rec == "on"
            else ""
        )
        lines.append(f"- RBS sample at 5%, recall {rec}: {c.prefill_s:.1f} s prefill{extra}")
    for c in oracle.itertuples():
        lines.append(f"- oracle sample at 5%: {c.prefill_s:.1f} s prefill")
    files = [path] + list(side["source"]) + list(oracle["source"])
    return text + "\n\n" + "\n".join(lines) + "\n\n" + sources_line(src, files) + "\n"


# ------------------------------------------------------------------------------------------------
# Memory before renting (estimates, not measurements: the formula of rbs_bench.models.memory).


@block("memory_estimates")
def memory_estimates(src: Sources) -> str:
    """The estimate of each paper model at its context, batch 1, 32K feed-forward chunks."""
    rows = []
    models = (
        ("qwen3_30b_a3b_random", "48 layers, bf16", LONG, 32768),
        ("qwen3_30b_a3b_fp8", "FP8 weights", LONG, 32768),
        ("qwen3_32b_random", "64 layers, bf16", LONG, 32768),
        ("qwen3_vl_30b_a3b_thinking_fp8", "FP8", memory.videomme_context(), 32768),
        ("qwen3_30b_a3b_random", "48 layers, bf16, unchunked", LONG, 0),
    )
    for name, what, n, chunk in models:
        e = memory.estimate_model(name, n, 1, ffn_chunk_tokens=chunk or None)
        g = e.gib()
        fits = "yes" if g["total"] <= 79 else f"no: {-(-g['total'] // 79):.0f} cards"
        rows.append([
            f"{name} ({what})", f"{n:,}", f"{g['weights']:.1f}", f"{g['kv_cache']:.1f}",
            f"{g['activations']:.1f}", f"{g['total']:.1f}", fits,
        ])  # fmt: skip
    head = ["model", "context", "weights", "KV cache", "one layer's activations", "total"]
    head += ["one 80 GB card (79 GiB usable)"]
    note = "GiB, batch 1, compiled layers, from `python -m rbs_bench.models.memory`'s formula "
    note += "(an estimate, not a measurement; `results/scale/` sets each measured peak beside it)."
    return md_table(head, rows) + "\n" + note + "\n"
