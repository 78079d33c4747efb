"""Standalone prefill-attention benchmark: dense baselines against RBS (selector + sparse attn).

    python -m rbs_bench.bench.attention            # N in 16K..256K, both input families
    python -m rbs_bench.bench.attention --lengths 16384 65536 --targets 0.05 --inputs needles

For each input family and context length, in one process and with `triton.testing.do_bench`
medians: dense SDPA (FlashAttention-2 backend), dense SDPA (cuDNN backend), dense FlexAttention,
and each method with its knob calibrated on the input to each target density, split into
selector and sparse attention, with every named sparse executor. Speedups are ratios of times
measured in this run on this GPU.

Input families (`rbs_bench.synthetic.FAMILIES`): `synthetic` (the default structure) and
`needles` (needles with logits 40-60 matched by scattered queries, stronger columns). At the
lengths of `--error-lengths` and the target `--error-target`, each method's sparse output is also
compared with an fp32 computation over the same kept blocks, and dense SDPA's with fp32 dense
attention, on the same random query blocks: max abs error and the largest relative L2 error of
a row (`_rel`). `err_masked_sdpa` is PyTorch's own bf16 run (SDPA, memory-efficient backend)
over the same kept blocks: the error a bf16 kernel of that problem can be expected to have.

Writes results/speed/<name>_<gpu>.csv for the default family and <name>_<family>_<gpu>.csv for
the others (rewritten after each row, so a killed run keeps its rows), a speedup-vs-context plot
beside each, and prints the goal rows last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rbs_bench import methods, synthetic
from rbs_bench.budget import search_on
from rbs_bench.errors import positive_seconds
from rbs_bench.execution import EXECUTORS, execute
from rbs_bench.kernels.block_sparse_attn import block_sparse_attention_ref
from rbs_bench.kernels.flex_attn import flex_block_sparse_attention
from rbs_bench.methods.selection import BlockSelection
from rbs_bench.paths import speed_dir

DENSE = ("sdpa_fa2", "sdpa_cudnn", "flex_dense")
DEFAULT_FAMILY = "synthetic"
DEVICE = "cuda"
# The goals the benchmark reports against (rbs at 5% measured density): total speedup over the
# two SDPA backends, sparse attention's effective TFLOP/s as a share of dense cuDNN's (128K;
# 32K-64K), the selector's time at 128K and its share of the total at 64K-256K.
GOALS = {
    "speedup_vs_sdpa_fa2": 25.0,
    "speedup_vs_sdpa_cudnn": 15.0,
    "pct_cudnn_128k": 0.85,
    "pct_cudnn_32k_64k": 0.75,
    "selector_ms_128k": 2.0,
    "selector_share_64k_256k": 0.12,
}


def causal_flops(n: int, q_heads: int, head_dim: int, batch: int = 1) -> float:
    """FLOPs of dense causal attention: two matmuls over the N(N+1)/2 causal pairs."""
    return 4.0 * batch * q_heads * head_dim * n * (n + 1) / 2


def do_bench(fn, rep_ms: int = 200, long_ms: float = 400.0) -> float:
    """Median time of fn in ms: `triton.testing.do_bench`, or for a call longer than `long_ms`
    (dense attention at 256K) the median of three event-timed calls after the first."""
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    if start.elapsed_time(end) < long_ms:
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[1])


def dense_fns(q, k, v) -> dict:
    """Dense causal attention callables; K/V are expanded to the query heads once, outside the
    timed region, so every backend runs the same MHA problem."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        return run

    # Dense Flex: every causal block through the same from_kv_blocks path (create_block_mask
    # would materialise an N x N mask: 128 GiB at 128K).
    b, h, n, _ = q.shape
    full = BlockSelection.full(b, h, n, 128, q.device)
    return {
        "sdpa_fa2": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex_dense": lambda: flex_block_sparse_attention(
            q, k, v, full.kv_count, full.kv_indices, full.block_q, full.block_k
        ),
    }


def calibrate(name: str, q, k, target: float, tol: float = 0.002):
    """The selector whose knob gives `target` measured density on this input, and that density
    (`budget.search_on`: the harness's one knob search, on this one layer's q/k)."""
    return search_on(methods.build(name), q, k, target, tol)


def run_executor(q, k, v, selection, executor: str):
    """Sparse attention with the named executor. A token-level pattern (MInference's) runs its own
    executor of that name (reference, flex or triton), so each row times what it names."""
    if isinstance(selection, BlockSelection):
        return execute(q, k, v, selection, executor)
    return selection.attend(q, k, v, executor=executor)


def selector_memory(selector, q, k) -> tuple[float, float]:
    """(workspace MiB beyond the selection itself, selection MiB) of one select() call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sel = selector.select(q, k)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    tensors = [getattr(sel, f.name) for f in dataclasses.fields(sel)]  # the selection's own
    index = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return (peak - index) / 2**20, index / 2**20


def gpu_tag() -> str:
    name = torch.cuda.get_device_name()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def csv_path(out: Path, name: str, family: str, tag: str) -> Path:
    """<name>_<tag>.csv for the default family, <name>_<family>_<tag>.csv for the others."""
    stem = name if family == DEFAULT_FAMILY else f"{name}_{family}"
    return out / f"{stem}_{tag}.csv"


# ------------------------------------------------------------------------------ output errors


def sample_blocks(n: int, block: int, count: int, seed: int) -> list[int]:
    """`count` distinct query blocks drawn uniformly (seeded), ascending."""
    m = math.ceil(n / block)
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(m, generator=gen)[: min(count, m)].tolist())


def _rows(blocks: list[int], block: int, n: int, device) -> Tensor:
    return torch.cat([torch.arange(i * block, min((i + 1) * block, n)) for i in blocks]).to(device)


def dense_reference_rows(q, k, v, rows: Tensor, chunk: int = 128) -> Tensor:
    """fp32 dense causal attention output at `rows` [R]: [B, Hq, R, D] (TF32 off)."""
    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(b, hq, len(rows), d, device=q.device)
    for r0 in range(0, len(rows), chunk):
        rr = rows[r0 : r0 + chunk]
        last = int(rr.max()) + 1
        for h0 in range(0, hq, g):  # one kv head's query heads at a time
            qs = q[:, h0 : h0 + g, rr].float()  # [B, g, R, D]
            ks = k[:, h0 // g, :last].float()  # [B, L, D]
            vs = v[:, h0 // g, :last].float()
            s = torch.einsum("bgrd,bld->bgrl", qs, ks) / math.sqrt(d)
            s = s.masked_fill(torch.arange(last, device=q.device) > rr[:, None], float("-inf"))
            out[:, h0 : h0 + g, r0 : r0 + len(rr)] = torch.einsum(
                "bgrl,bld->bgrd", s.softmax(-1), vs
            )
    return out


def _restrict(sel: BlockSelection, blocks: list[int]) -> BlockSelection:
    """The selection with every query block but `blocks` emptied (references compute those)."""
    keep = torch.zeros(sel.kv_count.shape[-1], dtype=torch.bool, device=sel.kv_count.device)
    keep[blocks] = True
    count = torch.where(keep, sel.kv_count, torch.zeros_like(sel.kv_count))
    return dataclasses.replace(sel, kv_count=count)


def sparse_reference_rows(q, k, v, sel: BlockSelection, blocks: list[int], rows) -> Tensor:
    """fp32 attention over the selection's kept blocks at `rows` of `blocks`: [B, Hq, R, D]."""
    part = _restrict(sel, blocks)
    qf, kf, vf = q.float(), k.float(), v.float()
    out = block_sparse_attention_ref(
        qf, kf, vf, part.kv_count, part.kv_indices, sel.block_q, sel.block_k
    )
    return out[:, :, rows]


def masked_sdpa_rows(q, k, v, sel: BlockSelection, blocks: list[int]) -> Tensor:
    """PyTorch's SDPA in q's dtype over the kept blocks (the memory-efficient backend on CUDA,
    fp32 accumulation), one query block at a time: [B, Hq, R, D] at the rows of `blocks`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    n = q.shape[2]
    kept = sel.mask()  # [B, Hq, Mq, Mk]
    backend = SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH
    outs = []
    for i in blocks:
        r0, r1 = i * sel.block_q, min((i + 1) * sel.block_q, n)
        last = r1  # keys past the block's last query are masked anyway
        mask = kept[:, :, i : i + 1]  # [B, Hq, 1, Mk]
        cols = torch.arange(last, device=q.device)
        tok = mask[..., cols // sel.block_k]  # [B, Hq, 1, L]
        tok = tok & (cols <= torch.arange(r0, r1, device=q.device)[:, None])  # [B, Hq, T, L]
        ks = k[:, :, :last].repeat_interleave(g, 1)
        vs = v[:, :, :last].repeat_interleave(g, 1)
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q[:, :, r0:r1], ks, vs, attn_mask=tok)
        outs.append(torch.where(tok.any(-1, keepdim=True), o, torch.zeros_like(o)))
    return torch.cat(outs, 2)


def error_stats(out: Tensor, ref: Tensor) -> tuple[float, float]:
    """(max abs error, max over rows of the relative L2 error ||out - ref|| / ||ref||) of out
    [..., R, D] against ref; rows whose reference is 0 (no key) count by their abs error."""
    diff = out.float() - ref
    rel = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    rel = torch.where(ref.norm(dim=-1) > 0, rel, diff.norm(dim=-1))
    return float(diff.abs().max()), float(rel.max())


@dataclasses.dataclass
class DenseErrors:
    """Dense references at sampled query blocks of one input, shared by every method's row."""

    blocks: list[int]
    rows: Tensor
    errors: dict  # column -> value


def dense_errors(q, k, v, fns: dict, blocks: list[int], block: int) -> DenseErrors:
    """fp32 dense reference at the rows of `blocks` and each SDPA backend's error against it."""
    rows = _rows(blocks, block, q.shape[2], q.device)
    ref = dense_reference_rows(q, k, v, rows)
    errors = {}
    for name in ("sdpa_fa2", "sdpa_cudnn"):
        try:
            out = fns[name]()[:, :, rows]
        except Exception as e:  # a backend this GPU or torch build lacks
            print(f"{name}: no error measurement ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        errors[f"err_dense_{name[5:]}"], errors[f"err_dense_{name[5:]}_rel"] = error_stats(out, ref)
    del ref
    return DenseErrors(blocks, rows, errors)


def sparse_references(q, k, v, sel, dense: DenseErrors) -> tuple[Tensor, dict] | None:
    """(fp32 output over the kept blocks at the sampled rows, the errors every executor's row
    shares: dense SDPA's and PyTorch's bf16 SDPA over the same blocks); None for token-level
    patterns, which have no block reference."""
    if not isinstance(sel, BlockSelection):
        return None
    ref = sparse_reference_rows(q, k, v, sel, dense.blocks, dense.rows)
    shared = dict(dense.errors, err_blocks=len(dense.blocks))
    masked = masked_sdpa_rows(q, k, v, sel, dense.blocks)
    shared["err_masked_sdpa"], shared["err_masked_sdpa_rel"] = error_stats(masked, ref)
    return ref, shared


# ---------------------------------------------------------------------------------- the run


def run(args, csvs: dict) -> dict:
    """Every family and length in turn; each family's CSV is rewritten after each row, so a
    killed run keeps its rows. Returns {family: rows}."""
    import pandas as pd

    rows = {family: [] for family in args.inputs}
    t_end = time.monotonic() + args.time_budget_s if args.time_budget_s else math.inf

    for family in args.inputs:

        def emit(row: dict, family=family) -> None:
            rows[family].append(row)
            pd.DataFrame(rows[family]).to_csv(csvs[family], index=False)

        for n in args.lengths:
            if time.monotonic() > t_end:
                print(f"time budget spent: {family} N={n} and later not run", file=sys.stderr)
                break
            bench_length(args, family, n, emit, t_end)
            torch.cuda.empty_cache()
    return rows


def bench_length(args, family: str, n: int, emit, t_end: float = math.inf) -> None:
    """Rows for one family and length: each dense baseline, then each method, target and
    executor."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    data = synthetic.generate(
        1, args.heads, args.kv_heads, n, args.head_dim, structure=synthetic.FAMILIES[family],
        seed=args.seed, device=DEVICE, dtype=dtype,
    )  # fmt: skip
    q, k, v = data.q, data.k, data.v
    if args.retune:  # this family's selections tune the kernel at this length
        retune_attention()
    flops = causal_flops(n, args.heads, args.head_dim)
    common = {
        "gpu": torch.cuda.get_device_name(),
        "inputs": family,
        "n": n,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
    }
    fns = dense_fns(q, k, v)
    dense_ms = {}
    for name, fn in fns.items():
        try:
            dense_ms[name] = do_bench(fn, args.rep_ms)
        except Exception as e:  # a backend this GPU or torch build lacks
            print(f"N={n} {name}: unavailable ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        emit(
            {
                **common,
                "method": name,
                "target": 1.0,
                "density": 1.0,
                "executor": name,
                "selector_ms": 0.0,
                "attention_ms": dense_ms[name],
                "total_ms": dense_ms[name],
                "eff_tflops": flops / dense_ms[name] / 1e9,
            }
        )
        print(
            f"{family} N={n:>6} {name:10s} {dense_ms[name]:9.3f} ms  "
            f"{flops / dense_ms[name] / 1e9:6.1f} TFLOP/s",
            flush=True,
        )
    cudnn_tflops = flops / dense_ms["sdpa_cudnn"] / 1e9 if "sdpa_cudnn" in dense_ms else None
    dense_err = None
    if n in args.error_lengths and args.error_blocks > 0:
        blocks = sample_blocks(n, 128, args.error_blocks, args.seed)
        dense_err = dense_errors(q, k, v, fns, blocks, 128)
    del fns
    torch.cuda.empty_cache()
    # the error target first: the kernel's autotuner (keyed on the length) tunes on that
    # selection; with --retune each method's first selection tunes it again
    targets = sorted(args.targets, key=lambda t: abs(t - args.error_target) > 1e-9)
    for method, target in [(m, t) for m in args.methods for t in targets]:
        if args.retune and target == targets[0]:
            retune_attention()
        if time.monotonic() > t_end:
            print(f"time budget spent: {family} N={n} {method}@{target} and later not run")
            return
        selector, density = calibrate(method, q, k, target, tol=args.tol)
        sel = selector.select(q, k)
        sel_ms = do_bench(lambda s=selector: s.select(q, k), args.rep_ms)
        workspace, index_mib = selector_memory(selector, q, k)
        refs = None
        if dense_err is not None and abs(target - args.error_target) < 1e-9:
            refs = sparse_references(q, k, v, sel, dense_err)
        for executor in args.executors:
            try:
                out = run_executor(q, k, v, sel, executor)
                attn_ms = do_bench(
                    lambda e=executor, s=sel: run_executor(q, k, v, s, e), args.rep_ms
                )
                total_ms = do_bench(
                    lambda e=executor, s=selector: run_executor(q, k, v, s.select(q, k), e),
                    args.rep_ms,
                )
            except Exception as e:
                print(f"N={n} {executor}: failed ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            eff = density * flops / attn_ms / 1e9
            row = {
                **common,
                "method": method,
                "target": target,
                "density": round(density, 5),
                "executor": executor,
                "knob": round(getattr(selector, selector.knob, float("nan")), 6),
                "selector_impl": getattr(selector, "impl", "torch"),  # auto: Triton on CUDA
                "selector_ms": sel_ms,
                "attention_ms": attn_ms,
                "total_ms": total_ms,
                "selector_share": sel_ms / total_ms,
                "eff_tflops": eff,
                "pct_cudnn": eff / cudnn_tflops if cudnn_tflops else float("nan"),
                "workspace_mib": round(workspace, 1),
                "index_mib": round(index_mib, 1),
            }
            for name, ms in dense_ms.items():
                row[f"speedup_vs_{name}"] = ms / total_ms
            if refs is not None:
                ref, shared = refs
                row.update(shared)
                row["err_sparse"], row["err_sparse_rel"] = error_stats(
                    out[:, :, dense_err.rows], ref
                )
            del out
            emit(row)
            vs = "  ".join(f"x{ms / total_ms:5.1f} {name}" for name, ms in dense_ms.items())
            err = (
                f"  err {row['err_sparse']:.4f} (rel {row['err_sparse_rel']:.2e})"
                if "err_sparse" in row
                else ""
            )
            print(
                f"{family} N={n:>6} {method}@{target:.0%} density {density:.4f} {executor:9s} "
                f"sel {sel_ms:7.3f} + attn {attn_ms:8.3f} = {total_ms:8.3f} ms "
                f"(sel {sel_ms / total_ms:4.0%}, {eff:5.0f} TFLOP/s eff, "
                f"ws {workspace:6.1f} MiB)  {vs}{err}",
                flush=True,
            )


def retune_attention() -> None:
    """Forget the Triton attention kernel's tuned configurations (the next call tunes again)."""
    from rbs_bench.kernels import block_sparse_attn

    if block_sparse_attn.HAS_TRITON:
        block_sparse_attn._tuned_kernel.cache_clear()


# ------------------------------------------------------------------------------ the goal rows


def goal_rows(df, method: str | None = None, target: float = 0.05, executor: str = "triton"):
    """The rows the goals speak of, one per (inputs, n), with each goal's verdict: speedups at
    128K, sparse attention's share of cuDNN's TFLOP/s at 128K and at 32K-64K, the selector's time
    at 128K and its share of the total at 64K-256K. `method` None: the method under study
    (`methods.headline()`).

    `met` lists the goals a row meets, `missed` those it misses, each as name=value/bound.
    """
    import pandas as pd

    method = method or methods.headline()
    sub = df[
        (df["method"] == method)
        & ((df["target"] - target).abs() < 1e-9)
        & (df["executor"] == executor)
    ]
    out = []
    for _, r in sub.sort_values(["inputs", "n"]).iterrows():
        checks = []
        n = int(r["n"])
        for col in ("speedup_vs_sdpa_fa2", "speedup_vs_sdpa_cudnn"):
            if n == 131072 and col in r and pd.notna(r[col]):
                checks.append((col[11:], r[col], GOALS[col], r[col] >= GOALS[col]))
        if 32768 <= n <= 65536 or n == 131072:
            bound = GOALS["pct_cudnn_128k" if n == 131072 else "pct_cudnn_32k_64k"]
            if pd.notna(r.get("pct_cudnn", float("nan"))):
                checks.append(("pct_cudnn", r["pct_cudnn"], bound, r["pct_cudnn"] >= bound))
        if n == 131072:
            lim = GOALS["selector_ms_128k"]
            checks.append(("selector_ms", r["selector_ms"], lim, r["selector_ms"] <= lim))
        if 65536 <= n <= 262144:
            lim = GOALS["selector_share_64k_256k"]
            share = r["selector_share"]
            checks.append(("selector_share", share, lim, share <= lim))
        fmt = [f"{name}={val:.3g}/{bound:g}" for name, val, bound, _ in checks]
        out.append(
            {
                "inputs": r["inputs"],
                "n": n,
                "density": r["density"],
                "selector_ms": r["selector_ms"],
                "attention_ms": r["attention_ms"],
                "total_ms": r["total_ms"],
                "eff_tflops": r["eff_tflops"],
                "pct_cudnn": r.get("pct_cudnn", float("nan")),
                "vs_fa2": r.get("speedup_vs_sdpa_fa2", float("nan")),
                "vs_cudnn": r.get("speedup_vs_sdpa_cudnn", float("nan")),
                "met": " ".join(f for f, c in zip(fmt, checks) if c[3]),
                "missed": " ".join(f for f, c in zip(fmt, checks) if not c[3]),
            }
        )
    return pd.DataFrame(out)


def print_goal_rows(df, method: str, target: float) -> None:
    goals = goal_rows(df, method, target)
    if goals.empty:
        print(f"no {method} rows at {target:.0%} with the triton executor: no goal rows")
        return
    print(f"\nGoal rows: {method} at {target:.0%}, triton executor")
    cols = ["inputs", "n", "density", "selector_ms", "attention_ms", "total_ms", "eff_tflops"]
    cols += ["pct_cudnn", "vs_fa2", "vs_cudnn"]
    print(" | ".join(cols) + " | missed")
    for _, r in goals.iterrows():
        cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(" | ".join(cells) + f" | {r['missed'] or '-'}")
    errs = [c for c in df.columns if c.startswith("err_") and not c.endswith("blocks")]
    if errs:
        e = df[df[errs].notna().any(axis=1)]
        print("\nErrors against fp32 (max abs / max row-relative L2); sparse and masked SDPA over")
        print("the kept blocks, dense SDPA over every key, on the same query rows:")
        for _, r in e.iterrows():
            parts = [
                f"{name[4:]} {r[name]:.4f}/{r[name + '_rel']:.1e}"
                for name in ("err_sparse", "err_masked_sdpa", "err_dense_fa2", "err_dense_cudnn")
                if name in r and name + "_rel" in r and r[name] == r[name]
            ]
            print(
                f"  {r['inputs']} N={int(r['n'])} {r['method']} {r['executor']}: "
                + "  ".join(parts)
            )


def plot(df, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = df[~df["method"].isin(DENSE)]
    targets = sorted(sparse["target"].unique())
    fig, axes = plt.subplots(
        1, len(targets), figsize=(4.2 * len(targets), 3.6), dpi=120, squeeze=False
    )
    for ax, target in zip(axes[0], targets):
        sub = sparse[sparse["target"] == target]
        best = sub.loc[sub.groupby("n")["total_ms"].idxmin()].sort_values("n")
        for name in DENSE:
            col = f"speedup_vs_{name}"
            if col in best:
                ax.plot(best["n"] / 1024, best[col], marker="o", label=f"vs {name}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (K tokens)")
        ax.set_ylabel("speedup of selector + sparse attention")
        dens = best["density"].mean()
        ax.set_title(
            f"{sub['method'].iloc[0]} at {target:.0%} target ({dens:.1%} measured)", fontsize=9
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    inputs = f", {df['inputs'].iloc[0]} inputs" if "inputs" in df else ""
    fig.suptitle(f"Prefill attention on {df['gpu'].iloc[0]}{inputs}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072, 262144])
    ap.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.02, 0.03, 0.04, 0.05, 0.10],
        help="measured-density anchors to calibrate each method to (fractions)",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        default=[methods.headline()],
        help="registered methods to calibrate and time (the plot and goal rows show the first)",
    )
    ap.add_argument(
        "--executors",
        nargs="+",
        default=["triton", "flex"],
        choices=EXECUTORS,
        help="sparse executors to time (the PyTorch reference gathers keys per query block: "
        "minutes at 128K)",
    )
    ap.add_argument(
        "--inputs",
        nargs="+",
        choices=sorted(synthetic.FAMILIES),
        default=[DEFAULT_FAMILY, "needles"],
        help="input families of rbs_bench.synthetic (default: both)",
    )
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=5e-4, help="calibration tolerance (density)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per measurement")
    ap.add_argument(
        "--error-lengths",
        type=int,
        nargs="*",
        default=[131072],
        help="lengths at which outputs are compared with fp32 (none: --error-lengths)",
    )
    ap.add_argument("--error-target", type=float, default=0.05)
    ap.add_argument(
        "--retune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tune the Triton attention kernel for each family, length and method on its own "
        "selection at --error-target (--no-retune: once per length, on the first family's)",
    )
    ap.add_argument("--error-blocks", type=int, default=24, help="random query blocks compared")
    ap.add_argument(
        "--time-budget-s",
        type=positive_seconds,
        default=None,
        help="stop starting new lengths / methods after this many seconds (default: no limit)",
    )
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    ap.add_argument("--name", default="attention", help="file stem: <name>_<gpu>.csv/.png")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the attention benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    csvs = {f: csv_path(args.out, args.name, f, gpu_tag()) for f in args.inputs}
    rows = run(args, csvs)
    for family, csv in csvs.items():
        df = pd.DataFrame(rows[family])
        if df.empty:
            continue
        plot(df[df["method"].isin([*DENSE, args.methods[0]])], csv.with_suffix(".png"))
        print(f"wrote {csv} and {csv.with_suffix('.png')}")
    all_rows = pd.DataFrame([r for f in args.inputs for r in rows[f]])
    if not all_rows.empty:
        print_goal_rows(all_rows, args.methods[0], args.error_target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
