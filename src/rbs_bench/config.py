"""Structured-config schemas for the Hydra tree in conf/, and one-line explanations of bad configs.

Every group has a dataclass schema, so a misspelt field or a wrong type fails at compose time.
Method schemas are generated from the registry: `conf/method/<name>.yaml` is the registry key, the
selector's dataclass fields and the results column at once.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rbs_bench import methods
from rbs_bench.errors import UserError, one_line

CONFIG_MODULE = "rbs_bench.conf"
GROUPS = ("model", "method", "benchmark", "budget", "calibration", "logger", "experiment")


_STARTED = time.monotonic()  # near enough the process's start: every entry point imports this


def since_start() -> float:
    """Seconds since the process started (as `time_budget_s` counts them)."""
    return time.monotonic() - _STARTED


def out_of_time(cfg) -> bool:
    """Whether the run's `time_budget_s` (seconds since the process started) is spent."""
    budget = cfg.get("time_budget_s")
    return budget is not None and since_start() > budget


# Feed-forward blocks run over at most this many tokens at once (rbs_bench.models.feedforward):
# with the compiled layers a 32K chunk of Qwen3-30B-A3B's experts holds about 1.8 GiB, and
# halving it costs 1.3 ms a layer at 128K on an H100 (results/speed/layer_profile_*.csv).
FFN_CHUNK_TOKENS = 32768


@dataclass
class ModelCfg:
    name: str = MISSING
    hf_id: str | None = None  # None: an embedded model built locally (tiny_vl by name, else tiny)
    # A local copy of the model's checkpoint (a directory in the hub's layout, e.g. one written by
    # `python -m rbs_bench.models.rehearsal write`): from_pretrained reads it instead of hf_id.
    path: str | None = None
    revision: str | None = None
    max_context: int = MISSING  # longest prompt + generation the model supports
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    chat_template: bool = True  # wrap prompts with the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    # Load weights stored as pickle files (pytorch_model.bin, *.pt), which can run code when
    # loaded; off: safetensors only (models.pickle_problem).
    allow_pickle: bool = False
    config_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. rope scaling
    # Seeded random weights of a shipped architecture (models/architectures/<architecture>.json)
    # and the embedded byte-level tokenizer: rehearsal models (rbs_bench.models.rehearsal).
    random_init: bool = False
    architecture: str | None = None
    seed: int = 0
    # How, not what: neither changes a prediction, so neither is part of a record's fingerprint.
    ffn_chunk_tokens: int | None = FFN_CHUNK_TOKENS  # feed-forward blocks over this many tokens
    device_map: str | None = None  # "auto": spread the layers over every visible GPU (accelerate)
    # Compile each decoder layer's regions outside attention (rbs_bench.models.fastpath); None:
    # on CUDA only. The logits equal the eager model's within rounding.
    compile: bool | None = None


@dataclass
class BenchmarkCfg:
    name: str = MISSING
    tasks: list[str] = field(default_factory=list)
    context_lengths: list[int] = field(default_factory=list)
    num_samples: int = 5
    seed: int = 42
    max_new_tokens: int | None = None  # None: the task's official budget
    data: dict[str, Any] = field(default_factory=dict)  # named data sources: hub ids or paths


@dataclass
class BudgetCfg:
    name: str = "default"
    knob: float | None = None  # the method's calibration knob, set by hand
    target: float | None = None  # measured density to calibrate to (rbs_bench.calibrate)


@dataclass
class CalibrationCfg:
    dir: str = "${results_dir}/calibration"  # where calibrated knobs are stored per model/method
    num_prompts: int = 50
    tolerance: float = 0.0001  # absolute error in density allowed at a target


@dataclass
class ForcedCfg:
    """The blocks every selector keeps whatever its scores, read by the method configs
    (`sink_blocks: ${forced.sink_blocks}`, ...) so that one experiment can scale them for all
    methods at once; `method.<field>=...` still sets one method's. Defaults: the paper's."""

    sink_blocks: int = 2  # first key blocks (rbs, centroid, flashprefill, full_l2, quest)
    window_blocks: int = 4  # local window ending at the diagonal, diagonal included (same)
    last_q_blocks: int = 2  # last query blocks kept dense (same)
    min_budget: int = 1024  # flexprefill's per-head floor in tokens


@dataclass
class LoggerCfg:
    name: str = "none"  # none | wandb
    project: str = "rbs-bench"
    entity: str | None = None
    mode: str = "offline"  # wandb mode: online | offline | disabled


@dataclass
class ObservationsCfg:
    """`+experiment=observations`: the mean-dilution analysis (rbs_bench.observations)."""

    synthetic: bool = False  # analyse rbs_bench.synthetic inputs instead of the model's prefill
    context_length: int = 4096  # prompt tokens (synthetic: seq_len)
    prompts: int = 2  # benchmark prompts of benchmark.tasks[0] (synthetic: seeds seed, seed+1..)
    layers: list[int] | None = None  # layer indices to analyse (None: every layer)
    heads: list[int] | None = None  # query heads to analyse (None: every head)
    block_size: int = 128  # query/key block size of the analysis, given to every method
    top_fraction: float = 0.05  # a query block's true top blocks: this share of its candidates
    knob_points: int = 10  # knob values per method curve
    # every compared method with a knob, in table order (MethodInfo.compare)
    methods: list[str] = field(default_factory=lambda: methods.compared())
    seed: int = 0  # synthetic only: seed of the first prompt
    generator: dict[str, Any] = field(default_factory=dict)  # synthetic.generate kwargs
    structure: dict[str, Any] = field(default_factory=dict)  # synthetic.Structure fields


@dataclass
class TimingCfg:
    """`+experiment=speed|memory|throughput|selector_time`: TTFT, prefill attention and memory of
    each method inside a random-weight HF model (rbs_bench.bench.ttft). None: device default."""

    model: str | None = None  # tiny | qwen3_30b_a3b | qwen3_32b; None: qwen3_30b_a3b on CUDA
    # A checkpoint directory loaded through from_pretrained (its own depth and dtype, e.g. the FP8
    # checkpoint `python -m rbs_bench.models.rehearsal write` makes); `model` names its rows.
    checkpoint: str | None = None
    device_map: str | None = None  # "auto": a checkpoint's layers over every visible GPU

    layers: int | None = None  # decoder layers; None: 4 (qwen3_30b_a3b) or the tiny model's 2
    contexts: list[int] | None = None  # prompt tokens; None: 32K-128K on CUDA, 1K and 2K on a CPU
    batches: list[int] = field(default_factory=lambda: [1])
    batch_contexts: list[int] | None = None  # contexts of batches > 1; None: the device's default
    batch_methods: list[str] | None = None  # methods of batches > 1; None: every method
    # dense, the method under study, then every other compared method in table order
    methods: list[str] = field(default_factory=lambda: timing_methods())
    target: float = 0.05  # measured density each method is calibrated to on the input
    warmup: int = 1  # untimed requests per method before the timed ones
    repeats: int | None = None  # timed requests (median reported); None: 3 on CUDA, 1 on a CPU
    batch_repeats: int | None = None  # timed requests of batch > 1 rows; None: repeats
    ffn_chunk_tokens: int | None = FFN_CHUNK_TOKENS  # feed-forward blocks' token chunk; 0: all
    compile: bool | None = None  # layers' regions outside attention compiled; None: on CUDA only
    sdpa_backend: str = "default"  # dense SDPA backend: default | flash | cudnn | efficient | math
    seed: int = 0  # random weights and prompt tokens
    out_dir: str | None = None  # None: <results_dir>/speed
    time_budget_s: float | None = None  # start no new row after this; None: 450 on CUDA, no limit
    retry_oom: bool = False  # rerun rows recorded as out of memory (after freeing memory)


@dataclass
class RunCfg:
    model: ModelCfg = MISSING
    method: Any = MISSING  # one of the generated method schemas
    benchmark: BenchmarkCfg = MISSING
    budget: BudgetCfg = MISSING
    calibration: CalibrationCfg = MISSING
    logger: LoggerCfg = MISSING
    forced: ForcedCfg = field(default_factory=ForcedCfg)
    results_dir: str = "results"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    executor: str = "auto"  # sparse executor: auto | reference | flex
    # Decode steps on a CUDA graph where the model allows it (models/graph_decode.py), checked
    # against eager decoding on the first prompt; None: on CUDA. The prefill is unchanged.
    decode_graph: bool | None = None
    progress: bool = True
    # Record each layer's attention recall (share of the dense softmax mass on the kept pairs):
    # one extra dense pass per layer, outside the timed regions.
    recall: bool = False
    # Start no new sample (runs) or calibration (rbs_bench.calibrate) once this many seconds have
    # passed since the process started; rerunning the command continues where it stopped.
    time_budget_s: float | None = None
    observations: ObservationsCfg | None = None  # set by +experiment=observations
    timing: TimingCfg | None = None  # set by +experiment=speed|memory|throughput|selector_time
    # Cells run besides the sweep, each a space-separated list of overrides (ruler_budget: the
    # dense reference, "method=dense budget=default"); left out when the command line pins the
    # method. Hydra's own -m sweep does not see them: run them as a command of their own there.
    reference: list[str] = field(default_factory=list)


def timing_methods() -> list[str]:
    """The timing experiments' default methods: dense, the headline method, the other compared
    methods in table order (MethodInfo.compare)."""
    first = [methods.DENSE, methods.headline()]
    return first + [m for m in methods.compared() if m not in first]


def method_schema(name: str) -> type:
    """The config dataclass of a registered method: `name` plus the selector's own fields."""
    cls = methods.method_class(name)
    hints = typing.get_type_hints(cls)
    spec = [("name", str, field(default=name))]
    spec += [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Cfg", spec)


def method_node(name: str):
    """The `method=<name>` config of a method without conf/method/<name>.yaml: its schema with the
    selector's defaults, and the forced-block fields it shares with ForcedCfg read from `forced.*`
    (as the shipped YAML files read them)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(method_schema(name))
    for f in dataclasses.fields(ForcedCfg):
        if f.name in node:
            node[f.name] = f"${{forced.{f.name}}}"
    return node


def register_schemas() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("rbs_bench_groups", groups_help, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunCfg)
    shipped = set(group_options("method"))
    for name in methods.available():
        cs.store(group="method", name=f"{name}_schema", node=method_schema(name))
        if name not in shipped:  # e.g. a plugin's method: its config comes from its dataclass
            cs.store(group="method", name=name, node=method_node(name))
    from rbs_bench import benchmarks

    shipped = set(group_options("benchmark"))
    for name in benchmarks.available():
        if name not in shipped:  # a plugin's benchmark: the schema's defaults, its first task
            tasks = list(benchmarks.get(name).TASKS)[:1]
            cs.store(group="benchmark", name=name, node=BenchmarkCfg(name=name, tasks=tasks))


def _generated_options(group: str) -> list[str]:
    """The options register_schemas generates (registered methods and benchmarks)."""
    from rbs_bench import benchmarks

    return {"method": methods.available, "benchmark": benchmarks.available}.get(group, list)()


def groups_help() -> str:
    """`group: option, ...` for each config group with YAML files under conf/ (--help's list),
    with the methods and benchmarks that installed plugins add (and any plugin skipped)."""
    from rbs_bench import benchmarks, plugins

    root = resources.files(CONFIG_MODULE)
    groups = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in ("hydra",))
    added = {"method": methods.plugin_names(), "benchmark": benchmarks.plugin_names()}
    lines = []
    for g in groups:
        if group_options(g):
            more = f" (plugins: {', '.join(added[g])})" if added.get(g) else ""
            lines.append(f"{g}: {', '.join(group_options(g))}{more}")
    for p in plugins.problems():
        lines.append(f"(skipped {p.kind} plugin {p.name}: {p.message})")
    return "\n".join(lines)


def group_options(group: str) -> list[str]:
    """Names of the YAML files of a config group (what `group=<name>` accepts)."""
    root = resources.files(CONFIG_MODULE).joinpath(group)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def explain(exc: BaseException) -> str:
    """One line saying what is wrong with a composed config and what the valid choices are."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    unknown_key = (ConfigKeyError, ConfigAttributeError)
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, (*unknown_key, ValidationError)):
        cause = cause.__cause__
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        if group in GROUPS:
            valid = set(group_options(group)) | set(_generated_options(group))
            return f"unknown {group} {option!r}; valid: {', '.join(sorted(valid))}"
    if isinstance(cause, unknown_key) and cause.full_key:
        typ = cause.object_type
        valid = [f.name for f in dataclasses.fields(typ)] if dataclasses.is_dataclass(typ) else []
        return _unknown_field(cause.full_key, valid)
    if isinstance(cause, ValidationError):
        first = str(cause).splitlines()[0]
        return f"{cause.full_key}: {first}" if cause.full_key else first
    return " ".join(str(exc).split())


def _unknown_field(key: str, valid: list[str]) -> str:
    where = key.rpartition(".")[0] or "the run config"
    tail = f"; valid fields: {', '.join(valid)}" if valid else ""
    return f"{key!r} is not a field of {where}{tail}"


def validate(cfg) -> None:
    """Catch fields that a `+key=value` override slipped past the schemas."""
    hints = typing.get_type_hints(RunCfg)
    nodes = [("", RunCfg), ("method", method_schema(cfg.method.name))]
    nodes += [(k, t) for k, t in hints.items() if dataclasses.is_dataclass(t)]
    for path, schema in nodes:
        node = cfg if not path else cfg[path]
        valid = [f.name for f in dataclasses.fields(schema)]
        extra = sorted(set(node.keys()) - set(valid) - {"hydra"})
        if extra:
            raise UserError(_unknown_field(f"{path}.{extra[0]}" if path else extra[0], valid))


COMMAND_OVERRIDES: list[str] | None = None  # the command line's overrides (checks.preflight)


def report_user_errors(fn, cfg) -> None:
    """Run fn(cfg); a UserError (or a full disk) becomes one line on stderr and exit status 2
    (errors.one_line)."""
    status = one_line(lambda: fn(cfg))
    if status:
        sys.exit(status)


def override_key(text: str) -> str:
    """The config key an override sets (`+method.alpha=0.3` -> `method.alpha`)."""
    return text.split("=", 1)[0].lstrip("+~")


def command_overrides() -> list[str]:
    """The overrides of this command: Hydra's (a running job, with the cell's sweep values under
    -m), else the command line's as `preflight` saw them, else none."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return list(COMMAND_OVERRIDES or [])


def reference_cells(cfg, overrides: list[str]) -> list[list[str]]:
    """The config's `reference` cells as override lists, unless the overrides pin the method."""
    if "method" in {override_key(o) for o in overrides}:
        return []
    return [str(cell).split() for cell in cfg.get("reference") or []]


def sweep_cells(params, overrides: list[str]) -> list[list[str]]:
    """An experiment's sweep (`hydra.sweeper.params`), less the keys the command line pins, as
    one list of overrides per cell."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    pinned = {override_key(o) for o in overrides}
    axes = []
    for key, value in dict(params or {}).items():
        if key in pinned:
            continue
        (ov,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        axes.append([f"{key}={v}" for v in values])
    return [list(c) for c in itertools.product(*axes)]


def grid_overrides(hc) -> list[list[str]]:
    """The experiment's sweep, less the keys the command line pins, as lists of overrides."""
    return sweep_cells(hc.sweeper.get("params"), list(hc.overrides.task))


def compose_cell(overrides: list[str], hydra_config: bool = False):
    """The composed config of these overrides outside a Hydra run (with its `hydra.*` keys only
    when `hydra_config`); a bad override is the user's input: one line (`explain`)."""
    from hydra import compose, initialize_config_module

    register_schemas()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return compose(
                config_name="config", overrides=overrides, return_hydra_config=hydra_config
            )
    except Exception as exc:
        raise UserError(explain(exc)) from None
