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
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rbs_bench import methods, synthetic
from rbs_bench.execution import EXECUTORS, execute

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
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        return run

    n = q.shape[2]
    causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=q.device)
    flex = torch.compile(flex_attention)
    return {
        "sdpa_fa2": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex_dense": lambda: flex(q, k, v, block_mask=causal, enable_gqa=True),
    }


def calibrate(name: str, q, k, target: float, tol: float = 0.002, steps: int = 30):
    """The selector whose knob gives `target` measured density on this input (bisection)."""
    base = methods.build(name)
    lo, hi = math.log(1e-4), math.log(1e3)  # knob searched in log space
    best = None
    for _ in range(steps):
        mid = (lo + hi) / 2
        sel = base.with_knob(math.exp(mid))
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


def selector_memory(selector, q, k) -> tuple[float, float]:
    """(workspace MiB beyond the selection itself, selection MiB) of one select() call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sel = selector.select(q, k)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    index = sel.kv_count.numel() * 4 + sel.kv_indices.numel() * 4
    return (peak - index) / 2**20, index / 2**20


def gpu_tag() -> str:
    name = torch.cuda.get_device_name()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run(args) -> list[dict]:
    rows = []
    for n in args.lengths:
        rows += bench_length(args, n)
        torch.cuda.empty_cache()
    return rows


def bench_length(args, n: int) -> list[dict]:
    """Rows for one context length: each dense baseline, then RBS at each target and executor."""
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
    rows, dense_ms = [], {}
    for name, fn in dense_fns(q, k, v).items():
        try:
            dense_ms[name] = do_bench(fn, args.rep_ms)
        except Exception as e:  # a backend this GPU or torch build lacks
            print(f"N={n} {name}: unavailable ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        rows.append(
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
    for target in args.targets:
        selector, density = calibrate(args.method, q, k, target)
        sel = selector.select(q, k)
        sel_ms = do_bench(lambda s=selector: s.select(q, k), args.rep_ms)
        workspace, index_mib = selector_memory(selector, q, k)
        for executor in args.executors:
            try:
                attn_ms = do_bench(lambda e=executor, s=sel: execute(q, k, v, s, e), args.rep_ms)
                total_ms = do_bench(
                    lambda e=executor, s=selector: execute(q, k, v, s.select(q, k), e),
                    args.rep_ms,
                )
            except Exception as e:
                print(f"N={n} {executor}: failed ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            row = {
                **common,
                "method": args.method,
                "target": target,
                "density": round(density, 5),
                "executor": executor,
                "knob": round(getattr(selector, selector.knob, float("nan")), 6),
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
            rows.append(row)
            vs = "  ".join(f"x{ms / total_ms:5.1f} {name}" for name, ms in dense_ms.items())
            print(
                f"N={n:>6} {args.method}@{target:.0%} density {density:.4f} {executor:9s} "
                f"sel {sel_ms:7.3f} + attn {attn_ms:8.3f} = {total_ms:8.3f} ms "
                f"(sel {sel_ms / total_ms:4.0%}, {row['eff_tflops']:5.0f} TFLOP/s eff, "
                f"ws {workspace:6.1f} MiB)  {vs}",
                flush=True,
            )
    return rows


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
    ap.add_argument("--targets", type=float, nargs="+", default=[0.02, 0.05, 0.10])
    ap.add_argument("--method", default="rbs")
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
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the attention benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import pandas as pd

    rows = run(args)
    df = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / f"attention_{gpu_tag()}.csv"
    df.to_csv(csv, index=False)
    plot(df, csv.with_suffix(".png"))
    print(f"wrote {csv} and {csv.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
