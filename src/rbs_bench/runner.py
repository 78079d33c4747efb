"""One cell of an experiment: a model, a method at a budget, a benchmark; one record per sample.

Records go to `<results_dir>/runs/<experiment>/<model>/<method>/<budget>/records.jsonl`; a rerun of
the same command skips every sample already recorded there.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from filelock import Timeout
from omegaconf import DictConfig
from tqdm import tqdm

from rbs_bench import benchmarks, models, paths
from rbs_bench.config import out_of_time, since_start
from rbs_bench.errors import UserError
from rbs_bench.execution import resolve_executor
from rbs_bench.models import fastpath
from rbs_bench.models.generate import eos_ids, greedy_generate
from rbs_bench.models.hf_attention import install, uninstall
from rbs_bench.paths import RECORDS
from rbs_bench.records import RecordStore, cell_lock, check_settings, write_settings
from rbs_bench.session import (
    Session,
    build_selector,
    cell_dir,
    check_benchmark,
    model_inputs,
    warm_up,
)

MiB = 2**20
LOCK_POLL_S = 10  # how often a run waiting for a cell's lock checks its time budget


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
    paths.confine(cfg.results_dir)  # no write of the cell leaves results_dir through a link
    check_benchmark(cfg)
    selector = build_selector(cfg)
    bench = benchmarks.get(cfg.benchmark.name)
    out_dir = cell_dir(cfg, experiment)
    try:
        settings = run_settings(cfg, selector, bench)
    except ValueError as e:  # the model's local files (models.weights_digest)
        raise UserError(str(e)) from None
    label = f"{experiment}/{cfg.model.name}/{selector.name}/{cfg.budget.name}"
    lock = cell_lock(out_dir)
    if not _acquire(lock, cfg, label):
        return out_dir / RECORDS
    try:
        return _run_locked(cfg, experiment, session, logger, selector, bench, settings, label)
    finally:
        lock.release()


def _run_locked(cfg, experiment, session, logger, selector, bench, settings, label) -> Path:
    out_dir = cell_dir(cfg, experiment)
    # bound to its cell: a record of another cell, a second one of a sample, is refused here
    store = RecordStore(out_dir / RECORDS, cell=paths.cell_identity(out_dir / RECORDS))
    check_settings(store, settings)  # before the model loads: a mismatch costs nothing
    if out_of_time(cfg):  # loading a model would spend time the budget no longer has
        print(
            f"{label}: time_budget_s={cfg.time_budget_s:g} reached before this cell started; "
            "rerun the same command to continue (finished samples are kept)"
        )
        return store.path
    t_load = since_start()
    loaded = session.load(cfg)
    t_prompts = since_start()
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
    if not cfg.progress:  # a log (parallel's cells): when the cell was ready, and why
        now = since_start()
        print(
            f"{label}: {len(pending)} of {len(work)} samples to run, {now:.1f} s after the start "
            f"(the model {t_prompts - t_load:.1f} s, the prompts {now - t_prompts:.1f} s)",
            flush=True,
        )
    if not pending:
        print(f"{label}: all {len(work)} samples already recorded")
        write_settings(store, settings)  # (re)builds a missing cell.json from the checked records
        return store.path
    recorder = install(loaded.model, selector, executor, recall=bool(cfg.get("recall")))
    eos = eos_ids(loaded.model, loaded.tokenizer)
    bar = tqdm(pending, desc=label, unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    # the bar shows the cell's running mean score: the samples recorded before, then this run's
    done = [store.done((s.task, n, s.index)) for s, n in work]
    scores = [rec["score"] for rec in done if rec]
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
                t_warm = time.perf_counter()
                warm_up(loaded, sample, cfg.decode_graph)  # compile/autotune/capture untimed
                warmed.add(length)
                print(
                    f"{label}: warmed up at {length} tokens in "
                    f"{time.perf_counter() - t_warm:.1f} s, {since_start():.1f} s after the start",
                    flush=True,
                )
            rec = _run_sample(
                cfg, experiment, selector, bench, loaded, recorder, eos, sample, length
            )
            if not store.append(rec):
                continue  # recorded meanwhile by a run that did not take the cell lock
            write_settings(store, settings)  # cell.json once a record exists, not before
            if logger is not None:
                logger.log_sample(rec)
            scores.append(rec["score"])
            mean = sum(scores) / len(scores)
            bar.set_postfix(density=f"{rec['density']:.3f}", mean_score=f"{mean:.1f}")
    finally:
        uninstall(loaded.model)
    return store.path


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _prompt_sha1(sample) -> str:
    """Hash of the prompt, and of the sampled frames for a sample with a video."""
    video = getattr(sample, "video", None)
    return _sha1(sample.prompt if video is None else f"{sample.prompt}\n{video.key()}")


def _run_sample(cfg, experiment, selector, bench, loaded, recorder, eos, sample, length) -> dict:
    inputs = model_inputs(loaded, sample)
    ids = inputs.pop("input_ids")
    # a vision-language prompt's image/video tokens (mm_token_type_ids: 1 image, 2 video)
    types = inputs.get("mm_token_type_ids")
    visual = None if types is None else int((types != 0).sum())
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
    new, ttft, total, decode = greedy_generate(
        loaded.model, ids, sample.max_new_tokens, eos, cfg.decode_graph, **inputs
    )
    stats = recorder.summary()
    # the recall passes (recall=true) run inside the prefill forward: their seconds are recorded
    # on their own and left out of the prefill's and the request's time
    recall_s = stats.get("recall_s", 0.0)
    ttft, total = ttft - recall_s, total - recall_s
    # the whole request (prefill with its cache, then decoding), on the busiest GPU
    memory = {"peak_allocated_mib": None, "peak_reserved_mib": None}
    if gpus:
        memory["peak_allocated_mib"] = round(max(map(torch.cuda.max_memory_allocated, gpus)) / MiB)
        memory["peak_reserved_mib"] = round(max(map(torch.cuda.max_memory_reserved, gpus)) / MiB)
        memory["gpus"] = len(gpus)  # the GPUs holding the model (device_map=auto: several)
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
        **(
            {"visual_tokens": visual, "visual_token_share": round(visual / ids.shape[1], 6)}
            if visual is not None
            else {}
        ),
        "prompt_sha1": _prompt_sha1(sample),
        "density": stats["density_mean"],
        "density_layers_heads": stats["density_layers_heads"],
        **(
            {
                "recall": stats["recall_mean"],
                "recall_layers": stats["recall_layers"],
                "recall_s": round(recall_s, 6),
            }
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
        # how the model ran (not part of the records' fingerprint: none changes a prediction
        # beyond rounding): its feed-forward token chunk, whether its layers were compiled, and
        # whether its tokens after the first were decoded on a CUDA graph (models/graph_decode.py)
        "ffn_chunk_tokens": cfg.model.ffn_chunk_tokens,
        "compiled": fastpath.is_installed(loaded.model),
        "decode": decode,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
