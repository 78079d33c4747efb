"""Generated blocks of measured speed: the README's commands, the CPU seconds per sample, the
standalone attention benchmark, the kernel-architecture check, layer profiles and TTFT inside the
model (docs/performance.md), all from results/speed/."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rbs_bench import methods
from rbs_bench.methods import DENSE
from rbs_bench.methods.rbs import RBS
from rbs_bench.tables import timing
from rbs_bench.tables.blocks import (
    MISSING,
    Sources,
    block,
    kilo,
    last_rows,
    md_table,
    num,
    pct,
    read_csv,
    sources_line,
    speed_file,
    times,
)
from rbs_bench.tables.timing import STANDALONE_DENSE, layers_run

H100 = "nvidia_h100_80gb_hbm3"
H200 = "nvidia_h200"
LONG = 131072  # the paper's speed setting
TARGET = 0.05


# ------------------------------------------------------------------------------------------------
# The README's two commands and the quick start's seconds per sample (CPU).


@block("commands")
def commands(src: Sources) -> str:
    """How long the README's commands took on a fresh clone (results/speed/commands_cpu.csv)."""
    path = speed_file(src, "commands_cpu.csv")
    df = read_csv(src, path)
    rows = []
    for r in df.itertuples():
        minutes, seconds = divmod(round(r.wall_s), 60)
        rows.append([
            f"`{r.command}`", r.outcome, f"{minutes} min {seconds:02d} s", f"{r.cpu_s:.0f} s",
            f"{r.load:.1f}",
        ])  # fmt: skip
    machine = f"{df['cores'].iloc[0]} cores, {df['machine'].iloc[0]}"
    head = ["command", "outcome", "wall", "CPU time", "load average at the start"]
    note = (
        f"Measured one after the other on a fresh clone ({machine}, shared with other jobs, "
        f"{df['date'].iloc[0]}, commit {df['commit'].iloc[0]}). " + sources_line(src, [path])
    )
    return md_table(head, rows, keys=2) + "\n" + note + "\n"


@block("cpu_samples")
def cpu_samples(src: Sources) -> str:
    """Seconds per quick-start sample, every method on the same samples in one process."""
    path = speed_file(src, "cpu_samples_cpu.csv")
    df = read_csv(src, path).set_index("method")
    names = list(df.index)
    head = [""] + [methods.display(m) if m != DENSE else DENSE for m in names]
    rows = [
        ["request (prefill + decode), s"] + [num(df.loc[m, "request_s"], ".3f") for m in names],
        ["over dense"] + [times(df.loc[m, "request_over_dense"]) for m in names],
        ["with the recall pass, s"] + [num(df.loc[m, "wall_s"], ".3f") for m in names],
        ["over dense"] + [times(df.loc[m, "wall_over_dense"]) for m in names],
    ]
    first = df.iloc[0]
    faster = [methods.display(m) for m in names if df.loc[m, "request_over_dense"] < 1]
    setting = (
        f"{first['task']} at {kilo(int(first['context_length']))}, the sparse methods at "
        f"`{df['budget'].iloc[-1]}`, median of {first['samples']} samples, {first['threads']} "
        f"threads, torch {first['torch']}, {str(first['time'])[:10]}"
    )
    lines = [
        f"Setting: {setting}.",
        "Faster than dense per request: " + (", ".join(faster) or "none") + ".",
        sources_line(src, [path]),
    ]
    return md_table(head, rows) + "\n" + "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# The standalone attention benchmark (H100).


def _attention(src: Sources, family: str) -> tuple[pd.DataFrame, Path]:
    suffix = "" if family == "synthetic" else f"_{family}"
    path = speed_file(src, f"attention{suffix}_{H100}.csv")
    return read_csv(src, path), path


def standalone_at(src: Sources, family: str, n: int) -> tuple[pd.Series, Path]:
    """RBS's row at 5% and context n (Triton executor) of one input family, and its CSV."""
    df, path = _attention(src, family)
    mine = df[(df["method"] == RBS.name) & (df["executor"] == "triton") & (df["n"] == n)]
    return mine[(mine["target"] - TARGET).abs() < 1e-9].iloc[-1], path


@block("standalone_rbs")
def standalone_rbs(src: Sources) -> str:
    """RBS at 5% against dense SDPA per context and input family, Triton executor."""
    rows, files = [], []
    for family in ("synthetic", "needles"):
        df, path = _attention(src, family)
        files.append(path)
        mine = df[(df["method"] == RBS.name) & (df["executor"] == "triton")]
        mine = mine[(mine["target"] - TARGET).abs() < 1e-9]
        for r in mine.sort_values("n").itertuples():
            err = r.err_sparse / r.err_dense_fa2 if pd.notna(r.err_sparse) else float("nan")
            rows.append([
                family, kilo(int(r.n)), num(100 * r.density, ".2f"), num(r.selector_ms),
                num(r.attention_ms), num(r.total_ms), pct(r.selector_share), pct(r.pct_cudnn),
                times(r.speedup_vs_sdpa_fa2, ".1f"), times(r.speedup_vs_sdpa_cudnn, ".1f"),
                times(err, ".2f"),
            ])  # fmt: skip
    head = [
        "inputs", "N", "density %", "selector ms", "attention ms", "total ms", "selector share",
        "of cuDNN's TFLOP/s", "x SDPA-FA2", "x SDPA-cuDNN", "error / dense SDPA-FA2's",
    ]  # fmt: skip
    note = (
        "32 query / 4 KV heads, d=128, bf16, batch 1, RBS calibrated to 5% on the input; the "
        "error column (at 128K) is the sparse output's max abs error against fp32 over the kept "
        "blocks, over dense SDPA-FA2's against fp32. "
    )
    return md_table(head, rows, keys=2) + "\n" + note + sources_line(src, files) + "\n"


@block("standalone_methods_128k")
def standalone_methods_128k(src: Sources) -> str:
    """Every method's block pattern at 128K and 5%, with its own selector (methods_128k run)."""
    rows, files = [], []
    for family in ("", "_needles"):
        path = speed_file(src, f"methods_128k{family}_{H100}.csv")
        df = read_csv(src, path)
        files.append(path)
        df = df[~df["method"].isin(STANDALONE_DENSE)]
        for r in df.sort_values("method", key=lambda s: s.map(methods.order_key)).itertuples():
            rows.append([
                r.inputs, methods.display(r.method), r.executor, num(100 * r.density, ".2f"),
                num(r.selector_ms), num(r.attention_ms), num(r.total_ms), pct(r.pct_cudnn),
                times(r.speedup_vs_sdpa_cudnn, ".1f"),
            ])  # fmt: skip
    head = [
        "inputs", "method", "executor", "density %", "selector ms", "attention ms", "total ms",
        "attention, of cuDNN's TFLOP/s", "x SDPA-cuDNN",
    ]  # fmt: skip
    return md_table(head, rows, keys=3) + "\n" + sources_line(src, files) + "\n"


@block("goals_128k")
def goals_128k(src: Sources) -> str:
    """The 128K goal run: RBS at 5% against cuDNN, and the selector with and without its check."""
    rows, files = [], []
    probe_path = speed_file(src, f"selector_check_probe_{H100}.csv")
    probe = read_csv(src, probe_path).set_index(["inputs", "what"])["ms"]
    for family in ("", "_needles"):
        path = speed_file(src, f"goals_128k{family}_{H100}.csv")
        df = read_csv(src, path).set_index("method")
        files.append(path)
        r, inputs = df.loc[RBS.name], df.loc[RBS.name, "inputs"]
        rows.append([
            inputs, num(r["total_ms"]), num(r["selector_ms"]), pct(r["selector_share"]),
            num(df.loc["sdpa_cudnn", "total_ms"], ".1f"), times(r["speedup_vs_sdpa_cudnn"], ".1f"),
            num(probe.get((inputs, "select_without_check"))),
            num(probe.get((inputs, "check_old_fp32_norm"))),
        ])  # fmt: skip
    head = [
        "inputs", "RBS total ms", "selector ms", "selector share", "dense cuDNN ms",
        "x SDPA-cuDNN", "selector kernels alone ms", "input check ms",
    ]  # fmt: skip
    goals = "Goals: selector at most 2.0 ms and 12% of the total, at least 15x SDPA-cuDNN. "
    return md_table(head, rows) + "\n" + goals + sources_line(src, files + [probe_path]) + "\n"


@block("arch_spaces")
def arch_spaces(src: Sources) -> str:
    """The Ampere tuning space against the Hopper one, both on an H100 (bench.variants arch)."""
    path = src.results / "speed" / "arch" / "arch.csv"
    df = read_csv(src, path)
    tests = df[df["kind"] == "tests"]
    space = df[df["kind"] == "space"].pivot_table(
        index=["n", "inputs"], columns="config", values="ms", aggfunc="last"
    )
    rows = [
        [kilo(int(n)), inputs, num(r["hopper"]), num(r["sm80"]), times(r["sm80"] / r["hopper"])]
        for (n, inputs), r in space.sort_index(ascending=[False, False]).iterrows()
    ]
    t = tests.iloc[-1]
    line = (
        f"With `RBS_KERNEL_ARCH=sm80`: {int(t['passed'])} gpu-marked kernel tests passed, "
        f"{int(t['failed'])} failed ({t['seconds']:.0f} s). "
    )
    head = ["N", "inputs", "Hopper space ms", "Ampere space ms", "Ampere / Hopper"]
    return md_table(head, rows, keys=2) + "\n" + line + sources_line(src, [path]) + "\n"


# ------------------------------------------------------------------------------------------------
# Where a layer's time goes (bench.layer_profile).


def _profile(src: Sources, gpu: str) -> tuple[pd.DataFrame, Path]:
    path = speed_file(src, f"layer_profile_{gpu}.csv")
    df = read_csv(src, path)
    df = df[df["method"].fillna(DENSE) == DENSE]
    return df, path


@block("layer_profile_h100")
def layer_profile_h100(src: Sources) -> str:
    """Per layer at 128K on an H100: attention, outside attention and its GEMMs, per path."""
    df, path = _profile(src, H100)
    rows = []
    for model in ("qwen3_30b_a3b", "qwen3_32b"):
        sub = df[df["model"] == model]
        keys = ["path", "ffn_chunk_tokens"]
        for (run_path, chunk), grp in sub.groupby(keys, sort=False):
            run = grp[grp["run"] == grp["run"].iloc[-1]]
            last = run.set_index("family")["ms_per_layer"]
            ratio = last.get("outside attention", float("nan")) / last.get("gemm_reference")
            peak = run["prefill_peak_mib"].max() if "prefill_peak_mib" in run else float("nan")
            rows.append([
                model, f"{run_path}, {_chunk(chunk)}", num(last.get("attention"), ".1f"),
                num(last.get("outside attention"), ".1f"), num(last.get("gemm_reference"), ".1f"),
                times(ratio), num(peak / 1024, ".1f"),
            ])  # fmt: skip
    head = ["model", "path", "attention ms", "outside attention ms", "its GEMMs alone ms"]
    head += ["outside / GEMMs", "prefill beyond the weights (GiB)"]
    note = "One decoder layer at 128K tokens, bf16, dense attention (cuDNN); the last run of each "
    note += "setting. "
    return md_table(head, rows, keys=2) + "\n" + note + sources_line(src, [path]) + "\n"


def _chunk(chunk, n: int = LONG) -> str:
    """How the feed-forward blocks ran: 0, or a chunk of the whole prompt, is unchunked."""
    chunk = int(chunk or 0)
    if chunk == 0 or chunk >= n:
        return "unchunked"
    return f"{chunk // 1024}K-token feed-forward chunks"


@block("layer_families_h100")
def layer_families_h100(src: Sources) -> str:
    """The MoE layer's kernels by family on an H100, eager against compiled (32K chunks)."""
    df, path = _profile(src, H100)
    df = df[df["model"] == "qwen3_30b_a3b"]
    cols = {}
    for label, want_path, chunk in (("eager", "eager", 16384), ("compiled", "compiled", 32768)):
        sub = df[(df["path"] == want_path) & (df["ffn_chunk_tokens"] == chunk)]
        run = sub[sub["run"] == sub["run"].iloc[-1]]
        cols[f"{label}, {_chunk(chunk)} (ms)"] = run.set_index("family")["ms_per_layer"]
    table = pd.DataFrame(cols)
    table = table[table.max(axis=1) >= 0.05]  # families that took no time in either
    rows = [[fam] + [num(v, ".1f") for v in r] for fam, r in table.iterrows()]
    note = "One layer at 128K tokens, dense attention; `top_kernels` in the CSV names the kernels "
    note += "of each family. "
    return md_table(["kernel family", *cols], rows) + "\n" + note + sources_line(src, [path]) + "\n"


@block("layer_profile_h200")
def layer_profile_h200(src: Sources) -> str:
    """Where one layer of the 48-layer compiled model spends its time on an H200."""
    return _family_table(src, H200, "qwen3_30b_a3b")


@block("layer_profile_h200_fp8")
def layer_profile_h200_fp8(src: Sources) -> str:
    """The same for the FP8 checkpoint's layers (`layer_profile --checkpoint`) on an H200."""
    return _family_table(src, H200, "qwen3_30b_a3b_fp8")


def _family_table(src: Sources, gpu: str, model: str) -> str:
    """The kernel families of `model`'s last profile on `gpu`, with its outside-attention time."""
    df, path = _profile(src, gpu)
    df = df[df["model"] == model]
    last = df[df["run"] == df["run"].iloc[-1]]
    r0 = last.iloc[0]
    rows = [
        [fam, num(ms, ".1f"), pct(share) if pd.notna(share) else MISSING]
        for fam, ms, share in last[["family", "ms_per_layer", "share"]].itertuples(index=False)
        if ms >= 0.05  # families that took no time in this layer
    ]
    setting = (
        f"{r0['model']}, {int(r0['layers'])} layers, {kilo(int(r0['n']))} tokens, "
        f"{r0['path']}, {_chunk(r0['ffn_chunk_tokens'])}; run {r0['run']}. "
    )
    head = ["kernel family", "ms per layer", "share of the layer"]
    return md_table(head, rows) + "\n" + setting + sources_line(src, [path]) + "\n"


# ------------------------------------------------------------------------------------------------
# TTFT inside the model (bench.ttft).


def ttft_rows(src: Sources, gpu: str, model: str, layers: int, compiled: bool, chunk: int):
    """The last rows of one setting at 128K: (frame, its CSV)."""
    path = speed_file(src, f"ttft_{gpu}.csv")
    df = read_csv(src, path)
    setting = df.apply(lambda r: layers_run(r), axis=1)
    keep = (df["model"] == model) & (df["layers"] == layers) & (df["n"] == LONG)
    keep &= setting.map(lambda s: s == (compiled, chunk)) & (df["status"] == "ok")
    sub = last_rows(df[keep], ["batch", "method"])
    return sub, path


def speed_table(src: Sources, csv: Path, rows: pd.DataFrame) -> Path | None:
    """The timing table `make tables` writes for the setting of `rows` (tables.timing names one
    file per setting of the CSV), if it exists."""
    df = read_csv(src, csv)
    tag = Path(csv).stem.removeprefix("ttft_")
    want = set(rows.index)
    for suffix, part in timing.setting_groups(df):
        if want <= set(part.index):
            path = src.results / "tables" / f"speed_{tag}{suffix}.md"
            return path if path.exists() else None
    return None


def _method_table(sub: pd.DataFrame, rows_wanted: list[str]) -> str:
    """Methods as columns (dense first, then table order), one row per wanted measure."""
    names = sorted(sub["method"].unique(), key=lambda m: (m != DENSE, methods.order_key(m)))
    one = sub[sub["batch"] == 1].set_index("method")
    four = sub[sub["batch"] == 4].set_index("method")
    measures = {
        "TTFT, batch 1 (s)": lambda m: num(one.loc[m, "ttft_ms"] / 1e3),
        "prefill attention (s)": lambda m: num(one.loc[m, "attention_ms"] / 1e3),
        "prefill attention speedup": lambda m: times(one.loc[m, "attention_speedup"], ".1f"),
        "TTFT speedup": lambda m: times(one.loc[m, "ttft_speedup"]),
        "outside attention per layer (ms)":
            lambda m: num(one.loc[m, "outside_ms_per_layer"], ".1f"),
        "over the layer's GEMMs": lambda m: times(one.loc[m, "outside_x_gemm"]),
        "peak allocated (GiB)": lambda m: num(one.loc[m, "peak_allocated_mib"] / 1024, ".1f"),
        "density %": lambda m: num(100 * one.loc[m, "density"], ".2f"),
        "SM clock over the timed requests (MHz)": lambda m: num(one.loc[m, "sm_clock_mhz"], ".0f"),
        "power draw (W)": lambda m: num(one.loc[m, "power_w"], ".0f"),
        "samples at the power cap":
            lambda m: f"{one.loc[m, 'power_capped_share']:.0%}"
            if pd.notna(one.loc[m, "power_capped_share"]) else MISSING,
        "TTFT, batch 4 (s)": lambda m: num(four.loc[m, "ttft_ms"] / 1e3) if m in four.index
        else MISSING,
        "TTFT speedup, batch 4": lambda m: times(four.loc[m, "ttft_speedup"]) if m in four.index
        else MISSING,
    }  # fmt: skip
    head = [""] + [DENSE if m == DENSE else methods.display(m) for m in names]
    cell = lambda w, m: measures[w](m) if m in one.index else MISSING
    return md_table(head, [[w] + [cell(w, m) for m in names] for w in rows_wanted])


MAIN_ROWS = [
    "TTFT, batch 1 (s)", "prefill attention speedup", "TTFT speedup",
    "outside attention per layer (ms)", "over the layer's GEMMs", "peak allocated (GiB)",
]  # fmt: skip


# a row's GPU clock and power over its timed requests (`bench.gpu_clocks`), where it has them
CLOCK_ROWS = [
    "SM clock over the timed requests (MHz)", "power draw (W)", "samples at the power cap",
]  # fmt: skip


def _ttft_block(src, gpu, model, layers, compiled, chunk, wanted, what: str) -> str:
    sub, path = ttft_rows(src, gpu, model, layers, compiled, chunk)
    one = sub[sub["batch"] == 1]
    clocks = "sm_clock_mhz" in one and bool(one["sm_clock_mhz"].notna().all())
    wanted = wanted + (CLOCK_ROWS if clocks else [])
    setting = (
        f"{what}: {model}, {layers} layers, {sub['dtype'].iloc[0]}, 128K tokens, "
        f"{'compiled' if compiled else 'eager'} layers, {_chunk(chunk)}; each method calibrated to "
        f"{TARGET:.0%} measured density on the prompt; {_runs(sub)}"
    )
    return _method_table(sub, wanted) + "\n" + setting + " " + sources_line(src, [path]) + "\n"


def _runs(sub: pd.DataFrame) -> str:
    """When the rows were measured, with one layer's GEMMs alone in that process. Rows of
    several processes (a rerun that added methods) name each process's methods: their speedups
    are against the dense row of another process, and its GEMMs say how alike the two GPUs ran."""
    gemm = sub["gemm_ms_per_layer"] if "gemm_ms_per_layer" in sub else pd.Series(dtype=float)
    runs = []
    for run, grp in sub.groupby("run", sort=True):
        g = gemm.loc[grp.index].dropna()
        alone = f"one layer's GEMMs alone: {g.iloc[0]:.1f} ms" if len(g) else ""
        runs.append((str(run), grp, alone))
    if len(runs) == 1:
        run, _, alone = runs[0]
        return f"run {run[:10]}." + (f" {alone[0].upper()}{alone[1:]}." if alone else "")
    parts = []
    for run, grp, alone in runs:
        shown = grp["method"].drop_duplicates()
        names = ", ".join(DENSE if m == DENSE else methods.display(m) for m in shown)
        parts.append(f"{run.replace('T', ' ')[:16]} ({names}{'; ' + alone if alone else ''})")
    return "measured in " + str(len(runs)) + " processes: " + "; ".join(parts) + "."


@block("ttft_h200_48l")
def ttft_h200_48l(src: Sources) -> str:
    """Every method, 48 layers, compiled and unchunked, one H200."""
    return _ttft_block(src, H200, "qwen3_30b_a3b", 48, True, 0, MAIN_ROWS, "H200")


@block("ttft_h200_48l_chunked")
def ttft_h200_48l_chunked(src: Sources) -> str:
    """The same H200 with the default 32K feed-forward chunks."""
    return _ttft_block(src, H200, "qwen3_30b_a3b", 48, True, 32768, MAIN_ROWS, "H200")


@block("ttft_h200_32b")
def ttft_h200_32b(src: Sources) -> str:
    """The dense Qwen3-32B, 64 layers, on one H200."""
    return _ttft_block(src, H200, "qwen3_32b", 64, True, 32768, MAIN_ROWS, "H200")


@block("ttft_h200_eager")
def ttft_h200_eager(src: Sources) -> str:
    """Every method with the eager layers (16K chunks), batch 1 and 4, on the H200."""
    wanted = ["TTFT, batch 1 (s)", "prefill attention speedup", "TTFT speedup"]
    wanted += ["outside attention per layer (ms)", "TTFT, batch 4 (s)", "TTFT speedup, batch 4"]
    return _ttft_block(src, H200, "qwen3_30b_a3b", 48, False, 16384, wanted, "H200, eager")


@block("ttft_h100_48l")
def ttft_h100_48l(src: Sources) -> str:
    """Dense and RBS, 48 layers on one H100: random bf16 weights against the FP8 checkpoint."""
    rows, files = [], []
    models = (
        ("qwen3_30b_a3b", "random bf16 weights, built in memory"),
        ("qwen3_30b_a3b_fp8", "FP8 checkpoint, from_pretrained"),
    )
    for model, dtype_label in models:
        sub, path = ttft_rows(src, H100, model, 48, True, 32768)
        files.append(path)
        one = sub[sub["batch"] == 1].set_index("method")
        d, r = one.loc[DENSE], one.loc[RBS.name]
        rows.append([
            dtype_label, num(d["ttft_ms"] / 1e3) + " s", num(r["ttft_ms"] / 1e3) + " s",
            f"{d['attention_ms'] / 1e3:.2f} s / {r['attention_ms'] / 1e3:.2f} s "
            f"({r['attention_speedup']:.1f}x)",
            times(r["ttft_speedup"]), num(one["peak_allocated_mib"].max() / 1024, ".1f") + " GiB",
        ])  # fmt: skip
    head = ["model", "dense TTFT", "RBS TTFT", "prefill attention dense / RBS", "TTFT speedup"]
    head += ["peak"]
    note = "48 layers, 128K, batch 1, compiled, 32K-token feed-forward chunks, RBS at 5%. "
    return md_table(head, rows) + "\n" + note + sources_line(src, files) + "\n"


LONG_CHUNK = 131072  # slurm/paper_models.sbatch's fp8-ttft: the whole 128K prompt per chunk


@block("ttft_h100_fp8")
def ttft_h100_fp8(src: Sources) -> str:
    """Every method on the FP8 checkpoint, one H100."""
    wanted = ["TTFT, batch 1 (s)", "prefill attention speedup", "TTFT speedup"]
    wanted += ["outside attention per layer (ms)", "over the layer's GEMMs", "density %"]
    return _ttft_block(src, H100, "qwen3_30b_a3b_fp8", 48, True, 32768, wanted, "H100, FP8")


@block("ttft_h100_fp8_whole")
def ttft_h100_fp8_whole(src: Sources) -> str:
    """Dense and RBS on the FP8 checkpoint with the feed-forward over the whole prompt (the FP8
    experts' products on cuBLAS), one H100."""
    wanted = ["TTFT, batch 1 (s)", "prefill attention speedup", "TTFT speedup"]
    wanted += ["outside attention per layer (ms)", "density %", "peak allocated (GiB)"]
    return _ttft_block(src, H100, "qwen3_30b_a3b_fp8", 48, True, LONG_CHUNK, wanted, "H100, FP8")


@block("ttft_h200_fp8_whole")
def ttft_h200_fp8_whole(src: Sources) -> str:
    """The FP8 checkpoint with the feed-forward over the whole prompt, one H200: the rows of the
    latest fp8-ttft run."""
    wanted = ["TTFT, batch 1 (s)", "prefill attention speedup", "TTFT speedup"]
    wanted += ["outside attention per layer (ms)", "over the layer's GEMMs", "density %"]
    return _ttft_block(src, H200, "qwen3_30b_a3b_fp8", 48, True, LONG_CHUNK, wanted, "H200, FP8")


@block("ttft_h100_4l")
def ttft_h100_4l(src: Sources) -> str:
    """The quick 4-layer eager rows on an H100, 32K-128K: RBS's speedups and batch-4 status."""
    path = speed_file(src, f"ttft_{H100}.csv")
    df = read_csv(src, path)
    df = df[(df["model"] == "qwen3_30b_a3b") & (df["layers"] == 4)]
    df = last_rows(df, ["batch", "n", "method"])
    rows = []
    for (b, n), grp in df.groupby(["batch", "n"]):
        r = grp.set_index("method")
        mine = r.loc[RBS.name] if RBS.name in r.index else None
        if mine is None or mine["status"] != "ok":
            status = MISSING if mine is None else mine["status"]
            rows.append([str(b), kilo(int(n)), status, MISSING, MISSING])
            continue
        rows.append([str(b), kilo(int(n)), "ok", times(mine["attention_speedup"]),
                     times(mine["ttft_speedup"])])  # fmt: skip
    head = ["batch", "N", "RBS row", "prefill attention speedup", "TTFT speedup"]
    return md_table(head, rows, keys=2) + "\n" + sources_line(src, [path]) + "\n"
