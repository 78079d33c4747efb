"""Check and time the block-mass kernel (the oracle's and the attention recall's dense pass).

    python -m rbs_bench.bench.block_mass                     # checks, then 32K, 64K, 128K
    python -m rbs_bench.bench.block_mass --lengths 131072 --time-budget-s 120

Checks (`kind=check`): `kernels.block_mass.block_mass` against the fp32 reference
(`block_mass_ref`) on the same rounded bf16 or fp16 inputs, over awkward shapes (N not a multiple
of the block, a block size that is not a power of two, GQA, D = 128) and several seeds. The
tolerance comes from the problem itself: twice the error of the same computation held in the
input dtype (logits and probabilities rounded to bf16 / fp16, block sums in fp32: what a
low-precision attention computation of these inputs can be expected to get wrong), plus 1e-6 per
token of a block. Both the kernel and the fp32 reference are also compared with an fp64
computation, and each query block's row must sum to its token count. `kept_block_mass` (the
recall pass: each row's mass on its kept blocks) is held to the same rule on a seeded random
selection (each row's diagonal and a tenth of the blocks before it).

Times (`kind=time`), Qwen3-30B-A3B's attention shape (32 query heads, 4 KV heads, D = 128, bf16,
blocks of 128) on `rbs_bench.synthetic` inputs, `triton.testing.do_bench` medians in one process:
the kernel, and its first version that masks every key block (`split=False`); dense causal SDPA
(FlashAttention and cuDNN backends, K/V expanded once outside the timed region) on the same
inputs, and the ratios; the oracle's whole selection (kernel and top fraction) and one
attention-recall pass over an RBS selection, as each layer of a run pays them (`kept_block_mass`;
and the block mass on the selection's mask, the first version). Both the kernel
and dense attention do two N x N / 2 x D products, so equal FLOP/s would mean equal time.
Rows `kind=recall_minference`: the recall pass of a token pattern (MInference's `kept_mass`), its
time and peak workspace at the same lengths, on the fused kernel (kernels/pattern_mass.py, the
default on CUDA) and on the chunked PyTorch pass (`_chunked` columns; rows from before the kernel
have only `ms_recall_pass`, then the chunked pass).

Writes results/speed/block_mass_<gpu>.csv after every row; a rerun skips the rows already there.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from rbs_bench.errors import positive_seconds
from rbs_bench.kernels.block_mass import block_mass, block_mass_ref, kept_block_mass
from rbs_bench.kernels.block_sparse_attn import block_lists_from_mask
from rbs_bench.paths import speed_dir

# (n, block, query heads, KV heads, head dim, seeds): awkward shapes first, then one long one
CASES = [
    (1000, 128, 8, 2, 128, (0, 1, 2)),  # N not a multiple of the block
    (4097, 128, 32, 4, 128, (0, 1, 2)),  # one token into a last block; the model's heads
    (2999, 64, 6, 3, 128, (0, 1, 2)),
    (777, 96, 4, 1, 128, (0, 1, 2)),  # a block size that is not a power of two
    (32768, 128, 32, 4, 128, (0,)),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL_FACTOR = 2.0  # kernel error allowed, as a multiple of the low-precision computation's error
TOL_FLOOR = 1e-6  # per token of a block: fp32 rounding of sums over a block's probabilities


def inputs(n, hq, hkv, d, seed, dtype, device="cpu") -> tuple[Tensor, Tensor]:
    """Seeded q [1, hq, n, d], k [1, hkv, n, d] rounded to `dtype`: logits of std ~1.5, a few keys
    four times longer that draw most of their rows' mass (as tests/kernels/test_block_mass.py)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g) * 1.5
    k = torch.randn(1, hkv, n, d, generator=g)
    k[:, :, :: max(1, n // 5)] *= 4
    return q.to(device, dtype), k.to(device, dtype)


def mass_in(q: Tensor, k: Tensor, block: int, dtype: torch.dtype, chunk: int = 256) -> Tensor:
    """[B, Hq, M, M] block mass with the logits and the softmax held in `dtype` (fp64: the exact
    value of these inputs; bf16 / fp16: a low-precision computation), block sums in fp32 or fp64.
    `block_mass_ref`'s algorithm, one chunk of whole query blocks at a time."""
    b, hq, n, d = q.shape
    hkv, group = k.shape[1], hq // k.shape[1]
    m = math.ceil(n / block)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    chunk = max(1, chunk // block) * block
    kf = k.to(dtype)
    keys = torch.arange(n, device=q.device)
    out = torch.zeros(b, hq, m, m, dtype=acc, device=q.device)
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        qt = q[:, :, t0:t1].to(dtype).reshape(b, hkv, group, t1 - t0, d)
        z = torch.einsum("bkgtd,bksd->bkgts", qt, kf) * (1 / math.sqrt(d))
        rows = torch.arange(t0, t1, device=q.device)
        z = z.masked_fill(keys[None, :] > rows[:, None], -math.inf)
        p = z.softmax(-1).to(acc).reshape(b, hq, t1 - t0, n)
        p = torch.nn.functional.pad(p, (0, m * block - n))
        cols = p.view(b, hq, t1 - t0, m, block).sum(-1)
        nb = math.ceil((t1 - t0) / block)
        cols = torch.nn.functional.pad(cols, (0, 0, 0, nb * block - (t1 - t0)))
        out[:, :, t0 // block : t0 // block + nb] = cols.view(b, hq, nb, block, m).sum(3)
    return out


def random_selection(b: int, h: int, m: int, seed: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(kv_count, kv_indices, mask [B, H, M, M]): each row's diagonal and ~10% of the blocks
    before it, seeded."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, h, m, m, generator=g) < 0.1) & torch.ones(m, m, dtype=torch.bool).tril()
    mask = (mask | torch.eye(m, dtype=torch.bool)).to(device)
    count, index = block_lists_from_mask(mask)
    return count, index, mask


def check_case(
    q: Tensor, k: Tensor, block: int, kernel=block_mass, kept_kernel=kept_block_mass, seed: int = 0
) -> dict:
    """Errors of `kernel` and `kept_kernel` on (q, k) and the tolerances they are held to (module
    docstring)."""
    got = kernel(q, k, block)
    ref = block_mass_ref(q, k, block)  # fp32 from the same rounded inputs
    exact = mass_in(q, k, block, torch.float64)
    lowp = mass_in(q, k, block, q.dtype)
    count, index, mask = random_selection(q.shape[0], q.shape[1], ref.shape[-1], seed, q.device)
    kept = kept_kernel(q, k, count, index, block)
    kept_ref, kept_lowp = (ref * mask).sum(-1), (lowp * mask).sum(-1)
    err_kept = float((kept - kept_ref).abs().max())
    tol_kept = TOL_FACTOR * float((kept_lowp - kept_ref).abs().max()) + TOL_FLOOR * block
    n = q.shape[2]
    rows = torch.tensor(
        [min(block, n - i * block) for i in range(got.shape[-1])], device=got.device
    ).to(got.dtype)
    err = float((got - ref).abs().max())
    err_lowp = float((lowp - ref).abs().max())
    tol = TOL_FACTOR * err_lowp + TOL_FLOOR * block
    row_err = float((got.sum(-1) - rows).abs().max())
    finite = bool(torch.isfinite(got).all())
    upper = bool((got.triu(1) == 0).all())
    ok = finite and upper and err <= tol and row_err <= tol and err_kept <= tol_kept
    return {
        "err_kernel": err,
        "err_lowp": err_lowp,
        "tol": tol,
        "err_kernel_fp64": float((got.double() - exact).abs().max()),
        "err_ref_fp64": float((ref.double() - exact).abs().max()),
        "rel_l2_kernel": float((got - ref).norm() / ref.norm()),
        "row_sum_err": row_err,
        "err_kept": err_kept,
        "tol_kept": tol_kept,
        "check": "ok" if ok else "FAIL",
    }


def check_rows(done: set, device: str = "cuda"):
    """Yield one check row per (case, dtype, seed) not in `done`."""
    for n, block, hq, hkv, d, seeds in CASES:
        for name, dtype in DTYPES.items():
            for seed in seeds:
                case = f"check_n{n}_b{block}_h{hq}x{hkv}_d{d}_{name}_s{seed}"
                if case in done:
                    continue
                q, k = inputs(n, hq, hkv, d, seed, dtype, device)
                row = {"kind": "check", "case": case, "dtype": name, "n": n, "block": block}
                row |= {"heads": hq, "kv_heads": hkv, "head_dim": d, "seed": seed}
                yield row | check_case(q, k, block, seed=seed)
                del q, k
                if device == "cuda":
                    torch.cuda.empty_cache()


def time_row(n: int, rep_ms: int, heads: int = 32, kv_heads: int = 4, d: int = 128) -> dict:
    """Kernel, dense SDPA, oracle selection and recall-pass times at context n (bf16)."""
    from rbs_bench import methods, synthetic
    from rbs_bench.bench.attention import causal_flops, dense_fns, do_bench
    from rbs_bench.methods.mass import attention_recall, forget_block_mass, true_block_mass
    from rbs_bench.methods.oracle import Oracle
    from rbs_bench.methods.rbs import RBS

    data = synthetic.generate(1, heads, kv_heads, n, d, seed=0, device="cuda", dtype=torch.bfloat16)
    q, k, v = data.q, data.k, data.v
    block_mass(q, k, 128)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = do_bench(lambda: block_mass(q, k, 128), rep_ms)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    block_mass(q, k, 128, split=False)  # the first version: every key block masked
    ms_masked = do_bench(lambda: block_mass(q, k, 128, split=False), rep_ms)
    dense = dense_fns(q, k, v)
    sdpa = {name: do_bench(dense[name], rep_ms) for name in ("sdpa_fa2", "sdpa_cudnn")}
    del dense
    oracle = Oracle(ratio=0.05, impl="triton")
    oracle.select(q, k)
    ms_select = do_bench(lambda: (forget_block_mass(), oracle.select(q, k)), rep_ms)
    rbs = methods.build(RBS.name).select(q, k)
    attention_recall(q, k, rbs)
    ms_recall = do_bench(lambda: (forget_block_mass(), attention_recall(q, k, rbs)), rep_ms)
    mask = rbs.mask()

    def recall_first():  # the first version: the whole block mass, then the mask
        forget_block_mass()
        return (true_block_mass(q, k, 128) * mask).sum((-1, -2))

    ms_recall_first = do_bench(recall_first, rep_ms)
    got, want = attention_recall(q, k, rbs), recall_first() / n
    recall_err = float((got - want).abs().max())
    forget_block_mass()
    flops = causal_flops(n, heads, d)
    return {
        "kind": "time",
        "case": f"time_n{n}",
        "dtype": "bf16",
        "n": n,
        "block": 128,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": d,
        "ms_block_mass": ms,
        "ms_sdpa_fa2": sdpa["sdpa_fa2"],
        "ms_sdpa_cudnn": sdpa["sdpa_cudnn"],
        "x_sdpa_fa2": ms / sdpa["sdpa_fa2"],
        "x_sdpa_cudnn": ms / sdpa["sdpa_cudnn"],
        "ms_block_mass_masked_all": ms_masked,
        "tflops_block_mass": flops / ms / 1e9,
        "tflops_sdpa_fa2": flops / sdpa["sdpa_fa2"] / 1e9,
        "workspace_mib": round(peak, 1),
        "ms_oracle_select": ms_select,
        "ms_recall_pass": ms_recall,
        "ms_recall_pass_block_mass": ms_recall_first,
        "recall_err_vs_block_mass": recall_err,
        "rbs_density": round(rbs.density(), 5),
    }


def recall_minference_row(n: int, heads: int = 32, kv_heads: int = 4, d: int = 128) -> dict:
    """Time and peak workspace of one recall pass over MInference's token pattern at context n,
    on the fused kernel (the default on CUDA: `ms_recall_pass`) and on the chunked PyTorch pass
    (`ms_recall_pass_chunked`), with the largest difference of their recalls (one event-timed call
    each after a warm-up: the chunked pass takes seconds at 128K)."""
    from rbs_bench import methods, synthetic
    from rbs_bench.baselines.minference import MInference, pattern_mass

    data = synthetic.generate(1, heads, kv_heads, n, d, seed=0, device="cuda", dtype=torch.bfloat16)
    q, k = data.q, data.k
    pattern = methods.build(MInference.name).select(q, k)
    short_q, short_k = q[..., :4096, :], k[..., :4096, :]  # warm-up: compile, allocate
    short = methods.build(MInference.name).select(short_q, short_k)
    row = {
        "kind": "recall_minference",
        "case": f"recall_minference_n{n}",
        "dtype": "bf16",
        "n": n,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": d,
        "minference_density": round(pattern.density(), 5),
    }
    recalls = {}
    for name, fused in (("", True), ("_chunked", False)):
        pattern_mass(short_q, short_k, None, [short], triton_path=fused)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        recalls[name] = pattern_mass(q, k, None, [pattern], triton_path=fused)[0] / n
        end.record()
        torch.cuda.synchronize()
        row[f"ms_recall_pass{name}"] = start.elapsed_time(end)
        row[f"workspace_mib{name}"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    row["recall_mean"] = float(recalls[""].mean())
    row["recall_err_vs_chunked"] = float((recalls[""] - recalls["_chunked"]).abs().max())
    return row


def print_table(rows: list[dict]) -> None:
    checks = [r for r in rows if r["kind"] == "check"]
    if checks:
        print(
            "case | err_kernel | tol | err_lowp | err_kernel_fp64 | err_ref_fp64 | row_sum_err | "
            "err_kept | tol_kept"
        )
        for r in checks:
            print(
                f"{r['case']} | {r['err_kernel']:.3g} | {r['tol']:.3g} | {r['err_lowp']:.3g} | "
                f"{r['err_kernel_fp64']:.3g} | {r['err_ref_fp64']:.3g} | {r['row_sum_err']:.3g} "
                f"| {r['err_kept']:.3g} | {r['tol_kept']:.3g} | {r['check']}"
            )
    for r in rows:
        if r["kind"] == "time":
            print(
                f"N={r['n']}: block_mass {r['ms_block_mass']:.2f} ms "
                f"({r['tflops_block_mass']:.0f} TFLOP/s), SDPA flash {r['ms_sdpa_fa2']:.2f} ms "
                f"(x{r['x_sdpa_fa2']:.2f}), cuDNN {r['ms_sdpa_cudnn']:.2f} ms "
                f"(x{r['x_sdpa_cudnn']:.2f}); all masked {r['ms_block_mass_masked_all']:.2f} ms; "
                f"oracle select {r['ms_oracle_select']:.2f} ms, "
                f"recall pass {r['ms_recall_pass']:.2f} ms (block mass and mask "
                f"{r['ms_recall_pass_block_mass']:.2f} ms); workspace {r['workspace_mib']} MiB"
            )
        if r["kind"] == "recall_minference":
            chunked = r.get("ms_recall_pass_chunked")
            both = (
                f" (chunked PyTorch {chunked:.1f} ms, {r['workspace_mib_chunked']} MiB; recall "
                f"difference {r['recall_err_vs_chunked']:.2g})"
                if isinstance(chunked, float) and chunked == chunked
                else ""
            )
            print(
                f"N={r['n']}: MInference recall pass {r['ms_recall_pass']:.1f} ms, workspace "
                f"{r['workspace_mib']} MiB{both}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768, 65536, 131072])
    ap.add_argument("--no-checks", action="store_true", help="times only")
    ap.add_argument(
        "--minference-lengths", type=int, nargs="*", default=[32768, 65536, 131072],
        help="lengths of the MInference recall-pass rows",
    )  # fmt: skip
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per timing")
    ap.add_argument(
        "--time-budget-s", type=positive_seconds, default=None, help="start no row after this"
    )
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rbs-bench: error: the block-mass benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import pandas as pd

    from rbs_bench.bench.attention import gpu_tag

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / f"block_mass_{gpu_tag()}.csv"
    rows = pd.read_csv(csv).to_dict("records") if csv.exists() else []
    done = {r["case"] for r in rows}
    gpu = torch.cuda.get_device_name()

    def late() -> bool:
        return args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s

    def add(row: dict) -> None:
        rows.append({"gpu": gpu, **row})
        pd.DataFrame(rows).to_csv(csv, index=False)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    if not args.no_checks:
        for row in check_rows(done):
            add(row)
            if late():
                break
    for n in args.lengths:
        if late():
            print(f"time budget spent; rerun to continue ({csv})")
            break
        if f"time_n{n}" not in done:
            add(time_row(n, args.rep_ms))
            torch.cuda.empty_cache()
    for n in args.minference_lengths:
        if late():
            print(f"time budget spent; rerun to continue ({csv})")
            break
        if f"recall_minference_n{n}" not in done:
            add(recall_minference_row(n))
            torch.cuda.empty_cache()
    print_table(rows)
    print(f"wrote {csv}")
    return 1 if any(r.get("check") == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
