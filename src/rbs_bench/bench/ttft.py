"""Time to first token, prefill attention and memory of every method inside an HF model.

    python -m rbs_bench.bench.ttft                    # this device's default run (below)
    python -m rbs_bench.bench.ttft --methods dense rbs --contexts 131072 --out /tmp/ttft
    python -m rbs_bench +experiment=speed             # or memory, throughput, selector_time

Model. On CUDA, a Qwen3-30B-A3B-shaped MoE (`--model qwen3_30b_a3b`, the real model's config.json
shipped in `rbs_bench/models/architectures/`; or `--model qwen3_32b`, the dense 64-layer model with
YaRN to 128K) with random weights and `--layers` decoder layers (default 4; the full depth is 48
and 64), bf16. On a CPU, the embedded tiny Qwen3 (`rbs_bench.models.tiny`, 2 layers, fp32). Timing
needs no trained weights: a prefill's cost depends on the shapes and on how many blocks each method
keeps, and calibration fixes the latter on this input. Every table states the model and its layer
count. Feed-forward blocks run over `--ffn-chunk-tokens` tokens at a time (32768;
`rbs_bench.models.feedforward`): unchunked, the MoE's intermediates alone take 18 GiB at 128K.

Per context N (default 32K/64K/96K/128K on CUDA, 1K/2K on a CPU), largest first:
1. Calibration. Dense prefills of the seeded random prompt, each layer scored as the prefill
   reaches it and then dropped (`calibrate_methods`: every method still searching scores the
   layer at once, and `rbs_bench.budget.KnobSearch` picks its next knob from the mean over
   layers), until each method's density is within 0.002 of `--target` (5%): exact threshold
   curves settle in one prefill, the other methods' short grids in a few. A method that cannot
   reach it (at short N its forced blocks alone exceed 5%) keeps its closest density, the knob's
   sparsest end, and is flagged (`target_reached` False). The first layer's Q/K give each
   method's block statistics and selector workspace. The density that the timed prefill
   measures can differ a little: its later layers see sparse layers' outputs.
2. Timing, per method (dense first) and batch size: `--warmup` untimed requests, then `--repeats`
   timed ones (`--batch-repeats` for batches > 1); the CSV holds their median. Batches > 1 run
   after every batch-1 row, at `--batch-contexts`, with the batch-1 knob (also when read back
   from the CSV); each sequence of a batch is selected and attended on its own.

Columns (times in ms; CUDA events on a GPU, perf_counter on a CPU):
- ttft_ms: request to first generated token on the host: prompt ids to the device, prefill
  forward filling the KV cache with the LM head at the last position, greedy pick, the token
  copied back: the prefill's own forward yields the first token, as vLLM's TTFT counts it.
  decode_ms: the decode step that follows (one token through the cache), reported beside it.
- attention_ms: sum over layers of the prefill attention calls (events around the attention
  function: selector and sparse attention for a method, SDPA for dense); selector_ms: the selector
  calls inside them; sparse_attention_ms = attention_ms - selector_ms.
- density: kept / causal block pairs, mean over layers, heads and sequences of the timed prefill
  (`PrefillRecorder`); calibration_density: the same on the captured dense activations.
- peak_allocated_mib / peak_reserved_mib: torch.cuda.max_memory_allocated / max_memory_reserved
  over this method's timed requests (cache emptied and peaks reset between methods); model_mib:
  the weights. On a CPU: parameters and buffers plus the peak of one request's own allocations
  (torch profiler memory events, on the first warm-up request); there is no reserved pool.
- block_stats_mib: one layer's per-key-block summaries that the method's rule reads (centroid,
  radius, beta, min/max box, mean-pooled keys), as its implementation builds them on this device;
  empty for xattn and minference, whose estimates keep none. selector_workspace_mib: the peak of
  one select() call on one layer beyond its inputs, less the selection it returns (selection_mib).
- prompts_per_s = batch / TTFT, tokens_per_s = batch x N / TTFT; ttft_speedup and
  attention_speedup: dense's time over the method's at the same N and batch.
- outside_ms_per_layer = (ttft_ms - attention_ms) / layers: the part of the prefill outside
  attention, per layer (it also holds the embedding, the final norm, the LM head at one position
  and the token's copy to the host, which are small beside a layer). gemm_ms_per_layer (CUDA):
  the GEMMs of one decoder layer alone on the request's batch x N tokens, timed in the same run
  on the layer's own weights (`rbs_bench.bench.roofline.gemm_reference_ms`: projections,
  router, the experts' grouped GEMMs with the rows spread evenly, or a dense MLP);
  outside_x_gemm = outside_ms_per_layer / gemm_ms_per_layer, the roofline ratio an inference
  engine brings near 1.

Outputs in --out (default results/speed): ttft_<device>.csv, one row per (model, batch, N,
method, target), rewritten after each row; a rerun skips finished rows.
ttft_calibrations_<device>.jsonl: each calibration as it finishes, so a rerun of a killed run
calibrates only what it had not. speedup_<device>.png: the
three panels (standalone attention from attention_<device>.csv, prefill attention inside the
model, TTFT). With --time-budget-s the run starts no new row after that many seconds and says how
to continue.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from tqdm import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from rbs_bench import methods, paths
from rbs_bench.bench.roofline import gemm_reference_ms
from rbs_bench.budget import knob_value
from rbs_bench.config import TimingCfg
from rbs_bench.errors import UserError, positive_seconds
from rbs_bench.models.hf_attention import (
    attention_modules,
    install,
    rbs_attention_forward,
    uninstall,
)
from rbs_bench.models.memory import use_expandable_segments
from rbs_bench.paths import speed_dir, tables_dir
from rbs_bench.records import write_atomic

MiB = 2**20
TIMED_IMPL = "rbs_timed"  # our attention function around rbs_sparse / SDPA, registered below
_PROBE = "_rbs_timing_probe"  # attribute on each attention module
# tiny: the embedded tiny Qwen3; the others: a shipped architecture (rbs_bench.models.rehearsal,
# the real model's config.json) with random weights and --layers of its decoder layers.
MODELS = ("tiny", "qwen3_30b_a3b", "qwen3_32b")
SDPA_BACKENDS = ("default", "flash", "cudnn", "efficient", "math")
CALIBRATION_TOL = 0.002  # absolute density error at which the knob search stops
# Qwen3-32B reaches 128K through YaRN (conf/model/qwen3_32b.yaml); the MoE natively.
ARCH_OVERRIDES = {
    "qwen3_32b": {
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
}

# What an unset TimingCfg field means on each device.
DEVICE_DEFAULTS = {
    "cuda": {
        "model": "qwen3_30b_a3b",
        "contexts": [32768, 65536, 98304, 131072],
        "batch_contexts": [32768, 65536, 131072],  # the paper's prompt-throughput contexts
        "repeats": 3,
        "time_budget_s": 450.0,
    },
    "cpu": {
        "model": "tiny",
        "contexts": [1024, 2048],
        "batch_contexts": [1024],  # a CPU takes minutes per batch of four at 2K
        "repeats": 1,  # a CPU's timings only show that the pipeline runs
        "time_budget_s": None,
    },
}
DEFAULT_LAYERS = {"qwen3_30b_a3b": 4, "qwen3_32b": 4}  # tiny: its own 2
MODEL_DTYPES = {"qwen3_30b_a3b": "bfloat16", "qwen3_32b": "bfloat16", "tiny": "float32"}


@dataclass
class Settings:
    """A resolved timing run: every field set, checked against the device and the registry."""

    device: torch.device
    model: str  # the rows' model name: a shipped architecture, tiny, or a checkpoint's label
    layers: int
    contexts: list[int]
    batches: list[int]
    batch_contexts: list[int]
    batch_methods: list[str]
    methods: list[str]
    target: float
    warmup: int
    repeats: int
    batch_repeats: int  # timed requests of a row at batch > 1
    ffn_chunk_tokens: int | None  # feed-forward blocks over this many tokens at once (None: all)
    compile: bool  # the decoder layers' regions outside attention compiled (models.fastpath)
    executor: str
    sdpa_backend: str
    seed: int
    out: Path
    time_budget_s: float | None
    progress: bool = True
    retry_oom: bool = False
    checkpoint: Path | None = None  # a checkpoint directory loaded through from_pretrained
    device_map: str | None = None  # "auto": the checkpoint's layers over every visible GPU
    dtype: str = ""  # the rows' dtype: the weights' (fp8 for block-FP8 checkpoints)

    @property
    def tag(self) -> str:
        """The device part of the output file names: the GPU's name, or 'cpu'."""
        if self.device.type == "cuda":
            from rbs_bench.bench.attention import gpu_tag

            return gpu_tag()
        return "cpu"

    @property
    def csv(self) -> Path:
        return self.out / f"ttft_{self.tag}.csv"

    @property
    def figure(self) -> Path:
        return self.out / f"speedup_{self.tag}.png"

    @property
    def calibrations(self) -> Path:
        """Every finished calibration, one JSON line each, so that a run killed after calibrating
        (minutes at 128K) times its rows on rerun without calibrating again."""
        return self.out / f"ttft_calibrations_{self.tag}.jsonl"


def resolve(
    tc, device: str = "auto", executor: str = "auto", out: Path | None = None, progress: bool = True
) -> Settings:
    """Settings from a TimingCfg (or an object with its fields); bad values raise UserError."""
    from rbs_bench.execution import resolve_executor
    from rbs_bench.session import resolve_device

    dev = resolve_device(device)
    defaults = DEVICE_DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    pick = lambda name: defaults[name] if getattr(tc, name) is None else getattr(tc, name)
    checkpoint = Path(tc.checkpoint).expanduser() if tc.checkpoint else None
    if checkpoint is not None:
        model = tc.model or checkpoint.name
        fields = _checkpoint_fields(checkpoint) | _context_overrides(model)
        depth, limit = fields["num_hidden_layers"], fields.get("max_position_embeddings", 1 << 30)
        layers = depth if tc.layers is None else tc.layers
        dtype = _checkpoint_dtype(fields)
    else:
        model = pick("model")
        if model not in MODELS:
            raise UserError(f"timing.model={model!r}; valid: {', '.join(MODELS)}")
        if model != "tiny" and dev.type != "cuda":
            raise UserError(
                f"timing.model={model} needs a CUDA device (its 32K-128K prompts would take "
                "hours on a CPU); use timing.model=tiny"
            )
        layers = tc.layers if tc.layers is not None else DEFAULT_LAYERS.get(model, _tiny_layers())
        depth = _full_depth(model) if model != "tiny" else 64
        limit, dtype = _max_positions(model), MODEL_DTYPES[model]
    if not 1 <= layers <= depth:
        raise UserError(f"timing.layers={layers}; use 1-{depth}")
    contexts = sorted({int(n) for n in pick("contexts")}, reverse=True)
    bad = [n for n in contexts if not 1 < n <= limit]
    if bad:
        raise UserError(f"timing.contexts {bad} outside 2-{limit} tokens for model {model}")
    batches = sorted({int(b) for b in tc.batches})
    if not batches or batches[0] < 1:
        raise UserError(f"timing.batches={list(tc.batches)}; batch sizes must be >= 1")
    names = list(dict.fromkeys(tc.methods))
    batch_names = list(dict.fromkeys(tc.batch_methods)) if tc.batch_methods is not None else names
    for name in names + batch_names:
        try:
            methods.method_class(name)
        except methods.UnknownMethodError as e:
            raise UserError(str(e)) from None
    if not 0 < tc.target <= 1:
        raise UserError(f"timing.target={tc.target}; a measured density in (0, 1], e.g. 0.05")
    repeats = pick("repeats")
    batch_repeats = repeats if tc.batch_repeats is None else tc.batch_repeats
    if tc.warmup < 0 or repeats < 1 or batch_repeats < 1:
        raise UserError(
            f"timing.warmup={tc.warmup}, repeats={repeats}, batch_repeats={batch_repeats}: "
            "need warmup >= 0 and repeats >= 1"
        )
    chunk = tc.ffn_chunk_tokens or None
    if chunk is not None and chunk < 1:
        raise UserError(f"timing.ffn_chunk_tokens={chunk}: a positive number, or 0 for unchunked")
    if tc.sdpa_backend not in SDPA_BACKENDS:
        raise UserError(
            f"timing.sdpa_backend={tc.sdpa_backend!r}; valid: {', '.join(SDPA_BACKENDS)}"
        )
    try:
        resolve_executor(executor, dev)
    except ValueError as e:
        raise UserError(str(e)) from None
    from rbs_bench.models import fastpath

    batch_contexts = pick("batch_contexts")
    batch_contexts = contexts if batch_contexts is None else [int(n) for n in batch_contexts]
    return Settings(
        device=dev,
        model=model,
        layers=int(layers),
        contexts=contexts,
        batches=batches,
        batch_contexts=[n for n in contexts if n in batch_contexts],
        batch_methods=[m for m in names if m in batch_names],
        methods=names,
        target=float(tc.target),
        warmup=int(tc.warmup),
        repeats=int(repeats),
        batch_repeats=int(batch_repeats),
        ffn_chunk_tokens=chunk,
        compile=fastpath.enabled(tc.compile, dev),
        executor=executor,
        sdpa_backend=tc.sdpa_backend,
        seed=int(tc.seed),
        out=Path(out if out is not None else "results/speed"),
        time_budget_s=pick("time_budget_s"),
        progress=progress,
        retry_oom=bool(tc.retry_oom),
        checkpoint=checkpoint,
        dtype=dtype,
        device_map=_device_map(tc, checkpoint, dev),
    )


def _device_map(tc, checkpoint: Path | None, dev: torch.device) -> str | None:
    wanted = getattr(tc, "device_map", None)
    if wanted is None:
        return None
    if wanted != "auto" or checkpoint is None or dev.type != "cuda":
        raise UserError(
            f"timing.device_map={wanted!r}: only auto, for a --checkpoint on CUDA (it spreads "
            "the checkpoint's layers over every visible GPU)"
        )
    return wanted


def _context_overrides(model: str) -> dict:
    """The harness's context overrides (YaRN to 128K for Qwen3-32B) of a checkpoint's model, as
    its conf/model config gives them to runs (the hub's Qwen3-32B config stops at 40,960)."""
    from rbs_bench.models.rehearsal import architecture_of

    return dict(ARCH_OVERRIDES.get(architecture_of(model) or "", {}))


def _checkpoint_fields(path: Path) -> dict:
    """The text-model fields of a checkpoint directory's config.json (one line if unreadable)."""
    cfg = path / "config.json"
    try:
        fields = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"timing.checkpoint={path}: cannot read {cfg} ({e})") from None
    text = fields.get("text_config", fields)
    if "num_hidden_layers" not in text:
        raise UserError(f"timing.checkpoint={path}: {cfg} has no num_hidden_layers")
    return {**text, "quantization_config": fields.get("quantization_config")}


def _checkpoint_dtype(fields: dict) -> str:
    """fp8 for block-FP8 weights, else the checkpoint's own dtype (bfloat16, ...)."""
    quant = fields.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        return "fp8"
    return str(fields.get("dtype") or fields.get("torch_dtype") or "bfloat16")


def _tiny_layers() -> int:
    from rbs_bench.models.tiny import TINY_CONFIG

    return TINY_CONFIG["num_hidden_layers"]


def _arch(model: str) -> dict:
    """The config.json fields of a shipped architecture, with the harness's context overrides."""
    from rbs_bench.models.rehearsal import architecture_fields

    return {**architecture_fields(model), **ARCH_OVERRIDES.get(model, {})}


def _full_depth(model: str) -> int:
    return _arch(model)["num_hidden_layers"]


def _max_positions(model: str) -> int:
    from rbs_bench.models.tiny import TINY_CONFIG

    cfg = TINY_CONFIG if model == "tiny" else _arch(model)
    return cfg["max_position_embeddings"]


# ------------------------------------------------------------------------------------------------
# Timing inside the model: a clock, and an attention function and selector that report to it.


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
            f"{name}-shaped {kind}, random weights, {s.layers} of {_full_depth(s.model)} "
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

    fields = {"num_hidden_layers": s.layers, **_context_overrides(s.model), **(overrides or {})}
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
        f"{s.layers} of {_checkpoint_fields(s.checkpoint)['num_hidden_layers']} layers"
    )
    if s.device_map is not None:
        what += f", over {len(_gpus(model))} GPUs (device_map={s.device_map})"
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
        weights = sum(map(torch.cuda.memory_allocated, _gpus(model))) / MiB
    else:
        weights = _tensor_bytes([*model.parameters(), *model.buffers()]) / MiB
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


# ------------------------------------------------------------------------------------------------
# Measurements.


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


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in a list, or in a dataclass's fields."""
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return sum(t.numel() * t.element_size() for t in obj if isinstance(t, Tensor))


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
    index = _tensor_bytes(sel)
    return (peak - index) / MiB, index / MiB


def block_statistics(selector, k: Tensor) -> list[tuple[str, Tensor]] | None:
    """The per-key-block summaries the method's rule reads for one layer's keys k [B, Hkv, N, D]
    (the selector's own `block_statistics`); None for a method whose estimate keeps no per-block
    key summary (e.g. strided sums or the last queries' attention)."""
    own = getattr(selector, "block_statistics", None)
    return own(k) if own is not None else None


def throughput_methods() -> list[str]:
    """The methods the prompt-throughput table compares at batch > 1 (MethodInfo.throughput)."""
    return [m for m in methods.in_order(methods.registry()) if methods.info(m).throughput]


def describe_stats(parts: list[tuple[str, Tensor]]) -> str:
    """What each key block keeps, e.g. 'centroid 128 x fp32 + radius fp32'."""
    out = []
    for name, t in parts:
        dtype = str(t.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
        width = t.shape[-1] if t.dim() == 4 else None  # [B, H, M, D] vectors, [B, H, M] scalars
        out.append(f"{name} {width} x {dtype}" if width else f"{name} {dtype}")
    return " + ".join(out)


@dataclass
class Calibrated:
    """One method at one context: its selector fields and what calibration and the capture gave."""

    fields: dict
    knob: float | None
    calibration_density: float
    target_reached: bool
    block_stats_mib: float | None = None
    block_stats: str | None = None
    selector_workspace_mib: float | None = None
    selection_mib: float | None = None


def calibrate_methods(
    s: Settings, lm: Loaded, ids: Tensor, names: list[str], measure: set[str]
) -> dict[str, Calibrated]:
    """Each method in `names` calibrated to the target on one prompt's dense prefill; for those
    in `measure`, block statistics and selector workspace on the first layer.

    Every step is one dense prefill in which each layer is scored as it runs, for all methods
    still searching at once (`budget.LayerCurves`), and each method's `budget.KnobSearch` takes
    its next knob from the mean over layers; no layer's Q/K outlives its layer, except the first
    layer's, which the workspace measures need. A method that cannot reach the target (at short
    N its forced blocks alone exceed it) ends at its closest density and is flagged."""
    from rbs_bench.budget import KnobSearch, LayerCurves

    searches = {
        m: KnobSearch(methods.build(m), s.target, CALIBRATION_TOL, closest=True) for m in names
    }
    first: list = []
    while pending := [m for m, search in searches.items() if not search.done]:
        curves = LayerCurves({m: (searches[m].base, searches[m].values) for m in pending})
        failed: dict[str, Exception] = {}
        keep = first if measure and not first else None
        on_layer = functools.partial(_score_layer, curves, pending, failed, keep)
        try:
            dense_prefill(lm, ids, on_layer)
        finally:
            _release(lm.device)
        for m in pending:
            search = searches[m]
            if m in failed:
                e = failed[m]
                tqdm.write(f"ttft: calibrating {m}: {type(e).__name__}: {e}", file=sys.stderr)
                del searches[m]
                continue
            curve = curves.mean(m)
            search.update([curve[search.values.index(search.knob)]], curve)
    out = {}
    try:
        for name, search in searches.items():
            res = search.result()
            selector = search.base.with_knob(res["knob"])
            cal = Calibrated(
                fields=selector.fields(),
                knob=knob_value(selector),
                calibration_density=res["density_mean"],
                target_reached=search.reached and res["abs_error"] <= CALIBRATION_TOL,
            )
            if name in measure and first:
                _measure(cal, selector, *first[0])
            out[name] = cal
    finally:
        first.clear()
        _release(lm.device)
    return out


def _score_layer(curves, names: list[str], failed: dict, keep: list | None, q, k, scale) -> None:
    """One layer of a calibration prefill: each method's density curve on it (a method that
    fails, e.g. out of memory, is set aside with its error); the first layer's q/k go to `keep`."""
    if keep is not None and not keep:
        keep.append((q, k))
    for m in names:
        if m in failed:
            continue
        try:
            curves.add_one(m, q, k, scale)
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # that method's rows fail, not the run
            failed[m] = e
    curves.next_layer()


def _measure(cal: Calibrated, selector, q: Tensor, k: Tensor) -> None:
    """Block statistics and selector workspace of one layer's q/k into `cal`."""
    parts = block_statistics(selector, k)
    if parts is not None:
        cal.block_stats_mib = _tensor_bytes([t for _, t in parts]) / MiB
        cal.block_stats = describe_stats(parts)
        del parts
    cal.selector_workspace_mib, cal.selection_mib = selector_memory(selector, q, k)


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
    _release(lm.device)
    return ms


def _peak_mib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return max(map(torch.cuda.max_memory_allocated, _gpus())) / MiB


def _gpus(model=None) -> list[int]:
    """The GPUs a model's parameters are on (every visible GPU without a model)."""
    if model is None:
        return list(range(torch.cuda.device_count()))
    return sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_row(s: Settings, lm: Loaded, ids: Tensor, name: str, cal: Calibrated | None) -> dict:
    """Warm-up and timed requests of one method on ids [B, N]; the row's measured columns."""
    selector = None if name == methods.DENSE else methods.build(name, **cal.fields)
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
            _release(lm.device)
            if cuda:
                for d in _gpus():
                    torch.cuda.reset_peak_memory_stats(d)
            runs = []
            for _ in range(s.repeats if ids.shape[0] == 1 else s.batch_repeats):
                if recorder is not None:
                    recorder.reset()
                runs.append(request(lm, ids))
            density = recorder.summary()["density_mean"] if recorder is not None else 1.0
            if cuda:
                # the busiest GPU (model.device_map=auto spreads the layers over several)
                peak = max(map(torch.cuda.max_memory_allocated, _gpus())) / MiB
                reserved = max(map(torch.cuda.max_memory_reserved, _gpus())) / MiB
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
    }


# ------------------------------------------------------------------------------------------------
# The run: plan, resume, calibrate, time, write.

KEY = (
    "model", "layers", "dtype", "batch", "n", "method", "target", "ffn_chunk_tokens", "compile"
)


def _chunk_key(value) -> int:
    """ffn_chunk_tokens as a key: 0 for unchunked (None, or a row written before the column)."""
    return 0 if value is None or pd.isna(value) else int(value)


def row_key(r: dict) -> tuple:
    return tuple(
        float(r[k])
        if k == "target"
        else _chunk_key(r.get(k))
        if k == "ffn_chunk_tokens"
        else as_bool(r.get(k))  # rows from before the column ran eager
        if k == "compile"
        else (int(r[k]) if k in ("layers", "batch", "n") else str(r[k]))
        for k in KEY
    )


def plan(s: Settings) -> list[tuple[int, int, str]]:
    """(batch, N, method) in run order: every batch-1 row first (largest N first, dense first in
    each N), then the larger batches."""
    order = lambda names: sorted(names, key=lambda m: (m != methods.DENSE, s.methods.index(m)))
    out = []
    for b in s.batches:
        ns, names = (s.contexts, s.methods) if b == 1 else (s.batch_contexts, s.batch_methods)
        out += [(b, n, m) for n in ns for m in order(names)]
    return out


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """Add ttft_speedup and attention_speedup: dense's time over the row's, same model, batch, N."""
    derived = ["ttft_speedup", "attention_speedup", "outside_ms_per_layer", "outside_x_gemm"]
    df = df.drop(columns=derived, errors="ignore")
    if df.empty:
        return df
    # rows from before the column ran their feed-forward blocks unchunked: 0
    chunk = df["ffn_chunk_tokens"] if "ffn_chunk_tokens" in df else pd.Series(0, index=df.index)
    df["ffn_chunk_tokens"] = chunk.fillna(0).astype(int)
    # rows from before the column ran every layer eagerly
    df["compile"] = df["compile"].map(as_bool) if "compile" in df else False
    keys = ["model", "layers", "dtype", "batch", "n", "ffn_chunk_tokens", "compile"]
    ok = df["status"] == "ok"
    dense = df[ok & (df["method"] == methods.DENSE)].drop_duplicates(keys, keep="last")
    dense = dense[keys + ["ttft_ms", "attention_ms"]].rename(
        columns={"ttft_ms": "_dense_ttft", "attention_ms": "_dense_attn"}
    )
    df = df.merge(dense, on=keys, how="left")
    df["ttft_speedup"] = df["_dense_ttft"] / df["ttft_ms"]
    df["attention_speedup"] = df["_dense_attn"] / df["attention_ms"]
    df["outside_ms_per_layer"] = (df["ttft_ms"] - df["attention_ms"]) / df["layers"]
    gemm = df["gemm_ms_per_layer"] if "gemm_ms_per_layer" in df else math.nan
    df["outside_x_gemm"] = df["outside_ms_per_layer"] / gemm
    return df.drop(columns=["_dense_ttft", "_dense_attn"])


def load_rows(csv: Path) -> list[dict]:
    """The CSV's rows, less the derived columns (recomputed on every write)."""
    if not csv.exists():
        return []
    df = pd.read_csv(csv).drop(columns=["ttft_speedup", "attention_speedup"], errors="ignore")
    return df.to_dict("records")


def as_bool(value) -> bool:
    """A CSV cell written from a bool ('True'/'False', or a parsed bool)."""
    return str(value).strip().lower() == "true"


def write_rows(csv: Path, rows: list[dict]) -> pd.DataFrame:
    df = derive(pd.DataFrame(rows))
    write_atomic(csv, df.to_csv(index=False))
    return df


def _versions() -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
    }


def _known(rows: list[dict], s: Settings, lm: Loaded) -> dict[tuple[int, str], Calibrated]:
    """Calibrations recorded by earlier rows of this model and target (batch 1 rows preferred)."""
    out = {}
    for r in sorted(rows, key=lambda r: -int(r["batch"])):  # batch 1 last: it wins
        if (
            r["method"] == methods.DENSE
            or r["model"] != s.model
            or int(r["layers"]) != s.layers
            or r["dtype"] != lm.dtype
            or float(r["target"]) != s.target
            or not isinstance(r.get("fields"), str)
        ):
            continue
        out[(int(r["n"]), r["method"])] = Calibrated(
            fields=json.loads(r["fields"]),
            knob=None if pd.isna(r.get("knob")) else float(r["knob"]),
            calibration_density=float(r["calibration_density"]),
            target_reached=as_bool(r["target_reached"]),
        )
    return out


def _cal_key(s: Settings, lm: Loaded, n: int, method: str) -> dict:
    """What a saved calibration was measured on: model, weights, prompt, context and target."""
    return {
        "model": s.model,
        "layers": s.layers,
        "dtype": lm.dtype,
        "checkpoint": str(s.checkpoint or ""),
        "seed": s.seed,
        "target": s.target,
        "n": n,
        "method": method,
    }


def save_calibrations(s: Settings, lm: Loaded, n: int, got: dict[str, Calibrated]) -> None:
    """Append `got` to the run's calibration file in one flushed write, after a line break where
    a kill cut the last line (so the new lines stay whole)."""
    lines = "".join(
        json.dumps({**_cal_key(s, lm, n, m), **dataclasses.asdict(cal)}) + "\n"
        for m, cal in got.items()
    )
    with open(paths.check_inside(s.calibrations), "ab", opener=paths.opener) as f:
        if f.tell() and not _ends_with_newline(s.calibrations):
            lines = "\n" + lines
        f.write(lines.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def saved_calibrations(s: Settings, lm: Loaded) -> dict[tuple[int, str], Calibrated]:
    """This setting's calibrations from the run's calibration file; a line cut by a kill, or of
    another setting, is passed over."""
    if not s.calibrations.exists():
        return {}
    names = {f.name for f in dataclasses.fields(Calibrated)}
    out = {}
    for line in s.calibrations.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
            if not isinstance(e, dict):
                continue
            key = _cal_key(s, lm, int(e["n"]), str(e["method"]))
            if any(e.get(k) != v for k, v in key.items()):
                continue
            out[(key["n"], key["method"])] = Calibrated(**{k: e[k] for k in names if k in e})
        except (ValueError, KeyError, TypeError):
            continue
    return out


def run(s: Settings) -> pd.DataFrame:
    """Every pending row of the plan; returns the whole CSV (old rows included) as a frame."""
    t_start = time.perf_counter()
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")  # rows of one process share it
    paths.make_dirs(s.out)  # no write leaves the results folder through a link
    rows = load_rows(s.csv)
    if s.retry_oom:  # run again; the new row replaces the oom one
        rows = [r for r in rows if r.get("status") != "oom"]
    done = {row_key(r) for r in rows}
    common = {"model": s.model, "layers": s.layers, "dtype": s.dtype}
    common["ffn_chunk_tokens"] = s.ffn_chunk_tokens or 0
    common["compile"] = s.compile

    def key(b, n, m):
        return row_key({**common, "batch": b, "n": n, "method": m, "target": _target(s, m)})

    pending = [(b, n, m) for b, n, m in plan(s) if key(b, n, m) not in done]
    print(
        f"ttft: {s.model} with {s.layers} layers on {_device_name(s.device)}: {len(pending)} rows "
        f"to run ({len(plan(s)) - len(pending)} already in {s.csv})",
        flush=True,
    )
    if not pending:
        df = write_rows(s.csv, rows) if rows else pd.DataFrame()
        if not df.empty and not s.figure.exists():
            _plot(s, df)
        return df
    from rbs_bench.execution import resolve_executor

    versions = _versions()
    lm = build_model(s)
    cals = {**saved_calibrations(s, lm), **_known(rows, s, lm)}
    tried = set(cals)  # (N, method) calibrated already, or attempted in this run
    failed, stopped = [], False
    bar = tqdm(
        total=len(pending), desc="ttft", unit="row", disable=not s.progress, dynamic_ncols=True
    )
    prompt_cache: dict[int, Tensor] = {}
    gemm_ms: dict[int, float] = {}  # tokens -> one layer's GEMM time
    for b, n, name in pending:
        if s.time_budget_s is not None and time.perf_counter() - t_start > s.time_budget_s:
            stopped = True
            break
        if n not in prompt_cache:
            prompt_cache = {n: prompts(s, n, lm.vocab)}  # one context at a time
        ids = prompt_cache[n][:b]
        if name != methods.DENSE and (n, name) not in tried:
            # one capture calibrates every method still pending at this N
            names = [
                m for _, nn, m in pending if nn == n and m != methods.DENSE and (n, m) not in tried
            ]
            names = list(dict.fromkeys(names))
            measure = {m for bb, nn, m in pending if nn == n and bb == 1}
            bar.set_postfix_str(f"calibrating at N={n}")
            got = calibrate_methods(s, lm, prompt_cache[n][:1], names, measure)
            save_calibrations(s, lm, n, got)
            cals.update({(n, m): c for m, c in got.items()})
            tried.update((n, m) for m in names)
        cal = cals.get((n, name))
        if name != methods.DENSE and cal is None:
            failed.append(f"b={b} N={n} {name}: not calibrated (see the error above)")
            bar.update()
            continue
        t0 = time.perf_counter()
        bar.set_postfix_str(f"b={b} N={n} {name}")
        row = {**common, "device": _device_name(lm.device), "model_desc": lm.description}
        row["gpus"] = len(_gpus(lm.model)) if lm.device.type == "cuda" else 0
        row.update(heads=lm.heads, kv_heads=lm.kv_heads, head_dim=lm.head_dim)
        row.update(batch=b, n=n, method=name, target=_target(s, name))
        row.update(_cal_columns(cal, b))
        if b * n not in gemm_ms:
            gemm_ms[b * n] = layer_gemm_ms(lm, b * n)
        row["gemm_ms_per_layer"] = gemm_ms[b * n]
        if lm.device.type == "cuda":
            for d in _gpus():
                torch.cuda.reset_peak_memory_stats(d)
        try:
            row.update(status="ok", **time_row(s, lm, ids, name, cal))
        except torch.cuda.OutOfMemoryError as e:
            # what was held when it failed, for results/scale and the memory estimate
            row.update(status="oom", oom_peak_allocated_mib=_peak_mib(lm.device))
            row.update(oom_error=str(e).splitlines()[0][:200])
            tqdm.write(f"ttft: b={b} N={n} {name}: {row['oom_error']}", file=sys.stderr)
            _release(lm.device)
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # one method failing must not lose the others' rows
            failed.append(f"b={b} N={n} {name}: {type(e).__name__}: {e}")
            tqdm.write(f"ttft: {failed[-1]}", file=sys.stderr)
            _release(lm.device)
            bar.update()
            continue
        row.update(
            model_mib=lm.model_mib,
            executor=resolve_executor(s.executor, s.device) if name != methods.DENSE else "sdpa",
            sdpa_backend=s.sdpa_backend,
            knob_name=methods.method_class(name).knob or "",
            experts_impl=_experts_impl(lm.model.config),
            warmup=s.warmup,
            repeats=s.repeats if b == 1 else s.batch_repeats,
            **versions,
            run=run_id,
            seconds=round(time.perf_counter() - t0, 2),
        )
        rows.append(row)
        df = write_rows(s.csv, rows)
        tqdm.write(_row_line(df.iloc[-1]))
        bar.update()
    bar.close()
    df = write_rows(s.csv, rows) if rows else pd.DataFrame()
    if not df.empty:
        _plot(s, df)
        print(f"wrote {s.csv} and {s.figure}")
    finished = {row_key(r) for r in rows}
    left = sum(1 for p in pending if key(*p) not in finished)
    if stopped:
        print(
            f"ttft: time budget of {s.time_budget_s:.0f} s reached with {left} rows left; run the "
            "same command again to continue (finished rows are skipped)",
            flush=True,
        )
    if failed:
        print(
            f"ttft: {len(failed)} rows failed (rerun to retry):\n  " + "\n  ".join(failed),
            file=sys.stderr,
        )
    return df


def _plot(s: Settings, df: pd.DataFrame) -> None:
    """The three-panel figure of this run's setting (the CSV may hold others)."""
    from rbs_bench.tables import timing

    same = (df["model"] == s.model) & (df["layers"] == s.layers)
    same &= (df["dtype"] == s.dtype) & (
        (df["method"] == methods.DENSE) | (df["target"] == s.target)
    )
    standalone = timing.standalone_rows(s.out, s.tag, s.target)
    timing.plot_speedup(df[same], standalone, s.figure)


def _target(s: Settings, name: str) -> float:
    return 1.0 if name == methods.DENSE else s.target


def _cal_columns(cal: Calibrated | None, batch: int) -> dict:
    """The calibration's columns; selector-only measures belong to batch-1 rows."""
    if cal is None:  # dense
        return {"fields": "{}", "calibration_density": 1.0, "target_reached": True}
    out = {
        "fields": json.dumps(cal.fields, sort_keys=True),
        "knob": cal.knob,
        "block_size": cal.fields.get("block_size"),
        "calibration_density": cal.calibration_density,
        "target_reached": cal.target_reached,
    }
    if batch == 1:
        out.update(
            block_stats_mib=cal.block_stats_mib,
            block_stats=cal.block_stats,
            selector_workspace_mib=cal.selector_workspace_mib,
            selection_mib=cal.selection_mib,
        )
    return out


def _experts_impl(config) -> str:
    """transformers' MoE experts implementation (grouped_mm, eager, ...); '' without experts."""
    if not hasattr(config, "num_experts"):
        return ""
    return str(getattr(config, "_experts_implementation", "") or "")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _row_line(r) -> str:
    if r["status"] != "ok":
        return f"b={r['batch']} N={r['n']:>6} {r['method']:12s} {r['status']}"
    flag = "" if as_bool(r["target_reached"]) else " (target not reached)"
    speed = ""
    if not pd.isna(r.get("ttft_speedup")):
        speed = f"  x{r['attention_speedup']:.2f} attn  x{r['ttft_speedup']:.2f} TTFT"
    outside = f"  outside {r['outside_ms_per_layer']:.2f} ms/layer"
    if not pd.isna(r.get("outside_x_gemm")):
        outside += f" ({r['outside_x_gemm']:.2f}x GEMM)"
    return (
        f"b={r['batch']} N={r['n']:>6} {r['method']:12s} density {r['density']:.4f}{flag}  "
        f"TTFT {r['ttft_ms']:9.2f} ms  attn {r['attention_ms']:9.2f} ms  "
        f"sel {r['selector_ms']:7.2f} ms  peak {r['peak_allocated_mib']:9.1f} MiB{speed}{outside}"
    )


def summary_markdown(df: pd.DataFrame) -> str:
    """Batch-1 speedups over dense per method and context, as a Markdown table."""
    if df.empty:
        return ""
    one = df[(df["batch"] == 1) & (df["status"] == "ok") & (df["method"] != methods.DENSE)]
    ns = sorted(one["n"].unique())
    cells = {}
    for _, r in one.iterrows():
        flag = "" if as_bool(r["target_reached"]) else " *"
        cells[(r["method"], r["n"])] = (
            f"{r['attention_speedup']:.2f}x / {r['ttft_speedup']:.2f}x{flag}"
        )
    lines = ["| method | " + " | ".join(f"N={n}" for n in ns) + " |"]
    lines.append("|---|" + "---:|" * len(ns))
    for m in dict.fromkeys(one["method"]):
        lines.append(f"| {m} | " + " | ".join(cells.get((m, n), "–") for n in ns) + " |")
    note = "Prefill-attention / TTFT speedup over dense at batch 1; * target density not reached."
    return "\n".join(lines) + "\n\n" + note + "\n"


# ------------------------------------------------------------------------------------------------
# Entry points.


def run_experiment(cfg, experiment: str) -> list[Path]:
    """`python -m rbs_bench +experiment=<speed|memory|throughput|selector_time>`: run the pending
    rows, then write the experiment's tables (all four for another name) to <results_dir>/tables."""
    from rbs_bench.tables import timing

    if cfg.model.name != "tiny":
        raise UserError(
            f"model={cfg.model.name} is not used by the timing experiments: they build a "
            "random-weight model; choose it with timing.model=tiny|qwen3_30b_a3b"
        )
    tc = cfg.timing
    out = Path(tc.out_dir) if tc.out_dir else speed_dir(cfg.results_dir)
    s = resolve(tc, cfg.device, cfg.executor, out, progress=cfg.progress)
    df = run(s)
    if df.empty:
        raise UserError("no rows were timed; see the errors above")
    names = [experiment] if experiment in timing.EXPERIMENTS else timing.EXPERIMENTS
    paths = timing.build_tables(s.csv, Path(cfg.results_dir), tables_dir(cfg.results_dir), names)
    for p in paths:
        if p.suffix == ".md":
            print(f"\n{p}:\n{p.read_text()}")
    return paths


def main(argv: list[str] | None = None) -> int:
    d = TimingCfg()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        help=f"one of {', '.join(MODELS)} (default: qwen3_30b_a3b on CUDA, else tiny); with "
        "--checkpoint, the name of its rows",
    )
    ap.add_argument("--layers", type=int, help="decoder layers (default 4; tiny: 2)")
    ap.add_argument(
        "--device-map", choices=["auto"], help="a --checkpoint's layers over every visible GPU"
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        help="a checkpoint directory (e.g. written by rbs_bench.models.rehearsal) loaded "
        "through from_pretrained instead of a random model; --model names its rows",
    )
    ap.add_argument("--contexts", type=int, nargs="+", help="default 32K-128K on CUDA, 1K 2K")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--batch-contexts",
        type=int,
        nargs="+",
        help="contexts of batches > 1 (default 32K 64K 128K on CUDA, 1K on a CPU)",
    )
    ap.add_argument("--batch-methods", nargs="+", default=throughput_methods())
    ap.add_argument("--methods", nargs="+", default=d.methods)
    ap.add_argument("--target", type=float, default=d.target)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--repeats", type=int, help="timed requests per row (default 3; CPU 1)")
    ap.add_argument("--batch-repeats", type=int, help="timed requests of batch > 1 rows")
    ap.add_argument(
        "--ffn-chunk-tokens",
        type=int,
        default=d.ffn_chunk_tokens,
        help="feed-forward blocks over this many tokens at once (0: all at once)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=d.compile,
        help="compile each layer's regions outside attention (default: on CUDA only)",
    )
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--sdpa-backend", default=d.sdpa_backend, choices=SDPA_BACKENDS)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=speed_dir("results"))
    ap.add_argument(
        "--time-budget-s",
        type=positive_seconds,
        help="start no new row after this many seconds (default 450 on CUDA)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--retry-oom", action="store_true", help="rerun rows recorded as out of memory")
    args = ap.parse_args(argv)
    use_expandable_segments()
    tc = TimingCfg(
        model=args.model,
        checkpoint=str(args.checkpoint) if args.checkpoint else None,
        device_map=args.device_map,
        layers=args.layers,
        contexts=args.contexts,
        batches=args.batches,
        batch_contexts=args.batch_contexts,
        batch_methods=args.batch_methods,
        methods=args.methods,
        target=args.target,
        warmup=args.warmup,
        repeats=args.repeats,
        batch_repeats=args.batch_repeats,
        ffn_chunk_tokens=args.ffn_chunk_tokens,
        compile=args.compile,
        sdpa_backend=args.sdpa_backend,
        seed=args.seed,
        time_budget_s=args.time_budget_s,
        retry_oom=args.retry_oom,
    )
    try:
        s = resolve(tc, args.device, args.executor, args.out, progress=not args.no_progress)
        df = run(s)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    print(summary_markdown(df))
    return 0 if not df.empty else 1


if __name__ == "__main__":
    sys.exit(main())
