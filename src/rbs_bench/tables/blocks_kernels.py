"""Generated blocks of docs/kernels.md: the sparse attention kernel's configurations and the
selector's variants as measured (h100-i), the ncu profile of the tuned kernels (h100-k), the
errors on large logits and the goals of the 128K runs (h100-j), all on one H100."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from rbs_bench.methods import display
from rbs_bench.methods.rbs import RBS
from rbs_bench.tables.blocks import (
    Sources,
    block,
    kilo,
    md_table,
    num,
    pct,
    read_csv,
    sources_line,
    speed_file,
)
from rbs_bench.tables.blocks_speed import H100, H200, LONG, TARGET, standalone_at

HEADS = 32  # query heads of the benchmark's shape: an attention grid is (N / 128) x heads tiles


@block("kernel_variants")
def kernel_variants(src: Sources) -> str:
    """Every attention configuration of the h100-i run: ms (share of cuDNN's TFLOP/s) per N."""
    path = speed_file(src, f"attention_variants_{H100}.csv")
    df = read_csv(src, path)
    att = df[df["kind"] == "attention"]
    att = att.assign(
        inputs=att["inputs"].where(att["pattern"] == RBS.name, att["pattern"] + " blocks")
    )
    rows = []
    for (inputs, config), grp in att.groupby(["inputs", "config"], sort=False):
        at = grp.set_index("n")
        rows.append([inputs, f"`{config}`"] + [
            f"{at.loc[n, 'ms']:.2f} ({pct(at.loc[n, 'pct_cudnn'])})" if n in at.index else "–"
            for n in (32768, 65536, LONG)
        ])  # fmt: skip
    for family in ("synthetic", "needles"):
        cells = []
        for n in (32768, 65536, LONG):
            r, _ = standalone_at(src, family, n)
            cells.append(f"{r['attention_ms']:.2f} ({pct(r['pct_cudnn'])})")
        rows.append([family, "autotuned per length (h100-j)"] + cells)
    head = ["selection", "configuration (h100-i)", "32K ms", "64K ms", "128K ms"]
    key = (
        "Configuration: query x key tile (bm, bn), warps (w), stages (st), register cap (r), "
        "pointer or TMA loads, program order (o0: tiles of one head side by side; o1: a kv "
        "head's query heads adjacent; o2: every head of a tile). Selection: RBS's on each input "
        "family, or uniformly random blocks at the same density. "
    )
    files = [
        path,
        speed_file(src, f"attention_{H100}.csv"),
        speed_file(src, f"attention_needles_{H100}.csv"),
    ]
    return md_table(head, rows, keys=2) + "\n" + key + sources_line(src, files) + "\n"


@block("selector_variants")
def selector_variants(src: Sources) -> str:
    """The selector's launch variants of the h100-i run, ms per input family and N."""
    path = speed_file(src, f"attention_variants_{H100}.csv")
    df = read_csv(src, path)
    sel = df[df["kind"] == "selector"].pivot_table(
        index="config", columns=["inputs", "n"], values="ms", aggfunc="last", sort=False
    )
    cols = [(f, n) for n in (32768, 65536, LONG) for f in ("synthetic", "needles")]
    rows = [[f"`{c}`"] + [num(sel.loc[c].get(k), ".2f") for k in cols] for c in sel.index]
    head = ["variant"] + [f"{f} {kilo(n)}" for f, n in cols]
    return md_table(head, rows) + "\n" + sources_line(src, [path]) + "\n"


@block("selector_race_h200")
def selector_race_h200(src: Sources) -> str:
    """`bench.variants --parts selector` on one H200 at 128K: each method's whole selection at
    RBS's measured density (ms and its ratio to RBS's), then each selector variant's kernel
    time, per input family, with the rows whose kept count differs from the default's."""
    path = speed_file(src, f"selector_race_{H200}.csv")
    df = read_csv(src, path)
    families = list(dict.fromkeys(df["inputs"]))
    race = df[df["kind"] == "method"].set_index(["pattern", "inputs"])
    rows = []
    for name in dict.fromkeys(race.index.get_level_values(0)):
        rows.append([display(name)] + [
            f"{race.loc[(name, f), 'ms']:.2f} ({race.loc[(name, f), 'x_rbs']:.2f}x), "
            f"{100 * race.loc[(name, f), 'density']:.2f}%" if (name, f) in race.index else "–"
            for f in families
        ])  # fmt: skip
    head = ["whole selection"] + [f"{f} {kilo(LONG)}: ms (over RBS's), density" for f in families]
    out = md_table(head, rows)
    sel = df[df["kind"] == "selector"].set_index(["config", "inputs"])
    rows = []
    for config in dict.fromkeys(sel.index.get_level_values(0)):
        at = [sel.loc[(config, f)] for f in families]
        rows.append([f"`{config}`"] + [f"{r['ms']:.2f}" for r in at]
                    + [" / ".join(pct(r.get("bound_share", 0.0), ".1f") for r in at)]
                    + [str(sum(int(r["differ_counts"]) for r in at))])  # fmt: skip
    head = ["RBS kernel variant"] + [f"{f} {kilo(LONG)} ms" for f in families]
    head += ["rescue scores from their bound (" + " / ".join(families) + ")"]
    head += ["rows kept differently"]
    note = (
        "The whole selection is each method's `select` as a layer calls it (input checks, key-"
        "block statistics, scoring, thresholds, compaction); the variants time the key-block "
        "statistics and the kernel alone. Each rival is calibrated to RBS's measured density; "
        "one whose knob cannot reach it within the search's tolerance shows the density it "
        "reached; – : not in that family's run. 32 query and 4 KV heads of 128, bf16. "
    )
    return out + "\n" + md_table(head, rows) + "\n" + note + sources_line(src, [path]) + "\n"


NCU = {  # the row of the ncu table -> (metric, format)
    "duration (ms)": ("gpu__time_duration.sum", lambda v: f"{v / 1e6:.2f}"),
    "tensor pipe active (% of peak)": (
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", lambda v: f"{v:.0f}"),
    "special-function pipe (XU) (%)": (
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", lambda v: f"{v:.0f}"),
    "issue slots used (%)": (
        "smsp__issue_active.avg.pct_of_peak_sustained_active", lambda v: f"{v:.0f}"),
    "warps active per SM (average)": (
        "sm__warps_active.avg.per_cycle_active", lambda v: f"{v:.1f}"),
    "L2 hit rate (%)": ("lts__t_sector_hit_rate.pct", lambda v: f"{v:.0f}"),
}  # fmt: skip
STALLS = ("barrier", "wait", "long_scoreboard", "short_scoreboard", "gmma")


def _ncu(path: Path) -> pd.DataFrame:
    """The kernels of an ncu --page raw CSV (the tool's notes before the header dropped)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])), dtype=str)
    return df.iloc[1:].reset_index(drop=True)  # the first row holds the units


def _value(text: str) -> float:
    return float(str(text).replace(",", ""))  # ncu prints thousands separators


@block("ncu_tuned")
def ncu_tuned(src: Sources) -> str:
    """What bounds the tuned kernels: ncu's counters per kernel and context (h100-k)."""
    path = speed_file(src, f"attention_ncu_tuned_{H100}.csv")
    df = _ncu(src.need(path))
    attention = df["Kernel Name"].str.contains("sparse")
    grid = df["Grid Size"].str.strip("()").str.split(",").str[0].astype(int)
    # a selector kernel follows its attention kernel: it has the same context
    n = (grid * 128 // HEADS).where(attention).ffill().astype(int)
    labels = [
        f"{'attention' if a else 'selector'} {kilo(x)}" for a, x in zip(attention, n)
    ]  # fmt: skip
    order = sorted(range(len(df)), key=lambda i: (not attention[i], n[i]))
    rows = []
    for name, (metric, fmt) in NCU.items():
        rows.append([name] + [fmt(_value(df.loc[i, metric])) for i in order])
    stall = lambda i, s: _value(
        df.loc[i, f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"]
    )
    rows.append(["stall cycles per issue: " + " / ".join(STALLS).replace("_", " ")] + [
        " / ".join(f"{stall(i, s):.1f}" for s in STALLS) for i in order
    ])  # fmt: skip
    head = [""] + [labels[i] for i in order]
    return md_table(head, rows) + "\n" + sources_line(src, [path]) + "\n"


@block("errors_128k")
def errors_128k(src: Sources) -> str:
    """Errors against fp32 at 128K on the sampled query blocks: the sparse kernel, PyTorch's bf16
    SDPA over the same kept blocks, and dense SDPA (FA2, cuDNN)."""
    rows, files = [], []
    for family in ("synthetic", "needles"):
        r, path = standalone_at(src, family, LONG)
        files.append(path)
        kinds = ("sparse", "masked_sdpa", "dense_fa2", "dense_cudnn")
        cells = [f"{r[f'err_{k}']:.4f} / {r[f'err_{k}_rel']:.1e}" for k in kinds]
        rows.append([family, *cells, f"{int(r['err_blocks'])}"])
    head = ["inputs", "sparse kernel", "PyTorch bf16 SDPA, same kept blocks", "SDPA FA2, dense"]
    head += ["SDPA cuDNN, dense", "query blocks"]
    note = "Max abs error / largest relative L2 error of a row, against fp32 references. "
    return md_table(head, rows, keys=1) + "\n" + note + sources_line(src, files) + "\n"


def _verdict(values: list[float], ok) -> str:
    met = sum(1 for v in values if ok(v))
    return (
        "met" if met == len(values) else "missed" if met == 0 else f"met in {met} of {len(values)}"
    )


@block("kernel_goals")
def kernel_goals(src: Sources) -> str:
    """The goals of the 128K work, checked on the attention run and the methods run (h100-j)."""
    runs: dict[str, list[pd.Series]] = {}
    files = []
    for family, suffix in (("synthetic", ""), ("needles", "_needles")):
        first, path = standalone_at(src, family, LONG)
        m_path = speed_file(src, f"methods_128k{suffix}_{H100}.csv")
        methods_run = read_csv(src, m_path)
        second = methods_run[methods_run["method"] == RBS.name].iloc[-1]
        runs[family] = [first, second]
        files += [path, m_path]
    long_rows = {
        f: [standalone_at(src, f, n)[0] for n in (65536, LONG, 262144)] for f in runs
    }  # fmt: skip
    mid_rows = {f: [standalone_at(src, f, n)[0] for n in (32768, 65536)] for f in runs}
    goals = [
        ("total >= 25x SDPA-FA2 at 128K", lambda r: r["speedup_vs_sdpa_fa2"], ".1f", "x",
         lambda v: v >= 25, runs),
        ("total >= 15x SDPA-cuDNN at 128K", lambda r: r["speedup_vs_sdpa_cudnn"], ".1f", "x",
         lambda v: v >= 15, runs),
        ("attention >= 85% of cuDNN at 128K", lambda r: 100 * r["pct_cudnn"], ".1f", "%",
         lambda v: v >= 85, runs),
        ("attention >= 75% of cuDNN at 32K-64K", lambda r: 100 * r["pct_cudnn"], ".1f", "%",
         lambda v: v >= 75, mid_rows),
        ("selector <= 2.0 ms at 128K", lambda r: r["selector_ms"], ".2f", " ms",
         lambda v: v <= 2.0, runs),
        ("selector <= 12% of the total at 64K-256K", lambda r: 100 * r["selector_share"], ".1f",
         "%", lambda v: v <= 12, long_rows),
        ("sparse error <= 2x dense SDPA's at 128K",
         lambda r: r["err_sparse"] / r["err_dense_fa2"], ".2f", "x", lambda v: v <= 2,
         {f: [runs[f][0]] for f in runs}),
    ]  # fmt: skip
    rows = []
    for name, get, spec, unit, ok, where in goals:
        cells, every = [], []
        for family in runs:
            vals = [float(get(r)) for r in where[family]]
            every += vals
            cells.append("; ".join(f"{v:{spec}}{unit}" for v in vals))
        rows.append([name, *cells, _verdict(every, ok)])
    head = ["goal (RBS at 5%, Triton executor)", "synthetic", "needles", "verdict"]
    note = (
        "At 128K the two values are the attention run and the methods run; at 32K-64K and "
        "64K-256K one value per length. "
    )
    return md_table(head, rows, keys=1) + "\n" + note + sources_line(src, files) + "\n"


@block("cudnn_rate_128k")
def cudnn_rate_128k(src: Sources) -> str:
    """Dense SDPA-cuDNN's rate at 128K in each H100 run, and the 5% problem's time at that rate."""
    files, rows = [], []
    names = [f"attention_{H100}.csv", f"attention_needles_{H100}.csv"]
    names += [f"methods_128k_{H100}.csv", f"methods_128k_needles_{H100}.csv"]
    names += [f"goals_128k_{H100}.csv", f"goals_128k_needles_{H100}.csv"]
    for name in names:
        path = speed_file(src, name)
        df = read_csv(src, path)
        r = df[(df["method"] == "sdpa_cudnn") & (df["n"] == LONG)].iloc[-1]
        files.append(path)
        rows.append([
            f"`{name}`", r["inputs"], f"{r['total_ms']:.1f}", f"{r['eff_tflops']:.0f}",
            f"{r['total_ms'] * TARGET:.1f}",  # 5% of the dense FLOPs at the dense rate
        ])  # fmt: skip
    head = ["run", "inputs", "dense cuDNN ms", "dense cuDNN TFLOP/s", "5% of it at that rate, ms"]
    return md_table(head, rows, keys=2) + "\n" + sources_line(src, files) + "\n"


@block("fp8_gemm_h100")
def fp8_gemm_h100(src: Sources) -> str:
    """`bench.fp8_gemm` on one H100 (`_fp8_gemm_table`)."""
    return _fp8_gemm_table(src, H100)


@block("fp8_gemm_h200")
def fp8_gemm_h200(src: Sources) -> str:
    """`bench.fp8_gemm` on one H200 (`_fp8_gemm_table`)."""
    return _fp8_gemm_table(src, H200)


def _fp8_gemm_table(src: Sources, gpu: str) -> str:
    """Each FP8 layer's product at the largest token count as the model calls it (cuBLAS's
    block-scaled GEMM where it takes the shape, else Triton), its parts, and bf16 on the same
    rows; the experts block as the compiled layers run it (`fp8_moe`); the checks passed (a run
    without checks says so); the sum of a layer's products at each token count."""
    path = speed_file(src, f"fp8_gemm_{gpu}.csv")
    df = read_csv(src, path)
    checks = df[df["kind"] == "check"]
    every = df[df["kind"] == "time"]
    times = every[every["tokens"] == every["tokens"].max()]
    rows = []
    for _, r in times.iterrows():
        base = _bf16_ms(r)
        cublas = pd.notna(r.get("ms_fp8_cublas_block")) or pd.notna(r.get("ms_fp8_cublas_grouped"))
        runs = "cuBLAS" if cublas else "Triton"
        if r["layer"] == "experts":
            runs = "`fp8_moe`, 4 passes"
        elif r["layer"] in ("gate_up", "down"):
            runs += ", alone (a part of experts)"
        name = {"k": "k (and v)", "qkv": "qkv (q, k, v as one)"}.get(r["layer"], r["layer"])
        rows.append([
            name, runs, f"{num(r['ms_fp8'], '.2f')} ({num(r['tflops_fp8'], '.0f')})",
            num(r.get("ms_fp8_quant"), ".2f"), num(r.get("ms_fp8_cublas_block_gemm"), ".2f"),
            num(r.get("ms_fp8_gemm"), ".2f"), f"{num(base, '.2f')}", f"{base / r['ms_fp8']:.2f}x",
        ])  # fmt: skip
    head = ["layer", "runs on", "FP8 ms (TFLOP/s)", "its quantisation", "cuBLAS product alone"]
    head += ["Triton product alone", "bf16 ms", "bf16 / FP8"]
    passed = int((checks["check"] == "PASS").sum()) if "check" in checks else 0
    sums = [
        f"{tokens:,} tokens: FP8 {fp8:.1f} ms, bf16 {bf16:.1f} ms ({fp8 / bf16:.3f}x)"
        for tokens, fp8, bf16 in fp8_layer_sums(every)
    ]
    note = (
        "The experts row is the whole block as the compiled layers run it (the rows quantised, "
        "both products, the gate, the weighted sum) against bf16 `grouped_mm` with its gather, "
        "gate and sum"
        + (", compiled as the bf16 layers run it" if "ms_bf16_compiled" in times else ", eager")
        + "; gate_up and down are its products timed alone as `fp8_grouped_linear` runs them"
        + (
            " (its cuBLAS loop needs K a multiple of 512, so down stays on Triton there; the "
            "block lays down's weight scales out for cuBLAS and runs both on it, stages below)"
            if any(c.startswith("ms_stage_") for c in times.columns)
            else ""
        )
        + "; qkv is q, k and v as one "
        "product, as the compiled layers run FP8 ones (bf16 the same way). A layer's products "
        "(qkv where the run timed it, else q, k and v apart; o; the experts block): "
        + "; ".join(sums)
        + ". "
        + (
            f"Checks against the reference: {passed} of {len(checks)} pass. "
            if len(checks)
            else "This run made no checks (`--no-checks`); tests/kernels/test_fp8_gemm.py "
            "compares every path with the reference on the GPU. "
        )
        + _tma_sentence(times)
        + _launch_sentence(times)
        + _stages_sentence(times)
        + _producers_sentence(every)
    )
    return md_table(head, rows) + "\n" + note + sources_line(src, [path]) + "\n"


def _producers_sentence(every: pd.DataFrame) -> str:
    """The layer's products with q/k/v's and o's inputs quantised by their producers
    (`fp8_producer_sums`), the parts at the largest token count; "" where the run did not time
    them."""
    sums = fp8_producer_sums(every)
    if not sums:
        return ""
    tokens = max(t for t, _, _ in sums)
    by = every[every["tokens"] == tokens].set_index("layer")
    qkv, o = by.loc["qkv"], by.loc["o"]
    totals = "; ".join(
        f"{t:,} tokens: FP8 {fp8:.2f} ms, bf16 {bf16:.2f} ms ({fp8 / bf16:.3f}x)"
        for t, fp8, bf16 in sums
    )
    return (
        "With q/k/v's and o's inputs quantised by their producers, as the sparse FP8 layers run "
        "them (`models.fastpath`), a layer's products: "
        + totals
        + f". At {tokens:,} tokens: qkv's product of the quantised rows alone "
        f"{qkv['ms_fp8_quantised']:.2f} ms, its input RMSNorm writing e4m3 rows "
        f"{qkv['ms_norm_fp8']:.3f} ms against {qkv['ms_norm_bf16']:.3f} ms writing bf16; o's "
        f"product alone {o['ms_fp8_quantised']:.2f} ms, the sparse attention writing its output "
        f"quantised {o['ms_attention_fp8']:.2f} ms against {o['ms_attention_bf16']:.2f} ms in bf16"
        + _attention_setup(o)
        + ". "
    )


def _attention_setup(o: pd.Series) -> str:
    """The attention `bench.fp8_gemm` timed for o's producer, from the row's `attention_<key>`
    columns; "" for a CSV written before the rows recorded it."""
    keys = [f"attention_{k}" for k in ("q_heads", "kv_heads", "head_dim", "block", "density")]
    if not all(k in o.index and pd.notna(o[k]) for k in keys):
        return ""
    hq, hkv, d, block, density = (o[k] for k in keys)
    return (
        f" ({int(hq)} query and {int(hkv)} key/value heads of {int(d)}, blocks of {int(block)}, "
        f"{density:.0%} of each row's blocks)"
    )


def _launch_sentence(times: pd.DataFrame) -> str:
    """The experts block with its per-expert cuBLAS calls launched from other numbers of host
    threads (`ms_fp8_threads<n>` of `bench.fp8_gemm`) beside the run's default count
    (`launch_threads`); "" where the run timed none."""
    by = times.set_index("layer")
    if "experts" not in by.index:
        return ""
    block = by.loc["experts"]
    other = {
        int(c.removeprefix("ms_fp8_threads")): block[c]
        for c in times.columns
        if c.startswith("ms_fp8_threads") and pd.notna(block[c])
    }
    if not other or pd.isna(block.get("launch_threads")):
        return ""
    parts = ", ".join(f"{n} thread{'s' * (n > 1)} {ms:.2f} ms" for n, ms in sorted(other.items()))
    return (
        f"The experts block with its per-expert cuBLAS calls launched from {parts}, against "
        f"{block['ms_fp8']:.2f} ms from the default {int(block['launch_threads'])}. "
    )


def _stages_sentence(times: pd.DataFrame) -> str:
    """The experts block stage by stage (`ms_stage_*` of `bench.fp8_gemm`, each timed
    alone), and how much of the FP8 layer is cuBLAS's products: qkv's and o's products alone and
    the experts' two, against the layer's FP8 and bf16 sums; "" where the run timed no stages."""
    by = times.set_index("layer")
    keys = [c for c in times.columns if c.startswith("ms_stage_")]  # in the order they ran
    if "experts" not in by.index or not keys:
        return ""
    block = by.loc["experts"]
    stages = {k.removeprefix("ms_stage_"): block[k] for k in keys}
    if any(pd.isna(v) for v in stages.values()) or not {"gate_up", "down"} <= set(stages):
        return ""
    parts = "; ".join(f"{k} {v:.2f}" for k, v in stages.items())
    text = (
        f"The experts block stage by stage on its cuBLAS path, each stage timed alone (ms): "
        f"{parts}; together {sum(stages.values()):.2f} against the block's "
        f"{block['ms_fp8']:.2f}. "
    )
    sums = fp8_layer_sums(times)
    alone = [by.loc[p].get("ms_fp8_cublas_block_gemm") for p in ("qkv", "o") if p in by.index]
    if len(alone) < 2 or any(pd.isna(v) for v in alone) or not sums:
        return text
    _, fp8, bf16 = sums[-1]
    products = sum(alone) + stages["gate_up"] + stages["down"]
    return text + (
        f"cuBLAS's block-scaled products (qkv's and o's alone, the experts' gate_up and down) "
        f"take {products:.2f} ms of the FP8 layer's {fp8:.2f} ({products / bf16:.2f}x the bf16 "
        f"layer's {bf16:.2f} ms); the quantisation, the row passes and the launch gaps the other "
        f"{fp8 - products:.2f} ms. "
    )


def _tma_sentence(times: pd.DataFrame) -> str:
    """The Triton products in the persistent TMA form against the pointer kernel, where the run
    timed both (`ms_fp8_gemm_pointer`; the block on Triton: `ms_fp8_triton_pointer`)."""
    pairs = []
    for _, r in times.iterrows():
        for tma, ptr, what in (
            ("ms_fp8_gemm", "ms_fp8_gemm_pointer", r["layer"]),
            ("ms_fp8_triton", "ms_fp8_triton_pointer", "the experts block on Triton"),
        ):
            if pd.notna(r.get(ptr)) and pd.notna(r.get(tma)):
                pairs.append(f"{what} {r[tma]:.2f} ms against {r[ptr]:.2f}")
    if not pairs:
        return ""
    return (
        "The Triton products in the persistent TMA form, against the pointer kernel on the same "
        "rows: " + "; ".join(pairs) + ". "
    )


@block("moe_passes_h200")
def moe_passes_h200(src: Sources) -> str:
    """`bench.moe_passes` on one H200: each row pass of the FP8 experts at the run's default
    setting, at its fastest setting, and at the setting the kernels use now (their module
    constants in `kernels.fp8_moe` / `kernels.moe_combine`), in ms and GB/s."""
    from rbs_bench.kernels import fp8_moe, moe_combine

    path = speed_file(src, f"moe_passes_{H200}.csv")
    df = read_csv(src, path)
    rows = []
    for name, at in df.groupby("pass", sort=False):
        first = at[at["default"].astype(str) == "True"].iloc[0]
        best = at.loc[at["ms"].idxmin()]
        keys = [kv.split("=")[0] for kv in first["setting"].split()]
        values = {k: getattr(fp8_moe, k, getattr(moe_combine, k, None)) for k in keys}
        now = " ".join(f"{k}={v}" for k, v in values.items())
        used = at[at["setting"] == now]
        used_ms = f"{used['ms'].iloc[0]:.3f}" if len(used) else "–"
        if None in values.values():  # a pass the kernels no longer run (its run is the record)
            now, used_ms = "– (no longer run)", "–"
        rows.append([
            name, first["setting"], f"{first['ms']:.3f} ({first['gb_per_s']:.0f})",
            best["setting"], f"{best['ms']:.3f} ({best['gb_per_s']:.0f})",
            f"{best['x_default']:.2f}x", now, used_ms,
        ])  # fmt: skip
    head = ["pass", "the run's default", "ms (GB/s)", "fastest", "ms (GB/s)", "x default"]
    head += ["the kernels' setting now", "its ms"]
    tokens = int(df["tokens"].iloc[0])
    same = bool(df["same_bytes"].astype(str).eq("True").all())
    note = (
        f"{tokens:,} tokens of Qwen3-30B-A3B's experts (hidden 2048, 768 per expert, 128 experts, "
        "top 8); GB/s counts the bytes each pass must read and write. "
        + ("Every setting wrote the default's bytes exactly. " if same else
           "Some settings wrote other bytes than the default's (see the CSV). ")
    )  # fmt: skip
    return md_table(head, rows) + "\n" + note + sources_line(src, [path]) + "\n"


# A bench.fp8_gemm row's bf16 baseline, the first of these it timed: cuBLAS for a plain layer;
# for the experts the block compiled as the bf16 layers run it, else (runs before that column)
# eager grouped_mm.
BF16_BASELINES = ("bf16_cublas", "bf16_compiled", "bf16_grouped_mm")


def _bf16_ms(r) -> float:
    """The bf16 time of a bench.fp8_gemm row (`BF16_BASELINES`; NaN where it timed none)."""
    for key in (f"ms_{b}" for b in BF16_BASELINES):
        v = r.get(key)
        if v is not None and pd.notna(v):
            return float(v)
    return float("nan")


def fp8_layer_sums(times: pd.DataFrame) -> list[tuple[int, float, float]]:
    """(tokens, FP8 ms, bf16 ms) of a decoder layer's products, q + k + v + o + the experts
    block, for each token count of `bench.fp8_gemm`'s time rows with all of them timed. Where
    the run timed `qkv` (q, k and v as one product, as the compiled layers run FP8 ones), both
    sums take it: bf16 fused the same way, like for like."""
    sums = []
    for tokens, at in times.groupby("tokens"):
        by = at.set_index("layer")
        if not {"q", "k", "o", "experts"} <= set(by.index):
            continue
        parts = ["q", "k", "k", "o", "experts"]  # v has k's shape
        if "qkv" in by.index:
            parts = ["qkv", "o", "experts"]
        fp8 = sum(float(by.loc[p, "ms_fp8"]) for p in parts)
        bf16 = sum(_bf16_ms(by.loc[p]) for p in parts)
        sums.append((int(tokens), fp8, bf16))
    return sums


# what a producer that quantises the layer's input adds to its own time: (layer, the FP8
# producer's column, the bf16 producer's column) of bench.fp8_gemm's producer times
PRODUCERS = (("qkv", "ms_norm_fp8", "ms_norm_bf16"), ("o", "ms_attention_fp8", "ms_attention_bf16"))


def fp8_producer_sums(times: pd.DataFrame) -> list[tuple[int, float, float]]:
    """`fp8_layer_sums` with q/k/v's and o's inputs quantised by their producers, as the sparse
    FP8 layers run them (`models.fastpath`): each of the two products alone on its quantised
    rows (`ms_fp8_quantised`), plus what quantising costs its producer, the input RMSNorm's
    e4m3 rows against its bf16 rows and the sparse attention's quantised output against its
    bf16 output (`PRODUCERS`; negative where writing e4m3 is the faster). For token counts where
    the run timed them; bf16 as in `fp8_layer_sums`."""
    sums = []
    plain = {tokens: bf16 for tokens, _, bf16 in fp8_layer_sums(times)}
    cols = ["ms_fp8_quantised", *(c for _, *pair in PRODUCERS for c in pair)]
    for tokens, at in times.groupby("tokens"):
        by = at.set_index("layer")
        if int(tokens) not in plain or not {"qkv", "o", "experts"} <= set(by.index):
            continue
        if any(c not in by.columns for c in cols):
            continue
        parts = [
            by.loc[layer, "ms_fp8_quantised"] + by.loc[layer, fp8] - by.loc[layer, bf16]
            for layer, fp8, bf16 in PRODUCERS
        ]
        if any(pd.isna(p) for p in parts):
            continue
        fp8_ms = float(sum(parts)) + float(by.loc["experts", "ms_fp8"])
        sums.append((int(tokens), fp8_ms, plain[int(tokens)]))
    return sums
