"""The settings of a TTFT run (`python -m rbs_bench.bench.ttft`): what an unset field means on
each device, the shipped architectures' depth and context, and every check of the input.

`resolve` turns a `TimingCfg` (or the command line's equivalent) into `Settings`, every field set;
a bad value stops with one line (`UserError`) before any model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rbs_bench import methods
from rbs_bench.errors import UserError

# tiny: the embedded tiny Qwen3; the others: a shipped architecture (rbs_bench.models.rehearsal,
# the real model's config.json) with random weights and --layers of its decoder layers.
MODELS = ("tiny", "qwen3_30b_a3b", "qwen3_32b")
SDPA_BACKENDS = ("default", "flash", "cudnn", "efficient", "math")
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
        fields = checkpoint_fields(checkpoint) | context_overrides(model)
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
        depth = full_depth(model) if model != "tiny" else 64
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


def context_overrides(model: str) -> dict:
    """The harness's context overrides (YaRN to 128K for Qwen3-32B) of a checkpoint's model, as
    its conf/model config gives them to runs (the hub's Qwen3-32B config stops at 40,960)."""
    from rbs_bench.models.rehearsal import architecture_of

    return dict(ARCH_OVERRIDES.get(architecture_of(model) or "", {}))


def checkpoint_fields(path: Path) -> dict:
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


def full_depth(model: str) -> int:
    return _arch(model)["num_hidden_layers"]


def _max_positions(model: str) -> int:
    from rbs_bench.models.tiny import TINY_CONFIG

    cfg = TINY_CONFIG if model == "tiny" else _arch(model)
    return cfg["max_position_embeddings"]


def throughput_methods() -> list[str]:
    """The methods the prompt-throughput table compares at batch > 1 (MethodInfo.throughput)."""
    return [m for m in methods.in_order(methods.registry()) if methods.info(m).throughput]
