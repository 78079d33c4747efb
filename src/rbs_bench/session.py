"""What every entry point builds from a config before it runs anything: the device, the method
(with its budget applied), the loaded model and benchmark samples of a process, and where a cell's
records go.

The grid runner (runner.py), calibration (calibrate.py), the observations (observations.py), the
up-front checks (checks.py) and the timing benchmarks (bench/) all stand on this module; it imports
none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rbs_bench import benchmarks, methods, models, paths
from rbs_bench.budget import knob_fields
from rbs_bench.calibrations import load_knob
from rbs_bench.config import command_overrides, override_key
from rbs_bench.errors import UserError


def cell_dir(cfg: DictConfig, experiment: str) -> Path:
    """<results_dir>/runs/<experiment>/<model>/<method>/<budget> (paths.cell_dir)."""
    return paths.cell_dir(
        cfg.results_dir, experiment, cfg.model.name, cfg.method.name, cfg.budget.name
    )


def experiment_dir(cfg: DictConfig, experiment: str) -> Path:
    """<results_dir>/runs/<experiment>/<model> (paths.experiment_dir)."""
    return paths.experiment_dir(cfg.results_dir, experiment, cfg.model.name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name} but no CUDA device is visible; use device=cpu")
    return torch.device(name)


def build_method(cfg: DictConfig):
    """The method at its configured fields (interpolations such as `${forced.*}` resolved), no
    budget applied."""
    fields = OmegaConf.to_container(cfg.method, resolve=True)
    try:
        return methods.build(cfg.method.name, **{k: v for k, v in fields.items() if k != "name"})
    except ValueError as e:
        raise UserError(str(e)) from None


def build_selector(cfg: DictConfig, apply_budget: bool = True):
    """The method of this cell, with its budget's knob (set by hand or calibrated) applied."""
    budget = cfg.budget
    if budget.knob is not None and budget.target is not None:
        raise UserError(f"budget {budget.name!r} sets both knob and target; keep one")
    sel = build_method(cfg)
    if not apply_budget or sel.knob is None:
        return sel  # dense has nothing to set: every budget means density 1
    if budget.knob is not None or budget.target is not None:
        _refuse_overridden_knob_fields(cfg, sel)
    try:
        if budget.knob is not None:
            return sel.with_knob(budget.knob)
        if budget.target is not None:
            return sel.with_knob(load_knob(cfg, sel))
    except ValueError as e:
        raise UserError(str(e)) from None
    return sel


def _refuse_overridden_knob_fields(cfg: DictConfig, sel) -> None:
    """A budget sets the fields its knob moves (rbs: alpha_base and alpha_rescue); a value given
    for one of them, on the command line (even the default's own value) or by a config that
    changes the default, would be replaced without a word, so it stops the run instead."""
    defaults = {f.name: f.default for f in dataclasses.fields(sel)}
    named = {override_key(o) for o in command_overrides()}
    given = sorted(
        f
        for f in knob_fields(sel)
        if f in defaults
        and f in cfg.method
        and (getattr(sel, f) != defaults[f] or f"method.{f}" in named)
    )
    if given:
        how = (
            f"its knob {sel.knob}={cfg.budget.knob:g}"
            if cfg.budget.knob is not None
            else f"the {sel.knob} calibrated to density {cfg.budget.target:g}"
        )
        fields = ", ".join(f"method.{f}={getattr(sel, f)!r}" for f in given)
        raise UserError(
            f"{fields} would be replaced by budget {cfg.budget.name!r}: {how} sets "
            f"{', '.join(f'method.{f}' for f in sorted(knob_fields(sel)))}; drop {fields} to run "
            "at the budget, or run at the fields as given with budget=default"
        )


@dataclass
class Loaded:
    """What cells of one process share: the model and the benchmark samples."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    samples: dict  # (task, length) -> list[Sample]
    processor: object = None  # video inputs of a vision-language model (models.vision)


class Session:
    """Caches the model and generated samples across the cells a process runs."""

    def __init__(self):
        self._model_key = None
        self._loaded: Loaded | None = None
        self._warmed: set = set()  # (model key, prompt length)

    def load(self, cfg: DictConfig) -> Loaded:
        key = OmegaConf.to_yaml(cfg.model) + cfg.device
        if key != self._model_key:
            device = resolve_device(cfg.device)
            try:
                model, tok = models.load(cfg.model, device=device)
                processor = models.load_video_processor(cfg.model, model, tok)
            except ValueError as e:
                raise UserError(str(e)) from None
            # inputs go where the embeddings are (the first GPU of a model spread over several)
            device = model.get_input_embeddings().weight.device
            self._loaded = Loaded(model, tok, device, {}, processor)
            self._model_key = key
        return self._loaded

    def warm_once(self, loaded: Loaded, sample) -> None:
        """`warm_up` on CUDA once per loaded model and prompt length (calibration's searches,
        whose seconds then hold no compilation)."""
        if loaded.device.type != "cuda":
            return
        key = (self._model_key, len(input_ids(loaded, sample)[0]))
        if key not in self._warmed:
            warm_up(loaded, sample)
            self._warmed.add(key)

    def samples(self, cfg: DictConfig, loaded: Loaded, task: str, length: int):
        bench = benchmarks.get(cfg.benchmark.name)
        key = (OmegaConf.to_yaml(cfg.benchmark), task, length, OmegaConf.to_yaml(cfg.model))
        if key not in loaded.samples:
            wrap = lambda text, video=False: models.wrap_prompt(
                loaded.tokenizer, cfg.model, text, video=video, processor=loaded.processor
            )
            try:
                loaded.samples[key] = bench.generate(
                    task,
                    length,
                    cfg.benchmark.num_samples,
                    models.encoder(loaded.tokenizer),
                    seed=cfg.benchmark.seed,
                    wrap=wrap,
                    max_new_tokens=cfg.benchmark.max_new_tokens,
                    data=OmegaConf.to_container(cfg.benchmark.data, resolve=True),
                )
            except ValueError as e:
                raise UserError(str(e)) from None
        return loaded.samples[key]


def check_benchmark(cfg: DictConfig) -> None:
    """Tasks, data sources and lengths, checked before a model is loaded."""
    bench = benchmarks.get(cfg.benchmark.name)
    data = OmegaConf.to_container(cfg.benchmark.data, resolve=True)
    for task in cfg.benchmark.tasks:
        if task not in bench.TASKS:
            raise UserError(
                f"unknown {cfg.benchmark.name} task {task!r}; "
                f"valid: {', '.join(sorted(bench.TASKS))}"
            )
        if hasattr(bench, "check_data"):  # a missing source fails now, not after model load
            try:
                bench.check_data(task, data)
            except ValueError as e:
                raise UserError(str(e)) from None
    for n in cfg.benchmark.context_lengths:
        if n > cfg.model.max_context:
            raise UserError(
                f"context length {n} exceeds model.max_context={cfg.model.max_context} of "
                f"{cfg.model.name}; lower benchmark.context_lengths"
            )
    if not cfg.benchmark.context_lengths or not cfg.benchmark.tasks:
        raise UserError("benchmark.tasks and benchmark.context_lengths must not be empty")


def input_ids(loaded: Loaded, sample) -> torch.Tensor:
    """[1, L] token ids of the prompt as fitted (no special tokens added)."""
    if getattr(sample, "video", None) is not None:
        raise UserError(
            f"{sample.task} sample {sample.index} carries a video, which only benchmark runs "
            f"decode; calibrate and analyse on a text benchmark"
        )
    return loaded.tokenizer(sample.prompt, add_special_tokens=False, return_tensors="pt").input_ids


def model_inputs(loaded: Loaded, sample) -> dict:
    """The prefill inputs of a sample on the model's device: `input_ids` [1, L], and for a
    sample with a video its decoded frames through the model's processor (L then counts the
    video tokens)."""
    video = getattr(sample, "video", None)
    if video is None:
        inputs = {"input_ids": input_ids(loaded, sample)}
    elif loaded.processor is None:
        raise UserError("video samples need a vision-language model, e.g. model=tiny_vl")
    else:
        try:
            inputs = loaded.processor.inputs(loaded.tokenizer, sample.prompt, video)
        except ValueError as e:
            raise UserError(f"{sample.task} sample {sample.index}: {e}") from None
    return {k: v.to(loaded.device) for k, v in inputs.items()}


@torch.inference_mode()
def warm_up(loaded: Loaded, sample, graphs: bool | None = None) -> None:
    """One untimed prefill of a prompt of this length and a few decode steps, so that kernel
    compilation and autotuning, the compiled layers' graphs and the decode step's CUDA graph (its
    capture and its check against eager decoding, `models.graph_decode`) are not timed."""
    from rbs_bench.models.generate import greedy_generate

    inputs = model_inputs(loaded, sample)
    ids = inputs.pop("input_ids")
    greedy_generate(loaded.model, ids, WARM_UP_TOKENS, set(), graphs, **inputs)
    torch.cuda.synchronize(loaded.device)


WARM_UP_TOKENS = 4  # the prefill's token and three decode steps
