"""Validate and time the methods' declared Triton selector paths against their PyTorch paths.

    python -m rbs_bench.bench.fast_paths                    # 64K and 128K, 32/4 heads, d 128, bf16
    python -m rbs_bench.bench.fast_paths --lengths 131072 --targets 0.05

The methods are those whose `MethodInfo.fast_path` is set (`--methods` picks among them), in table
order. One GPU call checks that the fast paths select what the references select and times both.
Per context length, on `rbs_bench.synthetic` inputs, each method's knob is calibrated (Triton path)
to each target density; then, for the calibrated selector and each setting of its
`FastPath.also`: selector time and workspace (peak device memory beyond the output) of
impl=torch and impl=triton, and how many kept entries differ between them (`FastPath.compare`:
block pairs by default). A method with `FastPath.executors` then has those executors of its own
`attend` timed on the Triton selection, with each one's max error against the first executor run
on fp32 inputs.
`check` is "ok" when the selections differ in at most 0.1% of their kept entries (near-ties of the
estimate) and each executor's error is at most twice the first executor's bf16 error (+1e-3).
Writes results/speed/fast_paths_<gpu>.csv (rewritten after each row) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from rbs_bench import methods, synthetic
from rbs_bench.bench.attention import calibrate, do_bench, gpu_tag
from rbs_bench.paths import speed_dir

AGREE = 1e-3  # tolerated share of differing kept entries (ties of the estimate within rounding)


def fast_path_methods() -> list[str]:
    """The methods this check covers (those with `MethodInfo.fast_path`), in table order."""
    return [m for m in methods.in_order(methods.registry()) if methods.info(m).fast_path]


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


def block_difference(got, want) -> tuple[int, int]:
    """(block pairs kept by one selection and not the other, pairs `want` keeps)."""
    got, want = got.mask(), want.mask()
    return int((got != want).sum()), int(want.sum())


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


def _executor_rows(name, sel, pattern, q, k, v, executors, common, rep_ms) -> list[dict]:
    """Time each executor of `pattern.attend`; errors against the first one run in fp32."""
    truth = pattern.attend(q.float(), k.float(), v.float(), executor=executors[0])
    rows, errors = [], {}
    for executor in executors:
        ms = do_bench(lambda e=executor: pattern.attend(q, k, v, executor=e), rep_ms)
        errors[executor] = (pattern.attend(q, k, v, executor=executor).float() - truth).abs().max()
        rows.append(
            {
                **common,
                "method": name,
                "stage": "executor",
                "path": executor,
                "knob": getattr(sel, sel.knob),
                "density": round(pattern.density(), 5),
                "ms": ms,
                "max_err_vs_fp32": float(errors[executor]),
            }
        )
    del truth
    ok = all(errors[e] <= 2 * errors[executors[0]] + 1e-3 for e in executors[1:])
    for row in rows:
        row["check"] = "ok" if ok else "MISMATCH"
    return rows


def varied_fields(names) -> list[str]:
    """The fields the `FastPath.also` settings of these methods set, in order of appearance."""
    also = (s for m in names for s in methods.info(m).fast_path.also)
    return list(dict.fromkeys(f for setting in also for f in setting))


def method_rows(name: str, q, k, v, target: float, common: dict, rep_ms: int) -> list[dict]:
    """Every row of one method at one target density, as its `MethodInfo.fast_path` asks."""
    fast = methods.info(name).fast_path
    compare = fast.compare or block_difference
    sel, _ = calibrate(name, q, k, target)
    calibrated = {f: getattr(sel, f) for f in varied_fields([name])}
    rows, pattern = [], None
    for setting in (calibrated, *fast.also):
        part, out = _selector_rows(name, dataclasses.replace(sel, **setting), q, k, common, rep_ms)
        if pattern is None and fast.executors:
            pattern = out["triton"]  # the calibrated setting's Triton selection
        differ, kept = compare(out["triton"], out["torch"])
        kept = max(kept, 1)
        for row in part:
            row.update(setting, differ=differ, differ_share=differ / kept)
            row["check"] = "ok" if differ <= AGREE * kept else "MISMATCH"
        rows += part
    if fast.executors:
        rows += _executor_rows(name, sel, pattern, q, k, v, fast.executors, common, rep_ms)
    return rows


def print_table(rows: list[dict], varied: list[str]) -> None:
    """One line per row; `varied`: the fields of the `FastPath.also` settings, after the path."""
    cols = ["n", "method", "stage", "path", *varied, "density", "ms", "workspace_mib", "differ"]
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
    choices = fast_path_methods()
    ap.add_argument("--methods", nargs="+", default=choices, help=f"among {', '.join(choices)}")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per measurement")
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods if m not in choices]
    if unknown:
        print(
            f"rbs-bench: error: --methods takes the methods with a Triton fast path "
            f"({', '.join(choices)}); got {', '.join(unknown)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("rbs-bench: error: the fast-path check needs a CUDA device", file=sys.stderr)
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
        rows += method_rows(method, data.q, data.k, data.v, target, common, args.rep_ms)
        pd.DataFrame(rows).to_csv(csv, index=False)
        torch.cuda.empty_cache()
    print_table(rows, varied_fields(args.methods))
    print(f"wrote {csv}")
    bad = [r for r in rows if r.get("check") == "MISMATCH"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
