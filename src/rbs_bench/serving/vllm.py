"""Sparse prefill inside vLLM, through a plugin (no fork, no monkey-patching), and its TTFT runner.

Plugin. vLLM loads the `vllm.general_plugins` entry point `rbs_sparse_prefill` (this module's
`register`) in every process it starts. When `RBS_VLLM_PREFILL` holds a `PrefillSpec` (JSON) it
registers our attention backend: on CUDA as the `CUSTOM` backend (the engine is created with
`attention_backend="CUSTOM"`), a subclass of vLLM's FlashAttention backend; on the CPU, where vLLM
always picks `CPU_ATTN` whatever is selected, as the override of `CPU_ATTN`, a subclass of the CPU
attention backend. Without the variable the plugin registers nothing.

Backend. Only the prefill branch changes. For a step whose batch holds whole prompts (query length
= sequence length: no cached prefix, no chunk), the configured selector runs on each prompt
separately and the block-sparse executor runs them as one varlen batch
(`rbs_bench.serving.prefill`). Decode rows, and prompts that continue a cached prefix, stay on
vLLM's kernel; KV-cache writes are vLLM's (`do_kv_cache_update`, inherited). Method `dense` runs
vLLM's own kernel, timed the same way. Per layer call the worker keeps the density of every head
of every prompt and the selector / attention time; the runner collects them with
`collective_rpc("rbs_prefill_stats")` (a worker extension), and can switch method or budget in a
running engine with `collective_rpc("rbs_prefill_configure", args=(spec_json,))`.

Runner. `python -m rbs_bench.serving.vllm --model PATH --method rbs --budget 1.0 --context 32768`
measures TTFT from vLLM's request metrics (`first_token_ts - scheduled_ts`, engine clock, and
`first_token_latency`, frontend clock) and prefill-attention time from inside the backend, one
request at a time and in batches, and appends one JSON line per measurement with the vLLM settings.

vLLM is imported only here, and only when an engine or a backend class is needed: importing
`rbs_bench`, or this module, works without it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from rbs_bench import paths
from rbs_bench.errors import UserError
from rbs_bench.serving.prefill import ENV_VAR, PrefillSpec, StepStats, sparse_prefill, summarize

MODULE = "rbs_bench.serving.vllm"  # class paths handed to vLLM (this file may run as __main__)
PLUGIN_NAME = "rbs_sparse_prefill"
EXTENSION = f"{MODULE}.PrefillStatsExtension"

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Import shim: the attention registry moved from vllm.attention to vllm.v1.attention (2026-01).
# ---------------------------------------------------------------------------------------------


def _require_vllm():
    try:
        import vllm
    except ImportError:
        raise UserError(
            "vLLM is not installed in this environment; build the tested one with "
            "`make test-vllm`, or `pip install -e '.[vllm]'` into a separate virtualenv"
        ) from None
    return vllm


def _registry():
    """(AttentionBackendEnum, register_backend) of the installed vLLM."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        from vllm.attention.backends.registry import AttentionBackendEnum, register_backend
    return AttentionBackendEnum, register_backend


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def register() -> None:
    """The plugin entry point: cheap, idempotent, and a no-op unless RBS_VLLM_PREFILL is set."""
    if not os.environ.get(ENV_VAR):
        return
    backends, register_backend = _registry()
    if _on_cpu():  # CPU ignores the selection and always resolves CPU_ATTN, honouring overrides
        register_backend(backends.CPU_ATTN, f"{MODULE}.SparsePrefillCpuBackend")
    else:
        register_backend(backends.CUSTOM, f"{MODULE}.SparsePrefillBackend")


# ---------------------------------------------------------------------------------------------
# Worker-side state: the configured method and the stats of the prefill steps it ran.
# ---------------------------------------------------------------------------------------------

_WORKER: dict = {"spec": None, "selector": None, "stats": StepStats()}


def configure(spec: PrefillSpec) -> None:
    """Set the method this process runs (builds the selector once)."""
    _WORKER["selector"] = spec.selector()
    _WORKER["spec"] = spec


def _active() -> dict | None:
    if _WORKER["spec"] is None:
        spec = PrefillSpec.from_env()
        if spec is None:
            return None
        configure(spec)
    return _WORKER


class PrefillStatsExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): the runner's calls into workers."""

    def rbs_prefill_stats(self) -> list[dict]:
        """Per-layer records of the prefill steps since the last call (times in ms)."""
        return _WORKER["stats"].drain()

    def rbs_prefill_configure(self, spec_json: str) -> str:
        """Switch the method or budget of a running engine; returns the spec now in force."""
        configure(PrefillSpec.from_json(spec_json))
        _WORKER["stats"].drain()
        return _WORKER["spec"].to_json()


# ---------------------------------------------------------------------------------------------
# The backend: vLLM's impl with its prefill branch replaced for whole-prompt rows.
# ---------------------------------------------------------------------------------------------


def _no_window(w) -> bool:
    if w is None:
        return True
    if isinstance(w, (tuple, list)):
        return all(x is None or x < 0 for x in w)
    return w < 0


def _step_rows(md) -> tuple[list[tuple[int, int]], bool]:
    """Row bounds of the whole-prompt sequences of this step, and whether other rows exist.

    Computed once per step (the metadata object is shared by the layers) with one host copy.
    """
    cached = getattr(md, "_rbs_rows", None)
    if cached is not None:
        return cached
    n = md.query_start_loc.shape[0] - 1
    starts = md.query_start_loc.tolist()
    seq_lens = md.seq_lens[:n].tolist()
    fresh, other = [], False
    for i in range(n):
        a, b = starts[i], starts[i + 1]
        if b - a == seq_lens[i] and b > a:
            fresh.append((a, b))
        elif b > a:
            other = True
    md._rbs_rows = (fresh, other)
    return fresh, other


class _SparsePrefill:
    """The forward override shared by the CUDA and CPU impls (a mixin before vLLM's impl)."""

    def _plain_causal(self, md, query, value, output_scale, output_block_scale) -> bool:
        """Standard causal decoder self-attention in a float dtype, without fused output
        quantization: the only case the sparse path handles."""
        return (
            query.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and output_scale is None
            and output_block_scale is None
            and str(getattr(self, "attn_type", "decoder")).lower().rsplit(".", 1)[-1] == "decoder"
            and getattr(md, "causal", True) is True
            and getattr(self, "alibi_slopes", None) is None
            and getattr(self, "sinks", None) is None
            and not getattr(self, "logits_soft_cap", None)
            and _no_window(getattr(self, "sliding_window", None))
            and getattr(self, "dcp_world_size", 1) == 1
            and getattr(md, "mm_prefix_query_range_tensor", None) is None
            and value.shape[-1] == self.head_size
        )

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        md = attn_metadata
        state = _active()
        stock = super().forward  # vLLM's kernel: decode, cached prefixes, profiling runs
        args = (layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        if state is None or md is None or md.max_query_len <= 1:
            return stock(*args)
        if not self._plain_causal(md, query, value, output_scale, output_block_scale):
            _warn_once(layer, "not plain causal self-attention; it runs vLLM's kernel")
            return stock(*args)
        fresh, other = _step_rows(md)
        if not fresh:
            return stock(*args)

        stats: StepStats = state["stats"]
        name = getattr(layer, "layer_name", type(layer).__name__)
        seq_lens = [b - a for a, b in fresh]
        t = md.num_actual_tokens
        if state["selector"].is_dense:
            marks = (stats.clock(query), stats.clock(query))
            stock(*args)
            marks += (stats.clock(query),)
            ones = [query.new_ones(self.num_heads, dtype=torch.float32) for _ in fresh]
            stats.add(name, "stock", seq_lens, ones, marks)
            return output
        if other:  # decode rows or cached prefixes share the step: vLLM's kernel for those
            stock(*args)
        out = output[:t].view(t, self.num_heads, self.head_size)
        spec = state["spec"]
        densities, marks = sparse_prefill(
            query[:t],
            key[:t],
            value[:t],
            fresh,
            state["selector"],
            spec.executor,
            self.scale,
            out,
            clock=stats.clock,
        )
        stats.add(name, "mixed" if other else "sparse", seq_lens, densities, marks)
        return output


_WARNED: set = set()


def _warn_once(layer, what: str) -> None:
    name = getattr(layer, "layer_name", "?")
    if name not in _WARNED:
        _WARNED.add(name)
        log.warning("rbs sparse prefill: layer %s is %s", name, what)


_CLASSES: dict = {}


def _cuda_backend():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    class SparsePrefillImpl(_SparsePrefill, FlashAttentionImpl):
        pass

    class SparsePrefillBackend(FlashAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return SparsePrefillImpl

    return SparsePrefillBackend, SparsePrefillImpl


def _cpu_backend():
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
    )

    class SparsePrefillCpuImpl(_SparsePrefill, CPUAttentionBackendImpl):
        pass

    class SparsePrefillCpuBackend(CPUAttentionBackend):
        # Registered as the override of CPU_ATTN, so it keeps that member's name.
        @staticmethod
        def get_impl_cls():
            return SparsePrefillCpuImpl

    return SparsePrefillCpuBackend, SparsePrefillCpuImpl


_BUILDERS = {
    "SparsePrefillBackend": (_cuda_backend, 0),
    "SparsePrefillImpl": (_cuda_backend, 1),
    "SparsePrefillCpuBackend": (_cpu_backend, 0),
    "SparsePrefillCpuImpl": (_cpu_backend, 1),
}


def __getattr__(name: str):
    """The backend classes, built on first use so that this module imports without vLLM."""
    if name not in _BUILDERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    build, i = _BUILDERS[name]
    if build not in _CLASSES:
        _require_vllm()
        classes = build()
        for cls in classes:  # importable (and picklable) by name, through this __getattr__
            cls.__module__, cls.__qualname__ = MODULE, cls.__name__
        _CLASSES[build] = classes
    return _CLASSES[build][i]


# ---------------------------------------------------------------------------------------------
# Runner: TTFT and prefill-attention time per method and budget, one request and in batches.
# ---------------------------------------------------------------------------------------------


def _parse_fields(items: list[str]) -> dict:
    fields = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--field {item!r} must look like name=value (e.g. block_size=64)")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw  # a bare string such as impl=torch
    return fields


def plan_specs(
    method_names: list[str],
    fields: dict,
    budgets: list[float | None],
    executor: str,
    device: str,
) -> list[PrefillSpec]:
    """One spec per (method, budget); methods without a knob run once. A field goes to every
    method that has it; a field no method has is an error."""
    from rbs_bench import methods

    specs, used = [], set()
    for name in method_names:
        try:
            valid = set(methods.field_names(name))
            cls = methods.method_class(name)
        except ValueError as e:
            raise UserError(str(e)) from None
        own = {k: v for k, v in fields.items() if k in valid}
        used |= set(own)
        knobs = budgets if getattr(cls, "knob", None) is not None else [None]
        for knob in knobs:
            spec = PrefillSpec(name, own, knob, executor)
            try:
                spec.check(device)
            except ValueError as e:
                raise UserError(str(e)) from None
            specs.append(spec)
    unused = sorted(set(fields) - used)
    if unused:
        raise UserError(
            f"no method of {', '.join(method_names)} has the field(s) {', '.join(unused)}"
        )
    return specs


def calibrated_knob(calibration_dir: str, model_name: str, method: str, target: float) -> float:
    """The knob stored by `python -m rbs_bench.calibrate` for this model, method and density."""
    from omegaconf import OmegaConf

    from rbs_bench import methods
    from rbs_bench.calibrations import load_knob
    from rbs_bench.config import CalibrationCfg

    cfg = OmegaConf.create(
        {
            # the default tolerance: an entry must hold its target's density within it
            "calibration": {"dir": calibration_dir, "tolerance": CalibrationCfg.tolerance},
            "model": {"name": model_name},
            "method": {"name": method},
            "budget": {"name": f"d{target:g}", "target": target},
        }
    )
    return load_knob(cfg, methods.build(method))


def budget_name(spec: PrefillSpec | None) -> str:
    if spec is None:
        return "vllm"
    return "default" if spec.knob is None else f"knob{spec.knob:g}"


def make_prompts(vocab_size: int, length: int, count: int, seed: int, text_ids=None):
    """`count` prompts of exactly `length` token ids: slices of `text_ids` (repeated as needed),
    or seeded random ids when no text is given."""
    rng = random.Random(seed * 1_000_003 + length)
    prompts = []
    for i in range(count):
        if text_ids:
            start = (i * 7919) % len(text_ids)
            reps = math.ceil((start + length) / len(text_ids))
            ids = (text_ids * reps)[start : start + length]
        else:
            ids = [rng.randrange(vocab_size) for _ in range(length)]
        prompts.append(ids)
    return prompts


class Engine:
    """One vLLM engine with the settings sparse prefill needs, and the plugin on or off.

    `spec=None` runs vLLM untouched (the RBS_VLLM_PREFILL variable is removed for it).
    """

    def __init__(
        self,
        model: str,
        spec: PrefillSpec | None,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        dtype: str = "auto",
        enforce_eager: bool = True,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        kv_cache_gib: int | None = None,
        seed: int = 0,
        tokenizer: bool = False,
    ):
        vllm = _require_vllm()
        cpu = _on_cpu()
        if spec is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = spec.to_json()
        # The engine core in this process steps only when generate() runs, after every request
        # of the batch was added: a batch is one prefill step, not split by arrival order.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cpu:  # the KV cache is host memory: keep it small on a shared machine
            if kv_cache_gib:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.settings = {
            "vllm_version": vllm.__version__,
            "platform": "cpu" if cpu else "cuda",
            "enable_chunked_prefill": False,
            "enable_prefix_caching": False,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": enforce_eager,
            "dtype": dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "attention_backend": None,
            "plugin": spec is not None,
            "engine_core_in_process": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0",
        }
        kwargs = dict(
            model=model,
            skip_tokenizer_init=not tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            # Sparse prefill needs each prompt whole in one step with no cached prefix.
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            enforce_eager=enforce_eager,
            disable_log_stats=False,  # RequestOutput.metrics (TTFT) is None otherwise
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
        )
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if spec is not None:
            kwargs["worker_extension_cls"] = EXTENSION
            if not cpu:
                kwargs["attention_backend"] = "CUSTOM"
                self.settings["attention_backend"] = "CUSTOM"
        self.settings["attention_backend"] = self.settings["attention_backend"] or (
            "CPU_ATTN" if cpu else "default"
        )
        self.llm = vllm.LLM(**kwargs)
        self.spec = spec
        if spec is not None:
            self.configure(spec)

    def configure(self, spec: PrefillSpec) -> None:
        """Switch the running engine to `spec` (every worker) and check that it took."""
        back = self.llm.collective_rpc("rbs_prefill_configure", args=(spec.to_json(),))
        if any(PrefillSpec.from_json(b) != spec for b in back):
            raise RuntimeError(f"workers did not take the prefill spec {spec}: {back}")
        self.spec = spec

    def stats(self) -> list[list[dict]]:
        """Per worker: the per-layer records since the last call (empty without the plugin)."""
        if self.spec is None:
            return []
        return self.llm.collective_rpc("rbs_prefill_stats")

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int = 1):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, detokenize=False
        )
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


def _request_record(out) -> dict:
    m = out.metrics
    if m is None:
        raise RuntimeError("vLLM returned no request metrics; the engine needs log stats on")
    comp = out.outputs[0]
    chosen = []
    for tok, lp in zip(comp.token_ids, comp.logprobs or []):
        chosen.append(float(lp[tok].logprob) if lp and tok in lp else None)
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "ttft_engine_s": m.first_token_ts - m.scheduled_ts,
        "ttft_s": m.first_token_latency,
        "queued_s": m.scheduled_ts - m.queued_ts,
        "output_token_ids": list(comp.token_ids),
        "output_logprobs": chosen,
    }


def measure(engine: Engine, prompts: list[list[int]], max_tokens: int = 1) -> dict:
    """Submit `prompts` together; TTFT per request from vLLM's metrics and the backend's
    per-layer records of the prefill (densities, selector and attention time)."""
    engine.stats()  # drop anything recorded before this batch
    outs, wall = engine.generate(prompts, max_tokens=max_tokens)
    requests = [_request_record(o) for o in outs]
    per_worker = engine.stats()
    rec = {
        "batch_size": len(prompts),
        "wall_s": wall,
        "requests": requests,
        "ttft_engine_s_mean": sum(r["ttft_engine_s"] for r in requests) / len(requests),
        "ttft_engine_s_max": max(r["ttft_engine_s"] for r in requests),
        "ttft_s_mean": sum(r["ttft_s"] for r in requests) / len(requests),
    }
    if engine.spec is not None:
        if not per_worker or not per_worker[0]:
            raise UserError(
                "the sparse prefill backend recorded nothing in the engine: check that "
                f"VLLM_PLUGINS (if set) includes {PLUGIN_NAME} and that rbs-bench is installed "
                "in the engine's environment"
            )
        ranks = [summarize(w) for w in per_worker]
        densities = [r["density"] for r in ranks if r["density"] is not None]
        rec.update(ranks[0])  # times of rank 0; density over every rank's heads
        rec["density"] = sum(densities) / len(densities) if densities else None
        rec["prefill_steps"] = 1 + max(e["step"] for e in per_worker[0])
        rec["layers"] = per_worker[0]
    return rec


def run(args) -> Path:
    """The benchmark: every (method, budget) x context x batch size x repeat, resumable."""
    from tqdm import tqdm

    from rbs_bench.records import RecordStore, check_fingerprint

    _require_vllm()
    contexts, batches = sorted(set(args.context)), sorted(set(args.batch_sizes))
    if min(contexts) < 1 or min(batches) < 1 or args.repeats < 1 or args.max_tokens < 1:
        raise UserError("--context, --batch-sizes, --repeats and --max-tokens must be positive")
    max_model_len = args.max_model_len or max(contexts) + args.max_tokens
    if max(contexts) + args.max_tokens > max_model_len:
        raise UserError(
            f"--context {max(contexts)} plus --max-tokens {args.max_tokens} exceeds "
            f"--max-model-len {max_model_len}; raise --max-model-len or shorten the context"
        )
    batched = args.max_num_batched_tokens or max(max_model_len, max(batches) * max(contexts))

    device = "cuda" if not _on_cpu() else "cpu"
    fields = _parse_fields(args.field)
    if args.no_plugin:
        specs: list[PrefillSpec | None] = [None]
    else:
        budgets: list[float | None] = list(args.budget) or [None]
        if args.target is not None:
            if len(args.method) != 1 or args.budget:
                raise UserError("--target needs exactly one --method and no --budget")
            name = args.model_name or Path(args.model).name
            budgets = [calibrated_knob(args.calibration_dir, name, args.method[0], args.target)]
        specs = plan_specs(args.method, fields, budgets, args.executor, device)

    text_ids = None
    cfg = _hf_config(args.model)
    if args.prompt_file:
        text_ids = _tokenize_file(args.model, args.prompt_file)

    model_name = args.model_name or Path(args.model).name
    engine = Engine(
        args.model,
        specs[0],
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        max_num_seqs=max(batches),
        dtype=args.dtype,
        enforce_eager=not args.cuda_graphs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_gib=args.kv_cache_gib,
        seed=args.seed,
        tokenizer=bool(args.prompt_file),
    )
    out_root = paths.confine(args.out)  # no write leaves it through a link
    try:
        for spec in specs:
            if spec is not None and spec != engine.spec:
                engine.configure(spec)
            method = "vllm" if spec is None else spec.method
            cell = (
                out_root
                / paths.component(model_name, "--model-name")
                / paths.component(method, "--method")
                / paths.component(budget_name(spec), "--budget")
            )
            fingerprint = {
                "model": args.model,
                "spec": None if spec is None else json.loads(spec.to_json()),
                "vllm": engine.settings,
                "max_tokens": args.max_tokens,
                "seed": args.seed,
                "prompt_file": args.prompt_file,
            }
            check_fingerprint(cell / paths.CELL_FILE, fingerprint)
            records = cell / paths.RECORDS
            store = RecordStore(records, cell=paths.cell_identity(records))  # bound to its cell
            todo = [
                (n, b, r)
                for n in contexts
                for b in batches
                for r in range(args.repeats)
                if not store.done((f"batch{b}", n, r))
            ]
            if todo and args.warmup:
                measure(engine, make_prompts(cfg.vocab_size, contexts[0], 1, args.seed + 999))
            label = f"{method}/{budget_name(spec)}"
            for n, b, r in tqdm(todo, desc=label, unit="run", dynamic_ncols=True):
                prompts = make_prompts(cfg.vocab_size, n, b, args.seed + r, text_ids)
                rec = measure(engine, prompts, max_tokens=args.max_tokens)
                rec.update(
                    task=f"batch{b}",
                    context_length=n,
                    index=r,
                    model=model_name,
                    method=method,
                    budget=budget_name(spec),
                    spec=fingerprint["spec"],
                    vllm=engine.settings,
                )
                store.append(rec)
            _print_summary(label, store)
    finally:
        engine.close()
    return out_root


def _print_summary(label: str, store) -> None:
    rows = sorted(store.records.values(), key=lambda r: (r["context_length"], r["batch_size"]))
    for r in rows:
        dens = r.get("density")
        attn = r.get("prefill_attention_ms")
        print(
            f"{label:24s} N={r['context_length']:>7d} batch={r['batch_size']:>3d} "
            f"rep={r['index']}  TTFT(engine) {r['ttft_engine_s_mean'] * 1e3:9.2f} ms"
            + (f"  prefill attn {attn:9.2f} ms" if attn is not None else "")
            + (f"  density {dens:.4f}" if dens is not None else "")
        )


def _hf_config(model: str):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model)
    except OSError as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot read the config of {model!r} ({reason}); give a local path") from e
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _tokenize_file(model: str, path: str) -> list[int]:
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompt-file {path} does not exist")
    ids = AutoTokenizer.from_pretrained(model).encode(p.read_text(), add_special_tokens=False)
    if not ids:
        raise UserError(f"--prompt-file {path} has no tokens")
    return list(ids)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m rbs_bench.serving.vllm",
        description="TTFT and prefill-attention time of sparse prefill methods inside vLLM.",
    )
    ap.add_argument("--model", required=True, help="local model directory or hub id")
    ap.add_argument("--model-name", help="name in the results path (default: the path's name)")
    from rbs_bench import methods

    ap.add_argument(
        "--method", nargs="+", default=[methods.headline()], help="registered method(s)"
    )
    ap.add_argument(
        "--budget",
        nargs="*",
        type=float,
        default=[],
        help="the methods' knob value(s), e.g. rbs alpha_scale; each runs in the same engine",
    )
    ap.add_argument("--target", type=float, help="density whose calibrated knob to use")
    ap.add_argument("--calibration-dir", default="results/calibration")
    ap.add_argument("--field", nargs="*", default=[], help="method fields, name=value")
    ap.add_argument("--executor", default="auto", help="auto | triton | flex | reference")
    ap.add_argument("--no-plugin", action="store_true", help="vLLM untouched (the baseline)")
    ap.add_argument("--context", nargs="+", type=int, required=True, help="prompt lengths")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1, help="1 = prefill and first token")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--prompt-file", help="text to fill prompts with (default: random ids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=int, help="CPU only: VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--cuda-graphs", action="store_true", help="allow CUDA graphs for decode")
    out = paths.runs_dir("results") / "vllm_ttft"
    ap.add_argument("--out", default=str(out), help="results root")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        sys.exit(2)


def plugin_installed() -> bool:
    """Whether this environment exposes the entry point vLLM loads."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.name == PLUGIN_NAME for ep in eps)


if __name__ == "__main__":
    main()
