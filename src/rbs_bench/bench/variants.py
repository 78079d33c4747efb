"""Check, time and profile the kernels' configurations in one GPU call.

    python -m rbs_bench.bench.variants --out DIR [--budget-s 300] [--parts selector]
    ncu ... --profile-from-start off python -m rbs_bench.bench.variants profile --out DIR
    ncu ... python -m rbs_bench.bench.variants profile --tuned --lengths 65536 131072
    python -m rbs_bench.bench.variants arch --out DIR [--budget-s 540]

`time` (the default): per input family (`rbs_bench.synthetic.FAMILIES`) and length, RBS is
calibrated to 5% measured density; then every configuration of the sparse attention kernel in
`ATTENTION_CONFIGS` is checked against an fp32 computation over the same kept blocks and timed on
that selection (and at 128K on uniformly random blocks of the same density), next to dense cuDNN,
each method's whole selection (RBS's and, calibrated to its density, each of `rivals()`) is
timed on the same input, and every selector variant in `SELECTOR_CONFIGS` is checked against
the default one and timed,
with the share of candidates the two-pass variant scores exactly and the share whose rescue
score the rescue-bound variants take from its bound, and, beside the autotuned
attention kernel's time on the same selection (`kind=tuned`), its sum with that time, its
share of the sum and the sum's speedup over dense cuDNN (`--parts selector` times the selector
variants only). At 128K the sparse output's
error is compared with dense SDPA's (`rbs_bench.bench.attention`). Rows go to DIR/variants.csv as
they finish; the fastest attention configuration goes to DIR/best.json, and a table is printed
last. `profile` runs the previous and the fastest configuration and two selector variants once
each at 128K between cudaProfilerStart/Stop, for ncu; `profile --tuned` the autotuned attention
kernel and the default selector at each length instead.

`arch`: the Ampere tuning space (`block_sparse_attn.SM80_SPACE`, what a GPU of capability 8.x
tunes over) on this GPU. First the gpu-marked tests of the kernels that choose configurations by
architecture (`ARCH_TESTS`: the sparse attention kernel and the FP8 GEMM; `--tests`) in a
subprocess with RBS_KERNEL_ARCH=sm80, so that every kernel launches with its sm80
configurations (their pass/fail counts and the output's tail go to DIR/arch.csv and
DIR/arch_tests.log); then per input family and length (32K-128K by default), RBS calibrated to
5%: the autotuned attention kernel over the Hopper space and over the Ampere space, checked
against fp32 over the kept blocks, with the configuration each autotuner chose, each Ampere
configuration on its own, and dense cuDNN. Rows go to DIR/arch.csv as they finish; a rerun skips
the tests and the (family, length) cells already there, and --budget-s stops starting new ones.
These are times on this GPU, not on an A100.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from rbs_bench.methods import DENSE
from rbs_bench.methods.rbs import RBS

DEVICE = "cuda"
SHAPE = {"heads": 32, "kv_heads": 4, "head_dim": 128}  # the benchmark's 32 query / 4 KV heads
LONG = 131072  # the length of the random pattern, the error comparison and the profile
# (BLOCK_N, num_warps, num_stages, maxnreg, MERGE_DIAG, TMA, ORDER, BLOCK_M); see
# block_sparse_attn's TUNING_SPACE. The first is the configuration the kernel shipped with.
ATTENTION_CONFIGS = (
    (64, 8, 2, 128, False, False, 0, 128),
    (64, 8, 2, 128, True, False, 0, 128),
    (128, 8, 3, None, False, False, 0, 128),
    (32, 8, 3, 128, False, False, 0, 128),
    (64, 8, 2, 128, False, True, 0, 128),
    (32, 8, 3, 128, False, True, 0, 128),
    (32, 8, 4, 128, False, True, 0, 128),
    (32, 8, 3, 128, True, True, 0, 128),
    (32, 8, 4, 128, False, True, 1, 128),
    (32, 8, 4, 128, False, True, 2, 128),
    (64, 8, 3, None, False, True, 0, 128),
    (128, 8, 2, None, False, True, 0, 128),
    (64, 8, 3, None, False, True, 1, 128),
    (64, 4, 3, None, False, True, 0, 64),
    (64, 4, 2, None, False, True, 0, 64),
)
# rbs_select launch options (`rbs_select._launch`); "default" is the shipped path: one exact
# pass, the row a called function (168 registers, three programs of 4 warps per SM, 2 stages).
# docs/kernels.md has what ptxas reports for each and the prediction behind it.
_INLINED = dict(call=False, maxnreg=None, per_sm=2)  # async wgmma: no call boundary, 255 regs
SELECTOR_CONFIGS = {
    "default": dict(),
    "fast": dict(fast=True),  # one offset per row, exact redo near overflow (the first path)
    "two-pass": dict(two_pass=True),  # bounds first, exact scores of the live blocks only
    "two-pass-2/sm": dict(two_pass=True, per_sm=2, maxnreg=None),
    "mean-offset": dict(offset="mean"),  # no block-0 dot per row
    "fast-log": dict(fast_log=True),  # lg2.approx for each block's log-sum
    "rescue-bound": dict(rescue_bound=True),  # skip rescue exps of tiles bounded below threshold
    "rescue-bound-fast-log": dict(rescue_bound=True, fast_log=True),
    "rescue-bound-fast-log-mean": dict(rescue_bound=True, fast_log=True, offset="mean"),
    "fast-log-mean": dict(fast_log=True, offset="mean"),
    "st1": dict(num_stages=1),
    "inlined-2/sm": _INLINED,
    "inlined-2/sm-st1": dict(_INLINED, num_stages=1),
    "inlined-2/sm-st1-mean": dict(_INLINED, num_stages=1, offset="mean"),
    "inlined-2/sm-st1-mean-fast-log": dict(_INLINED, num_stages=1, offset="mean", fast_log=True),
    "inlined-3/sm-r168-st1-mean-fast-log": dict(
        call=False, maxnreg=168, per_sm=3, num_stages=1, offset="mean", fast_log=True
    ),
    "inlined-8w-1/sm-st1-mean-fast-log": dict(
        call=False,
        maxnreg=None,
        num_warps=8,
        per_sm=1,
        num_stages=1,
        offset="mean",
        fast_log=True,
    ),  # fmt: skip
}


def tag(cfg) -> str:
    bn, w, st, reg, merge, tma, order, bm = cfg
    return f"bm{bm}-bn{bn}-w{w}-st{st}-r{reg or 'max'}{'-merged' if merge else ''}" + (
        f"-{'tma' if tma else 'ptr'}-o{order}"
    )


def as_config(cfg) -> dict:
    bn, w, st, reg, merge, tma, order, bm = cfg
    return dict(
        BLOCK_N=bn, num_warps=w, num_stages=st, maxnreg=reg, MERGE_DIAG=merge, TMA=tma,
        ORDER=order, BLOCK_M=bm,
    )  # fmt: skip


class Rows:
    """Rows written to a CSV as they come; with `resume`, the rows already there are kept."""

    def __init__(self, path: Path, resume: bool = False):
        import pandas as pd

        self.path, self.rows = path, []
        if resume and path.exists():
            self.rows = pd.read_csv(path).to_dict("records")

    def add(self, **row) -> None:
        import pandas as pd

        self.rows.append(row)
        pd.DataFrame(self.rows).to_csv(self.path, index=False)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)


def setup(family: str, n: int, seed: int = 0):
    """(q, k, v, rbs selector calibrated to 5%, its selection, density) on the GPU."""
    from rbs_bench import synthetic
    from rbs_bench.bench.attention import calibrate

    data = synthetic.generate(
        1, SHAPE["heads"], SHAPE["kv_heads"], n, SHAPE["head_dim"],
        structure=synthetic.FAMILIES[family], seed=seed, device=DEVICE, dtype=torch.bfloat16,
    )  # fmt: skip
    selector, density = calibrate(RBS.name, data.q, data.k, 0.05, tol=5e-4)
    return data.q, data.k, data.v, selector, selector.select(data.q, data.k), density


def random_selection(n: int, heads: int, density: float, seed: int, block: int = 128):
    """Uniformly random kept blocks (each causal pair with the same probability) plus the
    diagonal, at about `density` of the causal pairs."""
    from rbs_bench.methods.selection import BlockSelection

    m = math.ceil(n / block)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    mask = torch.rand(1, heads, m, m, generator=gen, device=DEVICE) < density
    mask |= torch.eye(m, dtype=torch.bool, device=DEVICE)
    return BlockSelection.from_mask(mask, block, block, n)


def attention_errors(q, k, v, sel, out, blocks, rows) -> float:
    """Max abs error of `out` against fp32 over the same kept blocks at `rows`."""
    from rbs_bench.bench.attention import sparse_reference_rows

    ref = sparse_reference_rows(q, k, v, sel, blocks, rows)
    return float((out[:, :, rows].float() - ref).abs().max())


def time_attention(
    rows: Rows, family, n, pattern, q, k, v, sel, density, cudnn_tf, t_end,
    configs=ATTENTION_CONFIGS,
):  # fmt: skip
    """Check and time each attention configuration on one selection; the fastest's tag."""
    from rbs_bench.bench.attention import _rows, causal_flops, do_bench, sample_blocks
    from rbs_bench.kernels import block_sparse_attn as bsa

    flops = density * causal_flops(n, q.shape[1], q.shape[3])
    blocks = sample_blocks(n, 128, 4, seed=1)
    rr = _rows(blocks, 128, n, q.device)
    lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
    best = None
    for cfg in configs:
        if time.monotonic() > t_end:
            print("time budget spent: attention configurations", file=sys.stderr)
            break
        run = lambda c=cfg: bsa._launch(q, k, v, *lists, None, False, None, as_config(c))
        try:
            out = run()
            err = attention_errors(q, k, v, sel, out, blocks, rr)
            ms = do_bench(run, 100)
        except Exception as e:  # a configuration this GPU or triton cannot build
            print(f"{tag(cfg)}: failed ({type(e).__name__}: {str(e)[:300]})", file=sys.stderr)
            continue
        tf = flops / ms / 1e9
        rows.add(
            kind="attention", inputs=family, n=n, pattern=pattern, config=tag(cfg), ms=ms,
            eff_tflops=tf, pct_cudnn=tf / cudnn_tf, density=density, err_vs_fp32=err,
        )  # fmt: skip
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best


def time_selectors(rows: Rows, family, n, q, k, selector, t_end, attention_ms=None, cudnn_ms=None):
    """Check each selector variant against the default and time it (statistics included); with
    the tuned attention's and dense cuDNN's times, each variant's sum with the attention, its
    share of that sum and the sum's speedup over cuDNN (the goals' three numbers)."""
    from rbs_bench.bench.attention import do_bench
    from rbs_bench.kernels.block_stats import block_stats, rescue_beta
    from rbs_bench.kernels.rbs_select import _launch

    bs = selector.block_size
    forced = (selector.sink_blocks, selector.window_blocks, selector.last_q_blocks)
    alphas = (selector.alpha_base, selector.alpha_rescue)

    def select(kw, stats=None):
        c, r = block_stats(k, bs)
        u = r * rescue_beta(r)
        return _launch(q, c, u, bs, *alphas, *forced, None, "both", stats=stats, **kw)

    want = select({})
    density = selector.select(q, k).density()  # every variant selects these same blocks
    time_methods(rows, family, n, q, k, selector, density)
    for name, kw in SELECTOR_CONFIGS.items():
        if time.monotonic() > t_end:
            print("time budget spent: selector variants", file=sys.stderr)
            break
        try:
            stats = torch.zeros(3, dtype=torch.int64, device=DEVICE)
            got = select(kw, stats)
            ms = do_bench(lambda kw=kw: select(kw), 100)
        except Exception as e:
            print(f"selector {name}: failed ({type(e).__name__}: {str(e)[:300]})", file=sys.stderr)
            continue
        cand, exact, bounded = stats.tolist()
        totals = {}
        if attention_ms is not None:
            total = ms + attention_ms
            totals = dict(total_ms=total, share=ms / total)
            if cudnn_ms is not None:
                totals["x_cudnn"] = cudnn_ms / total
        rows.add(
            kind="selector", inputs=family, n=n, pattern=RBS.name, config=name, ms=ms,
            differ_counts=int((got[0] != want[0]).sum()),
            differ_blocks=int((got[1] != want[1]).sum()), exact_share=exact / max(cand, 1),
            bound_share=bounded / max(cand, 1),
            density=density, **totals,
        )  # fmt: skip


def rivals() -> list[str]:
    """The methods `time_methods` races RBS's selection against: every other compared method
    (`methods.compared`), in table order."""
    from rbs_bench import methods

    return [name for name in methods.compared() if name != RBS.name]


def time_methods(rows: Rows, family, n, q, k, selector, density: float) -> None:
    """Each method's whole `select` on the same q and k (`kind=method`): RBS's as calibrated
    (`density`: its measured density), and each of `rivals()` calibrated to it (input checks,
    block statistics, scoring and compaction included, as a layer calls it), with its ms over
    RBS's.
    A rival that fails (no knob value reaches the density) is reported and skipped."""
    from rbs_bench.bench.attention import calibrate, do_bench

    base = do_bench(lambda: selector.select(q, k), 100)
    rows.add(kind="method", inputs=family, n=n, pattern=RBS.name, config=RBS.name, ms=base,
             density=density, x_rbs=1.0)  # fmt: skip
    for name in rivals():
        try:
            rival, got = calibrate(name, q, k, density, tol=5e-4)
            ms = do_bench(lambda rival=rival: rival.select(q, k), 100)
        except Exception as e:
            print(f"method {name}: failed ({type(e).__name__}: {str(e)[:300]})", file=sys.stderr)
            continue
        rows.add(kind="method", inputs=family, n=n, pattern=name, config=name, ms=ms,
                 density=got, x_rbs=ms / base)  # fmt: skip


def tuned_attention_ms(q, k, v, sel) -> float:
    """The autotuned attention kernel on this selection (what a run pays), tuned first."""
    from rbs_bench.bench.attention import do_bench
    from rbs_bench.kernels import block_sparse_attn as bsa

    lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
    run = lambda: bsa.block_sparse_attention(q, k, v, *lists)  # noqa: E731
    run()
    return do_bench(run, 100)


def dense_ms(q, k, v, names=("sdpa_cudnn",)) -> dict:
    from rbs_bench.bench.attention import dense_fns, do_bench

    fns = dense_fns(q, k, v)
    return {name: do_bench(fns[name], 100) for name in names}


def errors(rows: Rows, family, n, q, k, v, sel, configs):
    """Sparse output errors (each config) against fp32 over the kept blocks, next to dense
    SDPA's against fp32 dense and PyTorch's bf16 SDPA over the same blocks (24 query blocks)."""
    from rbs_bench.bench.attention import (
        dense_errors,
        dense_fns,
        error_stats,
        sample_blocks,
        sparse_references,
    )
    from rbs_bench.kernels import block_sparse_attn as bsa

    blocks = sample_blocks(n, 128, 24, seed=0)
    dense = dense_errors(q, k, v, dense_fns(q, k, v), blocks, 128)
    ref, shared = sparse_references(q, k, v, sel, dense)
    lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
    for cfg in configs:
        out = bsa._launch(q, k, v, *lists, None, False, None, as_config(cfg))
        err, rel = error_stats(out[:, :, dense.rows], ref)
        rows.add(
            kind="errors", inputs=family, n=n, pattern=RBS.name, config=tag(cfg), err_sparse=err,
            err_sparse_rel=rel, **{k: v for k, v in shared.items() if k != "err_blocks"},
        )  # fmt: skip


def cmd_time(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out / "variants.csv")
    t_end = time.monotonic() + args.budget_s
    props = torch.cuda.get_device_properties(0)
    import triton

    env = dict(
        gpu=torch.cuda.get_device_name(), sms=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, cuda=torch.version.cuda,
    )  # fmt: skip
    (out / "env.json").write_text(json.dumps(env, indent=1))
    print(env, flush=True)
    best = {}
    for family, n in [(f, n) for n in args.lengths for f in args.inputs]:
        if time.monotonic() > t_end:
            break
        q, k, v, selector, sel, density = setup(family, n)
        dense = dense_ms(q, k, v, ("sdpa_fa2", "sdpa_cudnn") if n == LONG else ("sdpa_cudnn",))
        flops = 4.0 * SHAPE["heads"] * SHAPE["head_dim"] * n * (n + 1) / 2
        cudnn_tf = flops / dense["sdpa_cudnn"] / 1e9
        for name, ms in dense.items():
            rows.add(kind=DENSE, inputs=family, n=n, pattern=name, config=name, ms=ms,
                     eff_tflops=flops / ms / 1e9)  # fmt: skip
        if "attention" in args.parts:
            b = time_attention(rows, family, n, RBS.name, q, k, v, sel, density, cudnn_tf, t_end)
            if b is not None:
                best[f"{family}-{n}"] = (tag(b[0]), b[1], list(b[0]))
        if "selector" in args.parts:
            att_ms = tuned_attention_ms(q, k, v, sel)
            rows.add(kind="tuned", inputs=family, n=n, pattern=RBS.name, config="autotuned",
                     ms=att_ms, eff_tflops=density * flops / att_ms / 1e9)  # fmt: skip
            time_selectors(rows, family, n, q, k, selector, t_end, att_ms, dense["sdpa_cudnn"])
        first = family == args.inputs[0]
        if "attention" in args.parts and n == LONG and first and time.monotonic() < t_end:
            rnd = random_selection(n, SHAPE["heads"], density, seed=3)
            dens = rnd.density()
            time_attention(rows, family, n, "random", q, k, v, rnd, dens, cudnn_tf, t_end)
        if n == LONG and "attention" in args.parts and time.monotonic() < t_end:
            b = best.get(f"{family}-{n}")
            cfgs = list(dict.fromkeys([ATTENTION_CONFIGS[0]] + ([tuple(b[2])] if b else [])))
            errors(rows, family, n, q, k, v, sel, cfgs)
        (out / "best.json").write_text(json.dumps(best, indent=1))
        del q, k, v, sel
        torch.cuda.empty_cache()
    summary(rows)
    return 0


def summary(rows: Rows) -> None:
    import pandas as pd

    df = pd.DataFrame(rows.rows)
    if df.empty:
        return
    pd.set_option("display.width", 200)
    for kind, cols in (
        ("attention", ["ms", "eff_tflops", "pct_cudnn", "err_vs_fp32"]),
        ("selector", ["ms", "exact_share", "differ_counts"]),
    ):
        sub = df[df["kind"] == kind]
        if sub.empty:
            continue
        print(f"\n{kind}:")
        print(sub.pivot_table(index="config", columns=["inputs", "n", "pattern"], values=cols[0]))
        if kind == "attention":
            print(
                sub.pivot_table(index="config", columns=["inputs", "n", "pattern"], values=cols[2])
            )
            continue
        print("differing counts (rows whose kept count differs from the default's):")
        print(sub.pivot_table(index="config", columns=["inputs", "n"], values=cols[2]))
        if "share" in sub:
            print("share of selector + tuned attention; speedup of that sum over SDPA-cuDNN")
            print("(goals at 128K: selector <= 2.0 ms, share <= 0.12, speedup >= 15):")
            both = sub.pivot_table(index="config", columns=["inputs", "n"], values="share")
            print(
                both.round(3).astype(str)
                + " / x"
                + sub.pivot_table(index="config", columns=["inputs", "n"], values="x_cudnn")
                .round(2)
                .astype(str)
            )
    race = df[df["kind"] == "method"]
    if not race.empty:
        print("\neach method's whole selection at RBS's density (ms; x_rbs: its ms over RBS's):")
        print(race[["inputs", "n", "pattern", "density", "ms", "x_rbs"]].to_string(index=False))
    err = df[df["kind"] == "errors"]
    if not err.empty:
        print("\nerrors at 128K:")
        print(err.drop(columns=["kind", "pattern"]).to_string())


def cmd_profile(args) -> int:
    """Launches between cudaProfilerStart/Stop (for ncu), each after a warm-up outside them.

    Default: the previous and the fastest attention configuration and two selector variants at
    128K. --tuned: at each of --lengths, the autotuned attention kernel (what the benchmark
    runs) and the default selector, on RBS's selection at 5%.
    """
    from rbs_bench.kernels import block_sparse_attn as bsa
    from rbs_bench.kernels.block_stats import block_stats, rescue_beta
    from rbs_bench.kernels.rbs_select import _launch

    if args.tuned:
        for n in args.lengths:
            q, k, v, selector, sel, _ = setup(args.inputs[0], n)
            lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
            bsa.block_sparse_attention(q, k, v, *lists)  # tunes, outside the profiled range
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            bsa.block_sparse_attention(q, k, v, *lists)
            selector.select(q, k)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled N={n}: tuned attention and the default selector", flush=True)
        return 0
    best_path = Path(args.out) / "best.json"
    best = json.loads(best_path.read_text()) if best_path.exists() else {}
    key = f"{args.inputs[0]}-{LONG}"
    cfgs = [ATTENTION_CONFIGS[0]] + ([tuple(best[key][2])] if key in best else [])
    cfgs = list(dict.fromkeys(cfgs))
    q, k, v, selector, sel, _ = setup(args.inputs[0], LONG)
    lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
    forced = (selector.sink_blocks, selector.window_blocks, selector.last_q_blocks)
    alphas = (selector.alpha_base, selector.alpha_rescue)
    c, r = block_stats(k, 128)
    u = r * rescue_beta(r)
    kws = [SELECTOR_CONFIGS["fast"], SELECTOR_CONFIGS["two-pass"]]
    for cfg in cfgs:  # compile and warm up outside the profiled range
        bsa._launch(q, k, v, *lists, None, False, None, as_config(cfg))
    for kw in kws:
        _launch(q, c, u, 128, *alphas, *forced, None, "both", **kw)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for cfg in cfgs:
        bsa._launch(q, k, v, *lists, None, False, None, as_config(cfg))
    for kw in kws:
        _launch(q, c, u, 128, *alphas, *forced, None, "both", **kw)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", [tag(c) for c in cfgs], ["fast", "two-pass"])
    return 0


# The kernels whose configurations depend on the architecture (kernel_arch): the others run the
# same code under RBS_KERNEL_ARCH=sm80. All of tests/kernels took more than 198 s on an H100.
ARCH_TESTS = (
    "tests/kernels/test_block_sparse_attn_triton.py",
    "tests/kernels/test_fp8_gemm.py",
    "tests/kernels/test_kernel_arch.py",
)
PROGRESS = {".": "passed", "F": "failed", "s": "skipped", "E": "error"}


def counts_from_pytest_log(log: str) -> dict:
    """pytest -q's counts: from its summary line, or, for a run stopped before it (a timeout),
    from its progress characters (one per test: . F s E, x X counted as skipped)."""
    import re

    summary = {k: re.search(rf"(\d+) {k}", log) for k in PROGRESS.values()}
    if any(summary.values()):
        return {k: int(m.group(1)) if m else 0 for k, m in summary.items()}
    counts = dict.fromkeys(PROGRESS.values(), 0)
    for line in log.splitlines():
        marks = re.sub(r"\s*\[\s*\d+%\]\s*$", "", line)
        if marks and set(marks) <= set(".FsExX"):
            for c in marks:
                counts[PROGRESS.get(c, "skipped")] += 1
    return counts


def arch_tests(rows: Rows, out: Path, tests: list[str], timeout_s: float) -> None:
    """The gpu-marked tests with RBS_KERNEL_ARCH=sm80, in a fresh Python; one row."""
    import os
    import subprocess

    from rbs_bench.kernels.triton_util import ARCH_ENV

    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *tests]
    env = dict(os.environ, **{ARCH_ENV: "sm80"})
    start = time.monotonic()
    try:
        res = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1.0)
        )
        log, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:  # its partial output comes as bytes
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        log, rc = f"{partial or ''}\ntimed out after {timeout_s:.0f} s", -1
    (out / "arch_tests.log").write_text(log)
    counts = counts_from_pytest_log(log)
    rows.add(
        kind="tests", inputs="-", n=0, pattern=f"{ARCH_ENV}=sm80", config=" ".join(tests), rc=rc,
        seconds=time.monotonic() - start, **counts,
    )  # fmt: skip
    print("\n".join(str(log).strip().splitlines()[-15:]), flush=True)


def time_spaces(rows: Rows, family, n, q, k, v, sel, density, cudnn_tf) -> None:
    """The autotuned attention kernel over each tuning space, checked against fp32."""
    from rbs_bench.bench.attention import _rows, causal_flops, do_bench, sample_blocks
    from rbs_bench.kernels import block_sparse_attn as bsa

    flops = density * causal_flops(n, q.shape[1], q.shape[3])
    blocks = sample_blocks(n, 128, 4, seed=1)
    rr = _rows(blocks, 128, n, q.device)
    lists = (sel.kv_count, sel.kv_indices, sel.block_q, sel.block_k)
    tma = bsa._tma_ok(k, v)  # this process runs with the GPU's own architecture
    for name, space in (("hopper", bsa.HOPPER_SPACE), ("sm80", bsa.SM80_SPACE)):
        run = lambda space=space: bsa._launch(q, k, v, *lists, None, False, None, space=space)
        try:
            out = run()  # tunes at this length
            err = attention_errors(q, k, v, sel, out, blocks, rr)
            ms = do_bench(run, 100)
            usable = tuple(c for c in space if tma or not c[5]) or bsa.POINTER_SPACE
            tuned = bsa._tuned_kernel(sel.block_q, sel.block_k, usable)
            chosen = str(getattr(tuned, "best_config", ""))
        except Exception as e:
            print(f"space {name}: failed ({type(e).__name__}: {str(e)[:300]})", file=sys.stderr)
            rows.add(kind="space", inputs=family, n=n, pattern=RBS.name, config=name,
                     error=f"{type(e).__name__}: {str(e)[:200]}")  # fmt: skip
            continue
        tf = flops / ms / 1e9
        rows.add(
            kind="space", inputs=family, n=n, pattern=RBS.name, config=name, ms=ms, eff_tflops=tf,
            pct_cudnn=tf / cudnn_tf, density=density, err_vs_fp32=err, chosen=chosen,
        )  # fmt: skip


def cmd_arch(args) -> int:
    """The Ampere tuning space on this GPU: the kernel tests with it forced, then its times
    beside the Hopper space's (module docstring)."""
    import os

    from rbs_bench.kernels import block_sparse_attn as bsa
    from rbs_bench.kernels.triton_util import ARCH_ENV, kernel_arch

    os.environ.pop(ARCH_ENV, None)  # this process times both spaces; the tests force sm80
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out / "arch.csv", resume=True)
    done = {
        (r["kind"], r["inputs"], int(r["n"])) for r in rows.rows if r["kind"] in ("tests", "done")
    }
    t_end = time.monotonic() + args.budget_s
    import triton

    env = dict(
        gpu=torch.cuda.get_device_name(), arch=kernel_arch(), torch=torch.__version__,
        triton=triton.__version__,
    )  # fmt: skip
    (out / "arch_env.json").write_text(json.dumps(env, indent=1))
    print(env, flush=True)
    if ("tests", "-", 0) not in done and args.tests:
        arch_tests(rows, out, args.tests, t_end - time.monotonic())
    for family, n in [(f, n) for n in args.lengths for f in args.inputs]:
        if ("done", family, n) in done:
            continue
        if time.monotonic() > t_end:
            print(f"time budget spent; rerun to continue ({rows.path})", flush=True)
            break
        q, k, v, _selector, sel, density = setup(family, n)
        dense = dense_ms(q, k, v)
        flops = 4.0 * SHAPE["heads"] * SHAPE["head_dim"] * n * (n + 1) / 2
        cudnn_tf = flops / dense["sdpa_cudnn"] / 1e9
        rows.add(kind=DENSE, inputs=family, n=n, pattern="sdpa_cudnn", config="sdpa_cudnn",
                 ms=dense["sdpa_cudnn"], eff_tflops=cudnn_tf)  # fmt: skip
        time_spaces(rows, family, n, q, k, v, sel, density, cudnn_tf)
        time_attention(
            rows, family, n, RBS.name, q, k, v, sel, density, cudnn_tf, t_end, bsa.SM80_SPACE
        )
        rows.add(kind="done", inputs=family, n=n, pattern="-", config="-")
        del q, k, v, sel
        torch.cuda.empty_cache()
    arch_summary(rows)
    failed = [r for r in rows.rows if r["kind"] == "tests" and (r["rc"] != 0)]
    return 1 if failed else 0


def arch_summary(rows: Rows) -> None:
    import pandas as pd

    df = pd.DataFrame(rows.rows)
    if df.empty:
        return
    pd.set_option("display.width", 200)
    tests = df[df["kind"] == "tests"]
    for _, r in tests.iterrows():
        print(
            f"\ngpu tests with {r['pattern']}: rc {r['rc']}, {r['passed']} passed, "
            f"{r['failed']} failed, {r['skipped']} skipped, {r['error']} errors "
            f"({r['seconds']:.0f} s; arch_tests.log)"
        )
    spaces = df[df["kind"] == "space"]
    if not spaces.empty and "ms" in spaces:
        print("\nautotuned attention, ms (pct of cuDNN):")
        table = spaces.pivot_table(index=["inputs", "n"], columns="config", values="ms")
        pct = spaces.pivot_table(index=["inputs", "n"], columns="config", values="pct_cudnn")
        print(table.round(3).astype(str) + " (" + (100 * pct).round(1).astype(str) + "%)")
    att = df[df["kind"] == "attention"]
    if not att.empty:
        print("\nAmpere configurations, ms:")
        print(att.pivot_table(index="config", columns=["inputs", "n"], values="ms").round(3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="time", choices=["time", "profile", "arch"])
    ap.add_argument("--out", default="variants_out")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 65536, 32768])
    ap.add_argument(
        "--tests", nargs="*", default=list(ARCH_TESTS),
        help="arch: the test paths run with RBS_KERNEL_ARCH=sm80 (none: skip them)",
    )  # fmt: skip
    ap.add_argument("--inputs", nargs="+", default=["synthetic", "needles"])
    ap.add_argument(
        "--tuned", action="store_true", help="profile: the autotuned kernel at each length"
    )
    ap.add_argument(
        "--parts", nargs="+", default=["attention", "selector"], choices=["attention", "selector"],
        help="time: the attention configurations, the selector variants, or both",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the kernel variants need a CUDA device", file=sys.stderr)
        return 2
    if args.mode == "arch":
        return cmd_arch(args)
    return cmd_time(args) if args.mode == "time" else cmd_profile(args)


if __name__ == "__main__":
    sys.exit(main())
