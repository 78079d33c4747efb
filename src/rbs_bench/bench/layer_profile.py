"""Where a decoder layer's prefill time goes: kernel families, beside the layer's GEMM-only time.

    python -m rbs_bench.bench.layer_profile                       # Qwen3-30B-A3B shape, 128K
    python -m rbs_bench.bench.layer_profile --model qwen3_32b --context 65536 --paths eager
    python -m rbs_bench.bench.layer_profile --checkpoint /tmp/rbs-checkpoints/qwen3_30b_a3b_fp8 \
        --model qwen3_30b_a3b_fp8 --paths compiled --ffn-chunk-tokens 0

For each path (`eager`: transformers' own layer forward; `compiled`: the regions outside attention
compiled, `rbs_bench.models.fastpath`) it builds the random-weight model of `bench.ttft` with
`--layers` decoder layers, warms it up, and profiles one dense prefill (KV cache on, the last
position's logits, as a request's prefill runs) with `torch.profiler`. Every CUDA kernel is put in
a family by its name: attention (SDPA / cuDNN / FlashAttention / the project's attention kernels),
gemm (cuBLAS, CUTLASS, grouped GEMMs, Triton matmuls), fused (Triton kernels that inductor
generated), elementwise, reduce, copy, index (gathers, scatters), sort, fill, other. The layer's
time is the sum of CUDA-event spans around each decoder layer's forward (the embedding, the final
norm and the LM head fall outside them).

The roofline reference is the layer's GEMMs alone: each attention projection on [N, hidden]
inputs, the router, and the experts' grouped GEMMs with the N x top-k rows spread evenly over
the experts (a dense MLP: its three projections), timed with CUDA events on the layer's own
weights. `outside attention` = layer time - attention kernels; the goals are at most 40 ms per
layer and at most 1.5x the GEMM time.

Writes `<out>/layer_profile_<gpu>.csv` (one row per path and family, plus `layer`, `outside
attention` and `gemm_reference` rows; a rerun replaces the rows of the same model, context and
path) and prints the table. CUDA only.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from rbs_bench.bench.roofline import gemm_reference_ms
from rbs_bench.config import TimingCfg, UserError
from rbs_bench.methods import DENSE
from rbs_bench.records import write_atomic

PATHS = ("eager", "compiled")
# kernel family by name, first match wins (attention before gemm: attention kernels use wgmma too)
FAMILIES = (
    ("selector", r"_rbs_|block_stats|rescue_beta|_select|_score|_prep|_estimate|_pool"),
    ("attention", r"fmha|flash|sdpa|attention|attn|_block_sparse|cudnn"),
    # the FP8 activation passes, the stores of the experts' quantised rows among them
    # (kernels/fp8_gemm.py, fp8_moe.py)
    ("quantise", r"quant"),
    ("gemm", r"^triton_tem|gemm|gemv|cutlass|nvjet|xmma|matmul|cublas|s16816|wgmma|fp8"),
    ("fused", r"^triton_"),  # inductor's generated kernels (after its GEMM templates)
    ("sort", r"sort|radix|cub::"),
    ("index", r"index|gather|scatter|take|put_|embedding"),
    ("copy", r"copy|cat|memcpy|transpose|contiguous"),
    ("fill", r"fill|memset|zero"),
    ("reduce", r"reduce|softmax|topk|norm|sum|mean"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)
GOAL_MS, GOAL_RATIO = 40.0, 1.5
RANDOM_MODELS = ("qwen3_30b_a3b", "qwen3_32b")


def family(kernel: str) -> str:
    name = kernel.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def _layer_spans(model) -> tuple[list, list]:
    """Hooks that record a CUDA event before and after every decoder layer's forward."""
    from rbs_bench.models.fastpath import decoder_layers

    spans, handles = [], []
    for layer in decoder_layers(model):

        def pre(_m, _args):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            spans.append([e, None])

        def post(_m, _args, _out):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            spans[-1][1] = e

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return spans, handles


def profile_path(model, ids: torch.Tensor, layers: int, selector=None):
    """({family: [ms, kernel count, {kernel: ms}]} per layer, layer ms, the prefill's peak MiB
    beyond the weights) of one prefill, with `selector` installed (None: dense SDPA)."""
    from torch.profiler import ProfilerActivity, profile

    from rbs_bench.models.hf_attention import install, uninstall

    spans, handles = _layer_spans(model)
    if selector is not None:
        install(model, selector).timing = False  # no host syncs inside the prefill
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm: compile, autotune
            torch.cuda.synchronize()
            spans.clear()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - held) / 2**20
    finally:
        for h in handles:
            h.remove()
        if selector is not None:
            uninstall(model)
    layer_ms = sum(a.elapsed_time(b) for a, b in spans) / layers
    fams: dict = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.time_range.elapsed_us() / 1e3 / layers
        f = fams.setdefault(family(evt.name), [0.0, 0, {}])
        f[0] += ms
        f[1] += 1 / layers
        f[2][evt.name] = f[2].get(evt.name, 0.0) + ms
    return fams, layer_ms, peak_mib


def rows_for(path: str, fams: dict, layer_ms: float, gemm_ms: float, common: dict) -> list:
    total = sum(v[0] for v in fams.values())
    out = []
    for fam, (ms, count, kernels) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
        out.append(
            common
            | {
                "path": path,
                "family": fam,
                "ms_per_layer": round(ms, 3),
                "share": round(ms / total, 4) if total else 0.0,
                "kernels_per_layer": round(count, 1),
                "top_kernels": "; ".join(f"{k[:80]} {v:.2f}" for k, v in top),
            }
        )
    attention = fams.get("attention", [0.0])[0] + fams.get("selector", [0.0])[0]
    outside = layer_ms - attention
    out.append(common | {"path": path, "family": "layer", "ms_per_layer": round(layer_ms, 3)})
    out.append(
        common
        | {
            "path": path,
            "family": "outside attention",
            "ms_per_layer": round(outside, 3),
            "share": round(outside / layer_ms, 4) if layer_ms else 0.0,
            "x_gemm": round(outside / gemm_ms, 3) if gemm_ms else None,
        }
    )
    return out


def run(args) -> pd.DataFrame:
    from rbs_bench.bench import ttft_model, ttft_setup
    from rbs_bench.bench.attention import gpu_tag
    from rbs_bench.models.fastpath import decoder_layers

    if not torch.cuda.is_available():
        raise UserError("bench.layer_profile needs a CUDA device")
    csv = Path(args.out) / f"layer_profile_{gpu_tag()}.csv"
    from rbs_bench import methods

    selector = None
    if args.method != methods.DENSE:
        selector = methods.build(args.method)
        if args.knob is not None:
            selector = selector.with_knob(args.knob)
    if args.checkpoint is None and (args.model or "qwen3_30b_a3b") not in RANDOM_MODELS:
        raise UserError(
            f"--model {args.model}: valid without --checkpoint: {', '.join(RANDOM_MODELS)}"
        )
    tc = TimingCfg(
        model=args.model or (None if args.checkpoint else "qwen3_30b_a3b"),
        checkpoint=str(args.checkpoint) if args.checkpoint else None,
        layers=args.layers,
        contexts=[args.context],
        ffn_chunk_tokens=args.ffn_chunk_tokens,
        methods=[DENSE],
    )
    rows: list[dict] = []
    for path in args.paths:
        tc.compile = path == "compiled"
        s = ttft_setup.resolve(tc, "cuda", out=Path(args.out), progress=False)
        t0 = time.perf_counter()
        lm = ttft_model.build_model(s)
        ids = ttft_model.prompts(s, args.context, lm.vocab)[:1].to(lm.device)
        common = {
            "gpu": torch.cuda.get_device_name(),
            "model": s.model,
            "model_desc": lm.description,
            "n": args.context,
            "layers": s.layers,
            "ffn_chunk_tokens": s.ffn_chunk_tokens or 0,
            "method": args.method,
            "knob": args.knob,
            "torch": torch.__version__,
            "run": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        fams, layer_ms, peak_mib = profile_path(lm.model, ids, s.layers, selector)
        common["prefill_peak_mib"] = round(peak_mib, 1)
        gemm_ms, parts = gemm_reference_ms(decoder_layers(lm.model)[0], args.context)
        rows += rows_for(path, fams, layer_ms, gemm_ms, common)
        rows.append(
            common
            | {
                "path": path,
                "family": "gemm_reference",
                "ms_per_layer": round(gemm_ms, 3),
                "top_kernels": "; ".join(f"{k} {v:.2f}" for k, v in parts.items()),
            }
        )
        print(f"layer_profile: {path} done in {time.perf_counter() - t0:.0f} s", flush=True)
        del lm
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if csv.exists():
        old = pd.read_csv(csv)
        key = ["model", "n", "path", "method", "ffn_chunk_tokens"]
        old = old.assign(method=old.get("method", DENSE)).fillna({"method": DENSE})
        mine = set(df[key].itertuples(index=False, name=None))
        same = [tuple(r) in mine for r in old[key].itertuples(index=False, name=None)]
        df = pd.concat([old[[not x for x in same]], df], ignore_index=True)
    csv.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(csv, df.to_csv(index=False))
    print(f"wrote {csv}")
    return df


def summary(df: pd.DataFrame, n: int) -> str:
    keep = df[df["n"] == n]
    lines = ["| model | method | chunk | path | family | ms per layer | share | x GEMM | top |"]
    lines.append("|---|---|---:|---|---|---:|---:|---:|---|")
    for _, r in keep.iterrows():
        x = r.get("x_gemm")
        share = r.get("share")
        lines.append(
            f"| {r['model']} | {r['method']} | {r['ffn_chunk_tokens']} | {r['path']} | "
            f"{r['family']} | {r['ms_per_layer']:.2f} | "
            f"{'' if pd.isna(share) else f'{share:.0%}'} | {'' if pd.isna(x) else f'{x:.2f}'} | "
            f"{'' if pd.isna(r.get('top_kernels')) else str(r['top_kernels'])[:120]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        help="qwen3_30b_a3b (default) or qwen3_32b; with --checkpoint, the name of its rows",
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        help="a checkpoint directory (e.g. the FP8 one rbs_bench.models.rehearsal writes), its "
        "first --layers layers loaded through from_pretrained instead of a random model",
    )
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--ffn-chunk-tokens", type=int, default=TimingCfg().ffn_chunk_tokens)
    ap.add_argument("--method", default=DENSE, help="the attention method profiled (dense)")
    ap.add_argument("--knob", type=float, help="the method's knob (default: its own setting)")
    ap.add_argument("--out", type=Path, default=Path("results/speed"))
    args = ap.parse_args(argv)
    from rbs_bench.models.memory import use_expandable_segments

    use_expandable_segments()
    try:
        df = run(args)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    print(summary(df, args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
