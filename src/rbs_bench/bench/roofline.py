"""The roofline reference of a decoder layer: its GEMMs alone, timed on its own weights.

Each attention projection on [N, hidden] inputs, the router, and the experts' grouped GEMMs with
the N x top-k rows spread evenly over the experts (a dense MLP: its three projections), timed
with CUDA events. `bench.layer_profile` sets a layer's kernel families beside it, and
`bench.ttft` each row's time outside attention.
"""

from __future__ import annotations

import statistics
import time

import torch


def timed_ms(fn, warmup: int = 2, repeats: int = 5, cuda: bool = True) -> float:
    """Median milliseconds of fn() after `warmup` calls: CUDA events, or `perf_counter` where
    `cuda` is False (a CPU run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_reference_ms(layer: torch.nn.Module, n: int) -> tuple[float, dict]:
    """Milliseconds of one decoder layer's GEMMs alone at n tokens, and the parts."""
    attn, mlp = layer.self_attn, layer.mlp
    w = next(attn.parameters())
    dtype = torch.bfloat16 if w.dtype not in (torch.float16, torch.float32) else w.dtype
    parts = {}
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(attn, name)
            x = torch.randn(n, lin.in_features, device=w.device, dtype=dtype)
            parts[name] = timed_ms(lambda lin=lin, x=x: lin(x))
        experts = getattr(mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            parts.update(_expert_gemms(mlp, n, dtype))
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(mlp, name)
                x = torch.randn(n, lin.in_features, device=w.device, dtype=dtype)
                parts[name] = timed_ms(lambda lin=lin, x=x: lin(x))
    return sum(parts.values()), parts


def _expert_gemms(mlp: torch.nn.Module, n: int, dtype) -> dict:
    """The router and the experts' two grouped GEMMs, N x top-k rows spread evenly."""
    experts = mlp.experts
    e, top_k = experts.num_experts, mlp.gate.top_k
    dev = experts.gate_up_proj.device
    hidden = experts.gate_up_proj.shape[-1]
    inter = experts.down_proj.shape[-1]
    rows = n * top_k
    counts = torch.full((e,), rows // e, dtype=torch.int32, device=dev)
    counts[: rows % e] += 1
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(rows, hidden, device=dev, dtype=dtype)
    h = torch.randn(rows, inter, device=dev, dtype=dtype)
    router = torch.randn(n, hidden, device=dev, dtype=dtype)
    gate_w = mlp.gate.weight
    out = {"router": timed_ms(lambda: torch.nn.functional.linear(router, gate_w.to(dtype)))}
    if experts.gate_up_proj.dtype.itemsize == 1:  # FP8 experts: the kernel transformers calls
        from transformers.integrations import finegrained_fp8

        fp8 = finegrained_fp8.load_finegrained_fp8_kernel()
        kw = {"offsets": offs, "tokens_per_expert": counts, "block_size": experts.block_size}
        out["experts_gate_up"] = timed_ms(
            lambda: fp8.grouped_matmul(
                x, experts.gate_up_proj, experts.gate_up_proj_scale_inv, **kw
            )
        )
        out["experts_down"] = timed_ms(
            lambda: fp8.grouped_matmul(h, experts.down_proj, experts.down_proj_scale_inv, **kw)
        )
        return out
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    out["experts_gate_up"] = timed_ms(lambda: mm(x, gate_up.transpose(-2, -1), offs=offs))
    out["experts_down"] = timed_ms(lambda: mm(h, down.transpose(-2, -1), offs=offs))
    return out
