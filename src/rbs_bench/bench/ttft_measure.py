"""What a TTFT run measures: one request (prefill to the first token on the host, then one decode
step), a method's row of timed requests, and the memory a selector and its block statistics take.

Times are in ms: CUDA events on a GPU, perf_counter on a CPU. The columns a row gets are listed in
`rbs_bench.bench.ttft_rows`.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from rbs_bench import methods
from rbs_bench.bench.gpu_clocks import ClockSampler
from rbs_bench.bench.roofline import gemm_reference_ms
from rbs_bench.bench.ttft_model import (
    TIMED_IMPL,
    Loaded,
    MiB,
    TimedSelector,
    gpus,
    release,
    sdpa_context,
    tensor_bytes,
)
from rbs_bench.bench.ttft_setup import Settings
from rbs_bench.models.hf_attention import install, uninstall


def request(lm: Loaded, ids: Tensor) -> dict:
    """One request, ids [B, N] on the host: first generated token on the host, then one decode
    step. Returns ttft_ms, decode_ms, attention_ms and selector_ms."""
    probe, clock = lm.probe, lm.probe.clock
    probe.reset()
    t0 = clock.mark()
    out = lm.model(input_ids=ids.to(lm.device), use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].argmax(-1).cpu()  # greedy: the first generated token, on the host
    t1 = clock.mark()
    step = lm.model(
        input_ids=first[:, None].to(lm.device),
        past_key_values=out.past_key_values,
        use_cache=True,
        logits_to_keep=1,
    )
    step.logits[:, -1].argmax(-1).cpu()  # the second token on the host
    t2 = clock.mark()
    clock.sync()
    return {"ttft_ms": clock.ms(t0, t1), "decode_ms": clock.ms(t1, t2), **probe.totals()}


def dense_prefill(lm: Loaded, ids: Tensor, on_layer) -> None:
    """One dense prefill of ids [1, N] without a cache, handing every layer's post-RoPE
    (query, key, scale) to `on_layer` as the prefill reaches it; nothing is kept beyond what
    `on_layer` keeps."""
    lm.probe.on_layer = on_layer
    try:
        with torch.inference_mode():
            lm.model(input_ids=ids.to(lm.device), use_cache=False, logits_to_keep=1)
    finally:
        lm.probe.on_layer = None


def cpu_peak_bytes(fn) -> tuple[object, int]:
    """fn()'s result and the most CPU bytes it held allocated at one time (torch profiler memory
    events; allocations made before the call do not count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return out, max([0, *totals])


def selector_memory(selector, q: Tensor, k: Tensor) -> tuple[float, float]:
    """(workspace MiB beyond the selection, selection MiB) of one select() on q/k."""
    if q.is_cuda:
        from rbs_bench.bench.attention import selector_memory as cuda_selector_memory

        return cuda_selector_memory(selector, q, k)
    sel, peak = cpu_peak_bytes(lambda: selector.select(q, k))
    index = tensor_bytes(sel)
    return (peak - index) / MiB, index / MiB


def block_statistics(selector, k: Tensor) -> list[tuple[str, Tensor]] | None:
    """The per-key-block summaries the method's rule reads for one layer's keys k [B, Hkv, N, D]
    (the selector's own `block_statistics`); None for a method whose estimate keeps no per-block
    key summary (e.g. strided sums or the last queries' attention)."""
    own = getattr(selector, "block_statistics", None)
    return own(k) if own is not None else None


def describe_stats(parts: list[tuple[str, Tensor]]) -> str:
    """What each key block keeps, e.g. 'centroid 128 x fp32 + radius fp32'."""
    out = []
    for name, t in parts:
        dtype = str(t.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
        width = t.shape[-1] if t.dim() == 4 else None  # [B, H, M, D] vectors, [B, H, M] scalars
        out.append(f"{name} {width} x {dtype}" if width else f"{name} {dtype}")
    return " + ".join(out)


def layer_gemm_ms(lm: Loaded, tokens: int) -> float:
    """Milliseconds of one decoder layer's GEMMs alone on `tokens` tokens (CUDA; NaN on a CPU
    or when its inputs do not fit beside the model): the roofline reference of the layer."""
    if lm.device.type != "cuda":
        return math.nan
    from rbs_bench.models.fastpath import decoder_layers

    try:
        ms, _ = gemm_reference_ms(decoder_layers(lm.model)[0], tokens)
    except torch.cuda.OutOfMemoryError:
        ms = math.nan
    release(lm.device)
    return ms


def time_row(s: Settings, lm: Loaded, ids: Tensor, name: str, fields: dict | None) -> dict:
    """Warm-up and timed requests of one method, with its calibrated selector `fields` (None for
    dense), on ids [B, N]; the row's measured columns."""
    selector = None if name == methods.DENSE else methods.build(name, **fields)
    recorder = None
    if selector is not None:
        recorder = install(lm.model, TimedSelector(selector, lm.probe), s.executor)
        recorder.timing = False  # no host syncs inside the prefill; the probe's events time it
        lm.model.set_attn_implementation(TIMED_IMPL)
    cuda = lm.device.type == "cuda"
    try:
        with torch.inference_mode(), sdpa_context(s.sdpa_backend):
            extra = None  # CPU: the request's peak allocation, from a profiled warm-up request
            for i in range(s.warmup):
                if cuda or i:
                    request(lm, ids)
                else:
                    _, extra = cpu_peak_bytes(lambda: request(lm, ids))
            release(lm.device)
            if cuda:
                for d in gpus():
                    torch.cuda.reset_peak_memory_stats(d)
            runs = []
            with ClockSampler(gpus(lm.model) if cuda else []) as clocks:
                for _ in range(s.repeats if ids.shape[0] == 1 else s.batch_repeats):
                    if recorder is not None:
                        recorder.reset()
                    runs.append(request(lm, ids))
            density = recorder.summary()["density_mean"] if recorder is not None else 1.0
            if cuda:
                # the busiest GPU (model.device_map=auto spreads the layers over several)
                peak = max(map(torch.cuda.max_memory_allocated, gpus())) / MiB
                reserved = max(map(torch.cuda.max_memory_reserved, gpus())) / MiB
            else:
                if extra is None:
                    _, extra = cpu_peak_bytes(lambda: request(lm, ids))
                peak, reserved = lm.model_mib + extra / MiB, math.nan
    finally:
        if selector is not None:
            uninstall(lm.model)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    b, n = ids.shape
    ttft = [r["ttft_ms"] for r in runs]
    return {
        "density": float(density),
        "ttft_ms": med["ttft_ms"],
        "ttft_ms_min": min(ttft),
        "ttft_ms_max": max(ttft),
        "decode_ms": med["decode_ms"],
        "attention_ms": med["attention_ms"],
        "selector_ms": med["selector_ms"],
        "sparse_attention_ms": med["attention_ms"] - med["selector_ms"],
        "prompts_per_s": b / (med["ttft_ms"] / 1e3),
        "tokens_per_s": b * n / (med["ttft_ms"] / 1e3),
        "peak_allocated_mib": peak,
        "peak_reserved_mib": reserved,
        **clocks.summary(),
    }
