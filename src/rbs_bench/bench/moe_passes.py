"""The FP8 experts' row passes over a small grid of launch settings, at one prompt length.

The block-FP8 experts (`kernels/fp8_moe.py`) spend, besides their two products, three passes over
their rows: pass 1 (each token quantised once and stored at its rows, `scatter_quant`), the
gate's quantisation (pass 3) and the weighted sum (`kernels/moe_combine.py`). Each moves a known
number of bytes and does little arithmetic, so its time against those bytes says how near it
runs to the GPU's memory bandwidth. This script times each pass with the kernels' module
settings (rows or tokens per program, warps) set to each point of a small grid, on
Qwen3-30B-A3B's shape (hidden 2048, 768 per expert, 128 experts, top 8), checks that every
setting writes exactly the bytes of the default setting (the settings only tile the work), and
writes one CSV row per pass and setting with its milliseconds, GB/s and time against the
default's.

    python -m rbs_bench.bench.moe_passes [--tokens 131072] [--out results/speed]

On a CPU (for the tests) it runs the kernels under TRITON_INTERPRET=1 on a few tokens and times
with `perf_counter`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import sys
from pathlib import Path

import torch

from rbs_bench.bench.roofline import timed_ms
from rbs_bench.paths import speed_dir

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8

# (pass, module, {setting: values}); the first value of each setting is the kernels' default
GRID = [
    ("scatter_quant", "fp8_moe", {"SCATTER_ROWS": [4, 2, 8, 16], "SCATTER_WARPS": [4, 8]}),
    ("gated_quant", "fp8_moe", {"GATED_ROWS": [32, 16, 64, 128], "GATED_WARPS": [4, 8]}),
    (
        "combine",
        "moe_combine",
        {
            "COMBINE_TOKENS": [8, 16, 32],
            "COMBINE_WIDTH": [1024, 512, 2048],
            "COMBINE_WARPS": [8, 4],
        },
    ),
]


@contextlib.contextmanager
def settings(module, values: dict):
    """The kernel module's launch settings set to `values` inside the block, restored after."""
    old = {name: getattr(module, name) for name in values}
    for name, v in values.items():
        setattr(module, name, v)
    try:
        yield
    finally:
        for name, v in old.items():
            setattr(module, name, v)


def inputs(tokens: int, device) -> dict:
    """Each pass's inputs at `tokens` tokens routed top-8 of 128 uniformly (seeded)."""
    from rbs_bench.kernels import fp8_moe

    gen = torch.Generator(device=device).manual_seed(tokens)
    scores, index = torch.rand(tokens, EXPERTS, generator=gen, device=device).topk(TOP_K)
    layout = fp8_moe.expert_rows(index, EXPERTS)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(dtype)
    rows = layout.rows
    return {
        "layout": layout,
        "x": x,
        "h": torch.randn(rows, 2 * INTER, generator=gen, device=device).to(dtype),
        "y": torch.randn(rows, HIDDEN, generator=gen, device=device).to(dtype),
        "w": torch.softmax(scores, -1).to(dtype),
    }


def runner(name: str, a: dict):
    """(the pass as a call, the bytes it reads and writes)."""
    from rbs_bench.kernels import fp8_moe, moe_combine

    n, rows = a["x"].shape[0], a["layout"].rows
    groups, inter_groups = HIDDEN // 128, INTER // 128
    act = a["x"].element_size()
    if name == "scatter_quant":
        moved = n * HIDDEN * act + n * TOP_K * (HIDDEN + 4 * groups)
        return (lambda: fp8_moe.scatter_quant(a["x"], a["layout"], True)), moved
    if name == "gated_quant":
        moved = rows * 2 * INTER * act + rows * (INTER + 4 * inter_groups)
        return (lambda: fp8_moe.gated_quant(a["h"], a["layout"], True)), moved
    moved = n * TOP_K * HIDDEN * act + n * HIDDEN * act
    return (lambda: moe_combine._launch(a["y"], a["layout"].pos, a["w"])), moved


def _same(got, want) -> bool:
    """Exactly the same bytes (e4m3 compared as bytes)."""
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    view = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    return all(torch.equal(view(g), view(w)) for g, w in zip(got, want, strict=True))


def sweep(tokens: int, device, repeats: int, only: list[str] | None = None):
    """One row per pass and setting of `GRID` (the default setting first), yielded as each is
    timed (every setting compiles its own kernel, a second or two on a GPU)."""
    from rbs_bench.kernels import fp8_moe, moe_combine

    modules = {"fp8_moe": fp8_moe, "moe_combine": moe_combine}
    a = inputs(tokens, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for name, module_name, grid in GRID:
        if only and name not in only:
            continue
        module = modules[module_name]
        fn, moved = runner(name, a)
        want, base_ms = None, None
        for point in itertools.product(*grid.values()):
            values = dict(zip(grid, point, strict=True))
            with settings(module, values):
                out = fn()
                want = out if want is None else want
                ms = timed_ms(fn, repeats=repeats, cuda=device.type == "cuda")
            base_ms = ms if base_ms is None else base_ms
            yield {
                "gpu": gpu, "tokens": tokens, "pass": name,
                "setting": " ".join(f"{k}={v}" for k, v in values.items()),
                "default": point == tuple(v[0] for v in grid.values()),
                "ms": round(ms, 4), "gb_per_s": round(moved / ms / 1e6, 1),
                "x_default": round(ms / base_ms, 3), "same_bytes": _same(out, want),
                "bytes_moved": moved,
            }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per setting")
    ap.add_argument("--passes", nargs="+", choices=[g[0] for g in GRID], help="default: all")
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from rbs_bench.kernels.triton_util import INTERPRET

        if not INTERPRET:
            print("moe_passes: no GPU; set TRITON_INTERPRET=1 to run the kernels on the CPU")
            return 2
    from rbs_bench.scale import gpu_slug

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"moe_passes_{gpu_slug(gpu)}.csv"
    print("pass | setting | ms | GB/s | x default | same bytes", flush=True)
    ok, best = True, {}  # best: each pass's fastest row so far
    with path.open("w", newline="") as f:  # each row written as it is timed
        w = None
        for r in sweep(args.tokens, device, args.repeats, args.passes):
            if w is None:
                w = csv.DictWriter(f, fieldnames=list(r))
                w.writeheader()
            w.writerow(r)
            f.flush()
            if r["pass"] not in best or r["ms"] < best[r["pass"]]["ms"]:
                best[r["pass"]] = r
            ok = ok and r["same_bytes"]
            print(f"{r['pass']} | {r['setting']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
                  f"{r['x_default']:.2f} | {r['same_bytes']}", flush=True)  # fmt: skip
    for name, r in best.items():
        print(f"fastest {name}: {r['setting']} ({r['ms']} ms, {r['x_default']}x default)")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
