"""Standalone prefill-attention benchmark: dense baselines against RBS (selector + sparse attn).

    python -m rbs_bench.bench.attention            # N in 16K..256K on the current CUDA device
    python -m rbs_bench.bench.attention --lengths 16384 65536 --targets 0.05

For each context length, in one process and with `triton.testing.do_bench` medians:
dense SDPA (FlashAttention-2 backend), dense SDPA (cuDNN backend), dense FlexAttention, and RBS with
its knob calibrated on the input to each target density, split into selector and sparse attention,
with every available sparse executor. Speedups are ratios of times measured in this run on this GPU.
Writes results/speed/attention_<gpu>.csv and a speedup-vs-context plot beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rbs_bench import methods, synthetic
from rbs_bench.execution import EXECUTORS, execute
from rbs_bench.kernels.flex_attn import flex_block_sparse_attention
from rbs_bench.methods.selection import BlockSelection

DENSE = ("sdpa_fa2", "sdpa_cudnn", "flex_dense")


def causal_flops(n: int, q_heads: int, head_dim: int, batch: int = 1) -> float:
    """FLOPs of dense causal attention: two matmuls over the N(N+1)/2 causal pairs."""
    return 4.0 * batch * q_heads * head_dim * n * (n + 1) / 2


def do_bench(fn, rep_ms: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


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


def calibrate(name: str, q, k, target: float, tol: float = 0.002, steps: int = 30):
    """The selector whose knob gives `target` measured density on this input (bisection)."""
    base = methods.build(name)
    # Bounded knobs (coverage, fraction) are searched linearly, open-ended ones in log space.
    lo, hi = getattr(base, "knob_range", (1e-4, 1e3))
    log = lo > 0
    if log:
        lo, hi = math.log(lo), math.log(hi)
    best = None
    for _ in range(steps):
        mid = (lo + hi) / 2
        sel = base.with_knob(math.exp(mid) if log else mid)
        density = sel.select(q, k).density()
        if best is None or abs(density - target) < abs(best[1] - target):
            best = (sel, density)
        if abs(density - target) <= tol:
            break
        # knob_direction -1: a larger knob keeps fewer blocks
        too_dense = density > target
        if (too_dense and base.knob_direction < 0) or (not too_dense and base.knob_direction > 0):
            lo = mid
        else:
            hi = mid
    return best


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


def run(args, csv: Path) -> list[dict]:
    """Every length in turn; the CSV is rewritten after each row, so a killed run keeps its rows."""
    import pandas as pd

    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        pd.DataFrame(rows).to_csv(csv, index=False)

    for n in args.lengths:
        bench_length(args, n, emit)
        torch.cuda.empty_cache()
    return rows


def bench_length(args, n: int, emit) -> None:
    """Rows for one context length: each dense baseline, then each method, target and executor."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    data = synthetic.generate(
        1, args.heads, args.kv_heads, n, args.head_dim, seed=args.seed, device="cuda", dtype=dtype
    )
    q, k, v = data.q, data.k, data.v
    flops = causal_flops(n, args.heads, args.head_dim)
    common = {
        "gpu": torch.cuda.get_device_name(),
        "n": n,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
    }
    dense_ms = {}
    for name, fn in dense_fns(q, k, v).items():
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
            f"N={n:>6} {name:10s} {dense_ms[name]:9.3f} ms  "
            f"{flops / dense_ms[name] / 1e9:6.1f} TFLOP/s",
            flush=True,
        )
    torch.cuda.empty_cache()
    for method, target in [(m, t) for m in args.methods for t in args.targets]:
        selector, density = calibrate(method, q, k, target)
        sel = selector.select(q, k)
        sel_ms = do_bench(lambda s=selector: s.select(q, k), args.rep_ms)
        workspace, index_mib = selector_memory(selector, q, k)
        for executor in args.executors:
            try:
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
                "eff_tflops": density * flops / attn_ms / 1e9,
                "workspace_mib": round(workspace, 1),
                "index_mib": round(index_mib, 1),
            }
            for name, ms in dense_ms.items():
                row[f"speedup_vs_{name}"] = ms / total_ms
            emit(row)
            vs = "  ".join(f"x{ms / total_ms:5.1f} {name}" for name, ms in dense_ms.items())
            print(
                f"N={n:>6} {method}@{target:.0%} density {density:.4f} {executor:9s} "
                f"sel {sel_ms:7.3f} + attn {attn_ms:8.3f} = {total_ms:8.3f} ms "
                f"(sel {sel_ms / total_ms:4.0%}, {row['eff_tflops']:5.0f} TFLOP/s eff, "
                f"ws {workspace:6.1f} MiB)  {vs}",
                flush=True,
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
    fig.suptitle(f"Prefill attention on {df['gpu'].iloc[0]}", fontsize=10)
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
        default=["rbs"],
        help="registered methods to calibrate and time (the plot shows the first)",
    )
    ap.add_argument(
        "--executors",
        nargs="+",
        default=list(EXECUTORS),
        help=f"sparse executors to time (of {', '.join(EXECUTORS)})",
    )
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per measurement")
    ap.add_argument("--out", type=Path, default=Path("results/speed"))
    ap.add_argument("--name", default="attention", help="file stem: <name>_<gpu>.csv/.png")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the attention benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / f"{args.name}_{gpu_tag()}.csv"
    df = pd.DataFrame(run(args, csv))
    plot(df[df["method"].isin([*DENSE, args.methods[0]])], csv.with_suffix(".png"))
    print(f"wrote {csv} and {csv.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
