"""Validate and time the Triton paths of flexprefill and minference against their PyTorch paths.

    python -m rbs_bench.bench.fast_paths                    # 64K and 128K, 32/4 heads, d 128, bf16
    python -m rbs_bench.bench.fast_paths --lengths 131072 --targets 0.05

One GPU call checks that the fast paths select what the references select and times both. Per
context length, on `rbs_bench.synthetic` inputs, each method's knob is calibrated (Triton path) to
each target density, then:
  flexprefill  selector time and workspace (peak device memory beyond the output lists) of
               impl=torch and impl=triton, and how many kept block pairs differ between them;
               also at tau = 1, where every head is query-aware (the heaviest case);
  minference   the same for its selector (the estimate and top-k), with the columns and
               diagonals that differ; then its executors on the Triton pattern: flex and triton
               times, and each one's max error against FlexAttention run on fp32 inputs.
`check` is "ok" when the selections differ in at most 0.1% of their kept entries (near-ties of the
estimate) and the Triton executor's error is at most twice FlexAttention's bf16 error (+1e-3).
Writes results/speed/fast_paths_<gpu>.csv (rewritten after each row) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from rbs_bench import synthetic
from rbs_bench.bench.attention import calibrate, do_bench, gpu_tag
from rbs_bench.kernels.vertical_slash_attn import membership

AGREE = 1e-3  # tolerated share of differing kept entries (ties of the estimate within rounding)


def peak_workspace_mib(fn) -> tuple[float, object]:
    """(device MiB a call allocates at its peak beyond what it returns, its result)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    kept = torch.cuda.memory_allocated() - base
    return (peak - kept) / 2**20, out


def _selector_rows(name: str, sel, q, k, common: dict, rep_ms: int) -> tuple[list[dict], dict]:
    """Time and measure impl=torch and impl=triton of one selector; their selections."""
    rows, out = [], {}
    for impl in ("torch", "triton"):
        s = dataclasses.replace(sel, impl=impl)
        s.select(q, k)  # compile / warm up
        ms = do_bench(lambda s=s: s.select(q, k), rep_ms)
        ws, out[impl] = peak_workspace_mib(lambda s=s: s.select(q, k))
        rows.append(
            {
                **common,
                "method": name,
                "stage": "selector",
                "path": impl,
                "knob": getattr(sel, sel.knob),
                "density": round(out[impl].density(), 5),
                "ms": ms,
                "workspace_mib": round(ws, 1),
            }
        )
    return rows, out


def _flexprefill(q, k, target, common, rep_ms) -> list[dict]:
    rows = []
    sel, _ = calibrate("flexprefill", q, k, target)
    for tau in (sel.tau, 1.0):
        part, out = _selector_rows(
            "flexprefill", dataclasses.replace(sel, tau=tau), q, k, common, rep_ms
        )
        got, want = out["triton"].mask(), out["torch"].mask()
        differ = int((got != want).sum())
        kept = max(1, int(want.sum()))
        for row in part:
            row.update(tau=tau, differ=differ, differ_share=differ / kept)
            row["check"] = "ok" if differ <= AGREE * kept else "MISMATCH"
        rows += part
    return rows


def _minference(q, k, v, target, common, rep_ms) -> list[dict]:
    n = q.shape[2]
    sel, _ = calibrate("minference", q, k, target)
    rows, out = _selector_rows("minference", sel, q, k, common, rep_ms)
    pat, ref = out["triton"], out["torch"]
    differ = kept = 0
    for got, want in ((pat.columns, ref.columns), (pat.diagonals, ref.diagonals)):
        differ += int((membership(got, n) ^ membership(want, n)).sum())
        kept += want.numel()
    for row in rows:
        row.update(differ=differ, differ_share=differ / max(kept, 1))
        row["check"] = "ok" if differ <= AGREE * kept else "MISMATCH"

    truth = pat.attend(q.float(), k.float(), v.float(), executor="flex")
    errors = {}
    for executor in ("flex", "triton"):
        ms = do_bench(lambda e=executor: pat.attend(q, k, v, executor=e), rep_ms)
        errors[executor] = (pat.attend(q, k, v, executor=executor).float() - truth).abs().max()
        rows.append(
            {
                **common,
                "method": "minference",
                "stage": "executor",
                "path": executor,
                "knob": getattr(sel, sel.knob),
                "density": round(pat.density(), 5),
                "ms": ms,
                "max_err_vs_fp32": float(errors[executor]),
            }
        )
    del truth
    ok = errors["triton"] <= 2 * errors["flex"] + 1e-3
    for row in rows[-2:]:
        row["check"] = "ok" if ok else "MISMATCH"
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["n", "method", "stage", "path", "tau", "density", "ms", "workspace_mib", "differ"]
    cols += ["max_err_vs_fp32", "check"]
    print(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "")
            cells.append(f"{x:.4g}" if isinstance(x, float) else str(x))
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--targets", type=float, nargs="+", default=[0.05])
    ap.add_argument("--methods", nargs="+", default=["flexprefill", "minference"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per measurement")
    ap.add_argument("--out", type=Path, default=Path("results/speed"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the fast-path check needs a CUDA device", file=sys.stderr)
        return 2
    unknown = sorted(set(args.methods) - {"flexprefill", "minference"})
    if unknown:
        print(f"rbs-bench: error: --methods takes flexprefill, minference; got {unknown}")
        return 2
    import pandas as pd
    from tqdm import tqdm

    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / f"fast_paths_{gpu_tag()}.csv"
    rows: list[dict] = []
    jobs = [(n, m, t) for n in args.lengths for m in args.methods for t in args.targets]
    data_n, data = None, None
    for n, method, target in tqdm(jobs, desc="fast paths", unit="case"):
        if data_n != n:
            data = synthetic.generate(
                1, args.heads, args.kv_heads, n, args.head_dim, seed=args.seed, device="cuda",
                dtype=torch.bfloat16,
            )  # fmt: skip
            data_n = n
        common = {"gpu": torch.cuda.get_device_name(), "n": n, "target": target}
        common.update(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
        if method == "flexprefill":
            rows += _flexprefill(data.q, data.k, target, common, args.rep_ms)
        else:
            rows += _minference(data.q, data.k, data.v, target, common, args.rep_ms)
        pd.DataFrame(rows).to_csv(csv, index=False)
        torch.cuda.empty_cache()
    print_table(rows)
    print(f"wrote {csv}")
    bad = [r for r in rows if r.get("check") == "MISMATCH"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
