"""One cell of an experiment: a model, a method at a budget, a benchmark; one record per sample.

Records go to `<results_dir>/runs/<experiment>/<model>/<method>/<budget>/records.jsonl`; a rerun of
the same command skips every sample already recorded there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import Timeout
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rbs_bench import benchmarks, methods, models
from rbs_bench.config import UserError, out_of_time
from rbs_bench.execution import resolve_executor
from rbs_bench.models.hf_attention import install, uninstall
from rbs_bench.records import RecordStore, cell_lock, check_settings, write_settings

MiB = 2**20
LOCK_POLL_S = 10  # how often a run waiting for a cell's lock checks its time budget


def cell_dir(cfg: DictConfig, experiment: str) -> Path:
    return (
        Path(cfg.results_dir)
        / "runs"
        / experiment
        / cfg.model.name
        / cfg.method.name
        / cfg.budget.name
    )


def experiment_dir(cfg: DictConfig, experiment: str) -> Path:
    return Path(cfg.results_dir) / "runs" / experiment / cfg.model.name


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
            from rbs_bench.calibrate import load_knob

            return sel.with_knob(load_knob(cfg))
    except ValueError as e:
        raise UserError(str(e)) from None
    return sel


def _refuse_overridden_knob_fields(cfg: DictConfig, sel) -> None:
    """A budget sets the fields its knob moves (rbs: alpha_base and alpha_rescue); a value given
    for one of them would be replaced without a word, so it stops the run instead."""
    from rbs_bench.budget import knob_fields

    defaults = {f.name: f.default for f in dataclasses.fields(sel)}
    given = sorted(
        f
        for f in knob_fields(sel)
        if f in defaults and f in cfg.method and getattr(sel, f) != defaults[f]
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


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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


def _check_benchmark(cfg: DictConfig) -> None:
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


@torch.inference_mode()
def greedy_generate(
    model, input_ids: torch.Tensor, max_new_tokens: int, eos: set[int], **prefill_inputs
):
    """Prefill + greedy decode. Returns (new token ids, seconds to first token, seconds total).

    `prefill_inputs` (a video's pixels, grid and token types) go to the prefill call only."""
    from rbs_bench.models.vision import reset_position_state

    reset_position_state(model)  # a multimodal model's RoPE offset belongs to one prompt
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    # The last position's logits only: a 128K prompt's full logits (N x vocab) would take more
    # memory than the KV cache of every layer.
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **prefill_inputs)
    logits = out.logits[:, -1]
    if not torch.isfinite(logits).all():
        raise UserError(
            "the model produced NaN/Inf logits in prefill; check model.dtype "
            "(float16 can overflow) and the checkpoint"
        )
    token = logits.argmax(-1, keepdim=True)  # [1, 1]
    sync()
    ttft = time.perf_counter() - t0
    new = [int(token)]
    past = out.past_key_values
    while len(new) < max_new_tokens and new[-1] not in eos:
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(token))
    sync()
    return new, ttft, time.perf_counter() - t0


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids


def run_settings(cfg: DictConfig, selector, bench) -> dict:
    """What every record of the cell must share, flat (`method.alpha_base`, `budget.target`, ...):
    the settings `records.check_settings` compares a rerun's with."""
    return _flatten(
        {
            "model": models.identity(cfg.model),
            "method": selector.fields() | {"name": selector.name},
            "budget.knob": cfg.budget.knob,
            "budget.target": cfg.budget.target,
            "benchmark": {
                "name": cfg.benchmark.name,
                "version": bench.VERSION,
                "seed": cfg.benchmark.seed,
                "max_new_tokens": cfg.benchmark.max_new_tokens,
            },
        }
    )


def _acquire(lock, cfg: DictConfig, label: str) -> bool:
    """Take the cell's lock, waiting while another run holds it; False if the run's time budget
    ends first."""
    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        print(
            f"{label}: another run holds {lock.lock_file}; waiting for it to finish "
            "(the samples it records are skipped here)",
            flush=True,
        )
    while not out_of_time(cfg):
        try:
            lock.acquire(timeout=LOCK_POLL_S)
            return True
        except Timeout:
            pass
    print(
        f"{label}: time_budget_s={cfg.time_budget_s:g} reached while waiting for {lock.lock_file}"
    )
    return False


def run_cell(cfg: DictConfig, experiment: str, session: Session, logger=None) -> Path:
    """Run every pending sample of one cell; return the records file.

    The cell's lock (`<cell dir>/.lock`, records.py) is held from the settings check to the last
    record, so a second run of the same cell waits, then finds the first one's samples recorded
    and skips them."""
    _check_benchmark(cfg)
    selector = build_selector(cfg)
    bench = benchmarks.get(cfg.benchmark.name)
    out_dir = cell_dir(cfg, experiment)
    settings = run_settings(cfg, selector, bench)
    label = f"{experiment}/{cfg.model.name}/{selector.name}/{cfg.budget.name}"
    lock = cell_lock(out_dir)
    if not _acquire(lock, cfg, label):
        return out_dir / "records.jsonl"
    try:
        return _run_locked(cfg, experiment, session, logger, selector, bench, settings, label)
    finally:
        lock.release()


def _run_locked(cfg, experiment, session, logger, selector, bench, settings, label) -> Path:
    out_dir = cell_dir(cfg, experiment)
    store = RecordStore(out_dir / "records.jsonl")
    check_settings(store, settings)  # before the model loads: a mismatch costs nothing
    loaded = session.load(cfg)
    executor = resolve_executor(cfg.executor, loaded.device)
    work = [
        (s, n)
        for task in cfg.benchmark.tasks
        for n in cfg.benchmark.context_lengths
        for s in session.samples(cfg, loaded, task, n)
    ]
    pending = [(s, n) for s, n in work if not store.done((s.task, n, s.index))]
    for s, n in work:
        old = store.done((s.task, n, s.index))
        if old and old["prompt_sha1"] != _prompt_sha1(s):
            raise UserError(
                f"{store.path} holds {s.task} sample {s.index} at {n} tokens made from a "
                f"different prompt than this run's (benchmark version {old['benchmark_version']}, "
                "or the benchmark's data or the tokenizer changed); use results_dir=... or "
                "budget.name=... for this run, or delete that file"
            )
    if not pending:
        print(f"{label}: all {len(work)} samples already recorded")
        write_settings(store, settings)  # (re)builds a missing cell.json from the checked records
        return store.path
    recorder = install(loaded.model, selector, executor, recall=bool(cfg.get("recall")))
    eos = _eos_ids(loaded.model, loaded.tokenizer)
    bar = tqdm(pending, desc=label, unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    warmed = set()
    try:
        for sample, length in bar:
            if out_of_time(cfg):
                bar.close()
                print(
                    f"{label}: time_budget_s={cfg.time_budget_s:g} reached; rerun the same "
                    "command to continue (finished samples are kept)"
                )
                break
            if store.done((sample.task, length, sample.index)):
                continue
            if loaded.device.type == "cuda" and length not in warmed:
                _warm_up(loaded, sample)  # compile/autotune outside the timed region
                warmed.add(length)
            rec = _run_sample(
                cfg, experiment, selector, bench, loaded, recorder, eos, sample, length
            )
            if not store.append(rec):
                continue  # recorded meanwhile by a run that did not take the cell lock
            write_settings(store, settings)  # cell.json once a record exists, not before
            if logger is not None:
                logger.log_sample(rec)
            bar.set_postfix(score=f"{rec['score']:.0f}", density=f"{rec['density']:.3f}")
    finally:
        uninstall(loaded.model)
    return store.path


def _input_ids(loaded: Loaded, sample) -> torch.Tensor:
    """[1, L] token ids of the prompt as fitted (no special tokens added)."""
    if getattr(sample, "video", None) is not None:
        raise UserError(
            f"{sample.task} sample {sample.index} carries a video, which only benchmark runs "
            f"decode; calibrate and analyse on a text benchmark"
        )
    return loaded.tokenizer(sample.prompt, add_special_tokens=False, return_tensors="pt").input_ids


def _model_inputs(loaded: Loaded, sample) -> dict:
    """The prefill inputs of a sample on the model's device: `input_ids` [1, L], and for a
    sample with a video its decoded frames through the model's processor (L then counts the
    video tokens)."""
    video = getattr(sample, "video", None)
    if video is None:
        inputs = {"input_ids": _input_ids(loaded, sample)}
    elif loaded.processor is None:
        raise UserError("video samples need a vision-language model, e.g. model=tiny_vl")
    else:
        try:
            inputs = loaded.processor.inputs(loaded.tokenizer, sample.prompt, video)
        except ValueError as e:
            raise UserError(f"{sample.task} sample {sample.index}: {e}") from None
    return {k: v.to(loaded.device) for k, v in inputs.items()}


@torch.inference_mode()
def _warm_up(loaded: Loaded, sample) -> None:
    """One untimed prefill of a prompt of this length, so kernel compilation is not timed."""
    from rbs_bench.models.vision import reset_position_state

    reset_position_state(loaded.model)
    loaded.model(**_model_inputs(loaded, sample), use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize(loaded.device)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _prompt_sha1(sample) -> str:
    """Hash of the prompt, and of the sampled frames for a sample with a video."""
    video = getattr(sample, "video", None)
    return _sha1(sample.prompt if video is None else f"{sample.prompt}\n{video.key()}")


def _run_sample(cfg, experiment, selector, bench, loaded, recorder, eos, sample, length) -> dict:
    inputs = _model_inputs(loaded, sample)
    ids = inputs.pop("input_ids")
    if inputs and ids.shape[1] + sample.max_new_tokens > length:
        raise UserError(
            f"{sample.task} sample {sample.index} takes {ids.shape[1]} tokens with its video, "
            f"+{sample.max_new_tokens} new > context length {length}; raise "
            f"benchmark.context_lengths or lower benchmark.data.num_frames"
        )
    recorder.reset()
    gpus = models.cuda_devices(loaded.model)
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    new, ttft, total = greedy_generate(loaded.model, ids, sample.max_new_tokens, eos, **inputs)
    stats = recorder.summary()
    # the whole request (prefill with its cache, then decoding), on the busiest GPU
    memory = {"peak_allocated_mib": None, "peak_reserved_mib": None}
    if gpus:
        memory["peak_allocated_mib"] = round(max(map(torch.cuda.max_memory_allocated, gpus)) / MiB)
        memory["peak_reserved_mib"] = round(max(map(torch.cuda.max_memory_reserved, gpus)) / MiB)
        if len(gpus) > 1:
            memory["gpus"] = len(gpus)
    pred = loaded.tokenizer.decode(new, skip_special_tokens=True)
    return {
        "experiment": experiment,
        "model": cfg.model.name,
        "method": selector.name,
        "method_fields": selector.fields(),
        "budget": cfg.budget.name,
        "budget_knob": cfg.budget.knob,
        "budget_target": cfg.budget.target,
        "benchmark": cfg.benchmark.name,
        "benchmark_version": bench.VERSION,
        "benchmark_seed": cfg.benchmark.seed,
        "max_new_tokens": cfg.benchmark.max_new_tokens,
        "model_identity": models.identity(cfg.model),
        "task": sample.task,
        "context_length": length,
        "index": sample.index,
        "input_tokens": int(ids.shape[1]),
        "prompt_sha1": _prompt_sha1(sample),
        "density": stats["density_mean"],
        "density_layers_heads": stats["density_layers_heads"],
        **(
            {"recall": stats["recall_mean"], "recall_layers": stats["recall_layers"]}
            if "recall_mean" in stats
            else {}
        ),
        "prediction": pred,
        "references": list(sample.references),
        "meta": dict(getattr(sample, "meta", None) or {}),  # e.g. a benchmark's categories
        "score": bench.score_one(sample.task, pred, sample.references),
        "ttft_s": round(ttft, 6),
        "generate_s": round(total, 6),
        "decode_s": round(total - ttft, 6),
        **memory,
        "selector_s": round(stats["selector_s"], 6),
        "attention_s": round(stats["attention_s"], 6),
        "new_tokens": len(new),
        "device": str(loaded.device),
        "gpu": torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else None,
        "executor": resolve_executor(cfg.executor, loaded.device),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
