"""The timed model of a TTFT run: a clock, an attention function and a selector wrapper that
report to it, and the model they are installed in.

On CUDA the model is a shipped architecture (`--model qwen3_30b_a3b`, the real model's config.json
in `rbs_bench/models/architectures/`; or `--model qwen3_32b`, the dense 64-layer model with YaRN to
128K) with random weights and `--layers` decoder layers, bf16; on a CPU the embedded tiny Qwen3
(`rbs_bench.models.tiny`, fp32); or a checkpoint directory loaded through `from_pretrained`
(`--checkpoint`). Timing needs no trained weights: a prefill's cost depends on the shapes and on
how many blocks each method keeps, and calibration fixes the latter on this input. Feed-forward
blocks run over `--ffn-chunk-tokens` tokens at a time (`rbs_bench.models.feedforward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from rbs_bench.bench.ttft_setup import (
    ARCH_OVERRIDES,
    MODEL_DTYPES,
    Settings,
    checkpoint_fields,
    context_overrides,
    full_depth,
)
from rbs_bench.models.hf_attention import attention_modules, rbs_attention_forward

MiB = 2**20
TIMED_IMPL = "rbs_timed"  # our attention function around rbs_sparse / SDPA, registered below
_PROBE = "_rbs_timing_probe"  # attribute on each attention module


class Clock:
    """Paired timestamps: CUDA events on a GPU (read after one synchronize), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self, device: torch.device | None = None):
        """A timestamp; on CUDA an event on `device`'s current stream (default: the current
        device), so that a span of a layer on another GPU (model.device_map=auto) is timed on
        that GPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(None if device is None else torch.cuda.current_stream(device))
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)

    def sync(self) -> None:
        if self.cuda:  # every GPU: a model may span several (model.device_map=auto)
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)


@dataclass
class Probe:
    """Spans of one request's prefill attention and selector calls; optionally hands each
    layer's (query, key, scale) to `on_layer` as the prefill reaches it (calibration)."""

    clock: Clock
    spans: dict[str, list] = field(default_factory=lambda: {"attention": [], "selector": []})
    on_layer: object = None

    def reset(self) -> None:
        for v in self.spans.values():
            v.clear()

    def span(self, kind: str, start, device: torch.device | None = None) -> None:
        self.spans[kind].append((start, self.clock.mark(device)))

    def totals(self) -> dict:
        """{attention_ms, selector_ms}: sums over the spans (call after the clock's sync)."""
        return {f"{k}_ms": sum(self.clock.ms(a, b) for a, b in v) for k, v in self.spans.items()}


def timed_attention_forward(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs
):
    """The `rbs_timed` attention function: `rbs_sparse` (SDPA for modules without a selector),
    with the prefill calls (Lq == Lk > 1) timed into the module's probe."""
    probe: Probe | None = getattr(module, _PROBE, None)
    if probe is None or query.shape[2] != key.shape[2] or query.shape[2] == 1:
        return rbs_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if probe.on_layer is not None:  # [B, Hq, N, D], [B, Hkv, N, D] after RoPE
        probe.on_layer(query, key, kwargs.get("scaling"))
    start = probe.clock.mark(query.device)
    out = rbs_attention_forward(module, query, key, value, attention_mask, **kwargs)
    probe.span("attention", start, query.device)
    return out


def register_timed() -> None:
    """Register `rbs_timed` with transformers (idempotent), with SDPA's mask function."""
    AttentionInterface.register(TIMED_IMPL, timed_attention_forward)
    AttentionMaskInterface.register(TIMED_IMPL, sdpa_mask)


class TimedSelector:
    """A selector whose select() calls are timed into a probe; every other attribute is the
    wrapped selector's."""

    def __init__(self, inner, probe: Probe):
        self.inner, self.probe = inner, probe

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, q: Tensor, k: Tensor, scale: float | None = None):
        start = self.probe.clock.mark(q.device)
        sel = self.inner.select(q, k, scale=scale)
        self.probe.span("selector", start, q.device)
        return sel


# ------------------------------------------------------------------------------------------------
# The model and its prompts.


@dataclass
class Loaded:
    model: torch.nn.Module
    probe: Probe
    device: torch.device
    description: str  # states random weights and the layer count
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_mib: float


def build_model(s: Settings, overrides: dict | None = None) -> Loaded:
    """The random-weight model of `s` on its device, with `rbs_timed` attention and a probe on
    every attention module. `overrides` change config fields (tests shrink the MoE with it)."""
    from rbs_bench.models import rehearsal, tiny

    register_timed()
    torch.manual_seed(s.seed)
    if s.checkpoint is not None:
        return _finish_loaded(s, *_load_checkpoint(s, overrides), s.dtype)
    dtype = getattr(torch, MODEL_DTYPES[s.model])
    if s.model != "tiny":
        fields = {"num_hidden_layers": s.layers, **ARCH_OVERRIDES.get(s.model, {})}
        cfg = rehearsal.architecture_config(s.model, **fields, **(overrides or {}))
        model = rehearsal.build(cfg, s.device, dtype, s.seed, "sdpa")
        shape = f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads of {cfg.head_dim}"
        if getattr(cfg, "num_experts", 0):
            kind = f"MoE (hidden {cfg.hidden_size}, {shape}, {cfg.num_experts} experts top-"
            kind += f"{cfg.num_experts_per_tok})"
        else:
            kind = f"dense (hidden {cfg.hidden_size}, {shape}, MLP {cfg.intermediate_size})"
        name = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "qwen3_32b": "Qwen3-32B"}[s.model]
        what = (
            f"{name}-shaped {kind}, random weights, {s.layers} of {full_depth(s.model)} "
            "layers, bf16"
        )
    else:
        cfg = tiny.tiny_config(num_hidden_layers=s.layers, **(overrides or {}))
        model = tiny.build_model(cfg).to(s.device)
        what = f"tiny Qwen3 (rbs_bench.models.tiny), random weights, {s.layers} layers, fp32"
    return _finish_loaded(s, model, cfg, what, MODEL_DTYPES[s.model])


def _load_checkpoint(s: Settings, overrides: dict | None):
    """(model, text config, description) of `s.checkpoint`, loaded through from_pretrained as a
    hub id is (FP8 weights through transformers' FP8 integration), onto the run's device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"num_hidden_layers": s.layers, **context_overrides(s.model), **(overrides or {})}
    config = AutoConfig.from_pretrained(s.checkpoint, **fields)
    if s.dtype == "fp8":  # transformers' FP8 layers: the project's FP8 GEMMs where needed
        from rbs_bench.models import fp8

        fp8.prepare(config, s.device)
    device_map = s.device_map or (str(s.device) if s.device.type == "cuda" else None)
    model = AutoModelForCausalLM.from_pretrained(
        s.checkpoint, config=config, dtype="auto", attn_implementation="sdpa",
        device_map=device_map,
    )  # fmt: skip
    text = config.get_text_config()
    what = (
        f"{s.model} from the checkpoint {s.checkpoint.name} ({s.dtype} weights), "
        f"{s.layers} of {checkpoint_fields(s.checkpoint)['num_hidden_layers']} layers"
    )
    if s.device_map is not None:
        what += f", over {len(gpus(model))} GPUs (device_map={s.device_map})"
        return model, text, what
    return model.to(s.device), text, what


def _finish_loaded(s: Settings, model, cfg, what: str, dtype: str) -> Loaded:
    """The harness's settings on a built or loaded model: compiled layers, feed-forward chunks,
    the timed attention with a probe on every attention module."""
    from rbs_bench.models import fastpath
    from rbs_bench.models.feedforward import chunk_feedforward

    fastpath.install(model, s.compile)
    chunk_feedforward(model, s.ffn_chunk_tokens)
    model.eval()
    model.set_attn_implementation(TIMED_IMPL)
    probe = Probe(Clock(s.device))
    for m in attention_modules(model):
        setattr(m, _PROBE, probe)
    if s.device.type == "cuda":
        Clock(s.device).sync()
        weights = sum(map(torch.cuda.memory_allocated, gpus(model))) / MiB
    else:
        weights = tensor_bytes([*model.parameters(), *model.buffers()]) / MiB
    return Loaded(
        model,
        probe,
        s.device,
        what,
        dtype,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        weights,
    )


def prompts(s: Settings, n: int, vocab: int) -> Tensor:
    """int64 [max batch, n] on the host: seeded random token ids; batch b uses the first b rows."""
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + n)
    return torch.randint(0, vocab, (max(s.batches), n), generator=g)


def sdpa_context(backend: str):
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(names[backend])


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a list, or in a dataclass's fields."""
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return sum(t.numel() * t.element_size() for t in obj if isinstance(t, Tensor))


def peak_mib(device: torch.device) -> float:
    """The busiest GPU's peak allocation since the last reset, MiB (0 on a CPU)."""
    if device.type != "cuda":
        return 0.0
    return max(map(torch.cuda.max_memory_allocated, gpus())) / MiB


def gpus(model=None) -> list[int]:
    """The GPUs a model's parameters are on (every visible GPU without a model)."""
    if model is None:
        return list(range(torch.cuda.device_count()))
    return sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})


def release(device: torch.device) -> None:
    """Drop what the last step left (a CUDA cache grows between methods otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
