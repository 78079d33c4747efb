"""Train the tiny retrieval LM: `python -m rbs_bench.tinylm.train --out runs/tinylm`.

A Qwen3ForCausalLM (byte-level vocabulary, GQA, head dim 64) trained on the synthetic mixture of
`rbs_bench.tinylm.data`, with a length curriculum: stages of packed rows of 512 up to 16K tokens,
a constant number of tokens per step. The loss is the mean cross-entropy of the answer tokens,
plus `--recall-weight` times that of the recall targets (restated values inside a context) and
`--context-weight` times that of the other context tokens. `--init DIR` starts from a trained
model instead of random weights (a later stage, e.g. with another `--mixture` / `--fillers`).

Reproducible: the batch of step i is a function of (seed, i, mixture, fillers) only, the weights
start from the seed (or --init), and deterministic kernels are requested, so the same command on
the same hardware and software gives the same weights bit for bit (`run.json` records the
resolved command, the versions and whether determinism held). Resumable: a checkpoint is written
every `--checkpoint-every` steps and at the end; rerunning the command continues from it.

Outputs under --out: run.json (resolved settings), log.jsonl (loss and answer accuracy, overall
and per task), checkpoint.pt, loss_curve.png, summary.json and model/ (bf16 safetensors, config,
tokenizer: loadable with `from_pretrained`).

`--minutes M` sizes the stages to about M minutes of training on this machine: each stage's step
time is measured on a throwaway model first, and the resulting `--stages` string is recorded in
run.json (pass it explicitly to reproduce the run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from rbs_bench.models.tiny import TINY_CONFIG
from rbs_bench.tinylm import data

# The shipped model's architecture (Qwen3Config kwargs): the random test model's, wider and deeper.
MODEL_CONFIG: dict = {
    **TINY_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
}

# Stage lengths and their share of the training time (--minutes) for the full preset.
CURRICULUM = ((512, 0.08), (1024, 0.12), (2048, 0.15), (4096, 0.20), (8192, 0.30), (16384, 0.15))

PRESETS: dict[str, dict] = {
    "full": {"tokens_per_step": 32768, "model": {}},
    # A few seconds on a CPU: for tests and dry runs of the whole pipeline.
    "micro": {
        "tokens_per_step": 2048,
        "model": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
        "stages": "256:4,512:4",
    },
}


@dataclass
class Settings:
    out: str
    seed: int = 0
    preset: str = "full"
    stages: str | None = None  # "length:steps,..."; None: from --minutes or the preset
    minutes: float | None = None
    tokens_per_step: int | None = None
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    context_weight: float = 0.2
    recall_weight: float = 1.0
    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    rope_theta: float | None = None
    init: str | None = None  # start from this model directory's weights (a later stage)
    mixture: str | None = None  # "task=weight,..."; None: data.MIXTURE
    fillers: str | None = None  # "kind=count,..."; None: data.FILLERS
    device: str = "auto"
    workers: int = 8
    log_every: int = 20
    checkpoint_every: int = 500
    deterministic: bool = True
    model: dict = field(default_factory=dict)  # resolved Qwen3Config kwargs

    def resolved_model(self) -> dict:
        cfg = json.loads(json.dumps(MODEL_CONFIG))
        cfg.update(PRESETS[self.preset]["model"])
        for key, value in (
            ("num_hidden_layers", self.layers),
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
        ):
            if value is not None:
                cfg[key] = value
        if self.rope_theta is not None:
            cfg["rope_parameters"]["rope_theta"] = self.rope_theta
        return cfg


class UsageError(Exception):
    """A bad command line: printed as one line."""


def parse_weights(text: str | None, valid, what: str, cast=float) -> dict | None:
    """ "a=1,b=2" -> {"a": 1, "b": 2} in `valid` order (None stays None)."""
    if text is None:
        return None
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in valid:
            raise UsageError(f"--{what}: unknown {name!r}; valid: {', '.join(valid)}")
        try:
            out[name] = cast(value)
        except ValueError:
            raise UsageError(f"--{what}: {part!r} is not name=number") from None
        if out[name] < 0:
            raise UsageError(f"--{what}: {part!r} is negative")
    if not any(out.values()):
        raise UsageError(f"--{what}: every weight is zero")
    return {k: out[k] for k in valid if k in out}


def parse_stages(text: str, tokens_per_step: int) -> list[tuple[int, int, int]]:
    """ "512:100,1024:200" -> [(length, rows, steps)], rows = tokens_per_step // length."""
    stages = []
    for part in text.split(","):
        try:
            length, steps = (int(x) for x in part.split(":"))
        except ValueError:
            raise UsageError(f"--stages: {part!r} is not length:steps (e.g. 1024:300)") from None
        if length < data.MIN_EXAMPLE or steps < 1:
            raise UsageError(f"--stages: {part!r}: length >= {data.MIN_EXAMPLE}, steps >= 1")
        if tokens_per_step < length:
            raise UsageError(f"--tokens-per-step {tokens_per_step} is below stage length {length}")
        stages.append((length, tokens_per_step // length, steps))
    return stages


def schedule(stages: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(length, rows) of every step."""
    return [(length, rows) for length, rows, steps in stages for _ in range(steps)]


def lr_at(step: int, total: int, s: Settings) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, total - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------
# Model, data, steps


def build_model(model_cfg: dict, seed: int, init: str | None = None):
    """Random init from `seed`, or the weights of the model directory `init` (fp32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**model_cfg)
    config._attn_implementation = "sdpa"
    if init is None:
        return Qwen3ForCausalLM(config)
    model = Qwen3ForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    mine, theirs = config.to_dict(), model.config.to_dict()
    keys = [k for k in model_cfg if k not in ("bos_token_id", "eos_token_id", "pad_token_id")]
    diff = [k for k in keys if mine.get(k) != theirs.get(k)]
    if diff:
        raise UsageError(f"--init {init}: its config differs in {', '.join(diff)}")
    return model


class StepBatches:
    """Map-style dataset: item i is the batch of step i (a pure function of seed and i)."""

    def __init__(self, seed: int, steps: list[tuple[int, int]], mixture=None, fillers=None):
        self.seed, self.steps, self.mixture, self.fillers = seed, steps, mixture, fillers

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int):
        import torch

        length, rows = self.steps[i]
        b = data.batch(self.seed, i, rows, length, self.mixture, self.fillers)
        return i, torch.from_numpy(b["ids"]), torch.from_numpy(b["task"])


def loss_terms(model, ids, task, s: Settings, autocast: bool):
    """(loss, answer loss, recall loss, context loss, logits) of one batch; ids/task [B, L + 1].

    Each part is a mean over its tokens: answers (after the answer prefix), recall targets
    (restated values inside a context) and the other context tokens."""
    import torch
    import torch.nn.functional as F

    inp, tgt, ttask = ids[:, :-1], ids[:, 1:], task[:, 1:]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=inp, use_cache=False).logits  # [B, L, V]
    ce = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
    ).view_as(tgt)
    ans = ((ttask >= 0) & (ttask != data.RECALL)).float()
    rec = (ttask == data.RECALL).float()
    ctx = (ttask == -1).float()
    l_ans = (ce * ans).sum() / ans.sum().clamp(min=1)
    l_rec = (ce * rec).sum() / rec.sum().clamp(min=1)
    l_ctx = (ce * ctx).sum() / ctx.sum().clamp(min=1)
    loss = l_ans + s.recall_weight * l_rec + s.context_weight * l_ctx
    return loss, l_ans, l_rec, l_ctx, logits


def answer_accuracy(logits, ids, task) -> dict:
    """Token accuracy and exact-answer accuracy (every token of an answer right), per task."""
    tgt, ttask = ids[:, 1:], task[:, 1:]
    correct = (logits.argmax(-1) == tgt).cpu().numpy()
    ttask = ttask.cpu().numpy()
    out: dict = {}
    exact: dict[str, list[bool]] = {}
    for r in range(ttask.shape[0]):
        t, c = ttask[r], correct[r]
        is_ans = t >= 0
        # answers are contiguous runs of answer tokens; a run ends at its end-of-text
        edges = np.flatnonzero(np.diff(np.concatenate([[0], is_ans.astype(np.int8), [0]])))
        for start, stop in zip(edges[::2], edges[1::2]):
            exact.setdefault(data.LABELS[t[start]], []).append(bool(c[start:stop].all()))
    ans = (ttask >= 0) & (ttask != data.RECALL)
    out["acc_tokens"] = float(correct[ans].mean()) if ans.any() else float("nan")
    flat = [x for k, v in exact.items() if k != "recall" for x in v]
    out["exact"] = float(np.mean(flat)) if flat else float("nan")
    out["answers"] = len(flat)
    out["exact_by_task"] = {k: float(np.mean(v)) for k, v in sorted(exact.items())}
    return out


# ---------------------------------------------------------------------------------------------
# Planning (--minutes): measure each stage's step time on a throwaway model


def plan_stages(s: Settings, device, tokens_per_step: int, autocast: bool) -> str:
    import torch

    per_step = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = build_model(s.model, s.seed + 1).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        mixture, fillers = _mixture(s)
        for length, _ in CURRICULUM:
            rows = tokens_per_step // length
            b = data.batch(s.seed, -1, rows, length, mixture, fillers)
            ids, task = (torch.from_numpy(b[k]).to(device) for k in ("ids", "task"))
            times = []
            for i in range(4):
                _sync(device)
                t0 = time.perf_counter()
                loss = loss_terms(model, ids, task, s, autocast)[0]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(device)
                if i >= 1:  # the first step compiles / autotunes
                    times.append(time.perf_counter() - t0)
            per_step[length] = sorted(times)[len(times) // 2]
        del model, opt
    budget = s.minutes * 60
    parts = [f"{n}:{max(1, round(share * budget / per_step[n]))}" for n, share in CURRICULUM]
    print("step time by stage: " + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in per_step.items()))
    return ",".join(parts)


def _mixture(s: Settings):
    return (
        parse_weights(s.mixture, data.TASKS, "mixture"),
        parse_weights(s.fillers, data.FILLER_KINDS, "fillers", int),
    )


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Checkpoints and outputs


def _atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path) -> dict:
    """The checkpoint a run of this command wrote: tensors, numbers and containers only
    (`weights_only=True`), so a planted file cannot run code; anything else is a UsageError
    naming the file."""
    import pickle

    import torch

    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"{path} is not a checkpoint this command wrote ({why[:160]}); it was not loaded: "
            "delete it to start over, or use another --out"
        ) from None
    if not isinstance(got, dict) or not {"model", "optimizer", "step", "elapsed_s"} <= set(got):
        raise UsageError(
            f"{path} is not a checkpoint this command wrote (not its model, optimizer and step); "
            "delete it to start over, or use another --out"
        )
    return got


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past `step` (they are recomputed after a resume)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            pass
    path.write_text("".join(x + "\n" for x in keep))


def save_model(model, out: Path) -> Path:
    """bf16 safetensors + config + tokenizer, loadable with from_pretrained."""
    import copy

    import torch

    from rbs_bench.models.tiny import build_tokenizer

    target = out / "model"
    half = copy.deepcopy(model).to("cpu", dtype=torch.bfloat16).eval()
    half.config._attn_implementation = "sdpa"
    half.save_pretrained(target)
    tok = build_tokenizer()
    tok.model_max_length = model.config.max_position_embeddings
    tok.save_pretrained(target)
    return target


def plot_log(log_path: Path, png: Path) -> None:
    """Loss curves (answer and context) and exact-answer accuracy per task, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (
        [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
        if (log_path.exists())
        else []
    )
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.plot(steps, [r["loss_answer"] for r in rows], label="answer tokens")
    ax1.plot(steps, [r["loss_recall"] for r in rows], label="recall targets")
    ax1.plot(steps, [r["loss_context"] for r in rows], label="context tokens")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy (nats/token)")
    # one log line scores one batch (a handful of answers): show a running mean
    window = max(1, len(rows) // 50)
    ax2.plot(
        steps,
        _running_mean([r["exact"] for r in rows], window),
        color="k",
        lw=2,
        label="all answers",
    )
    for task in data.LABELS:
        ys = [r["exact_by_task"].get(task, float("nan")) for r in rows]
        ax2.plot(steps, _running_mean(ys, window), lw=0.9, label=task)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"exact answers, teacher forcing (mean of {window} logs)")
    ax2.set_ylim(-0.02, 1.02)
    changes = [r["step"] for a, r in zip(rows, rows[1:]) if r["length"] != a["length"]]
    for ax in (ax1, ax2):
        for x in changes:
            ax.axvline(x, color="grey", lw=0.5, ls=":")
        ax.legend(fontsize=7)
    fig.suptitle("tiny retrieval LM training (dotted: next curriculum stage)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values that are not NaN (NaN where there are none)."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1) : i + 1] if v == v]
        out.append(sum(seen) / len(seen) if seen else float("nan"))
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The run


def resolve(s: Settings) -> Settings:
    if s.preset not in PRESETS:
        raise UsageError(f"--preset {s.preset!r} is not one of {', '.join(PRESETS)}")
    s.model = s.resolved_model()
    if s.model["hidden_size"] % s.model["head_dim"] and s.hidden is not None:
        raise UsageError("--hidden must be a multiple of the head dim")
    if s.tokens_per_step is None:
        s.tokens_per_step = PRESETS[s.preset]["tokens_per_step"]
    if s.stages is None and s.minutes is None:
        s.stages = PRESETS[s.preset].get("stages")
        if s.stages is None:
            raise UsageError("give --stages length:steps,... or --minutes M")
    if s.minutes is not None and s.minutes <= 0:
        raise UsageError("--minutes must be positive")
    if s.stages is not None:
        parse_stages(s.stages, s.tokens_per_step)  # fail now on a bad string
    _mixture(s)
    if s.init is not None and not (Path(s.init) / "config.json").is_file():
        raise UsageError(f"--init {s.init}: no config.json there; give a trained model directory")
    return s


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name} but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def _versions(device) -> dict:
    import torch
    import transformers

    v = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    if device.type == "cuda":
        v["gpu"] = torch.cuda.get_device_name(device)
        v["cuda"] = torch.version.cuda
    return v


def _enable_determinism(s: Settings, device) -> str:
    """Ask for deterministic kernels; "strict", or "warn_only" when an op of the training step
    has no deterministic implementation on this device (found by one small trial step)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = build_model(s.model, s.seed).to(device).train()
        b = data.batch(s.seed, -1, 1, 512)
        ids, task = (torch.from_numpy(b[k]).to(device) for k in ("ids", "task"))
        try:
            loss_terms(model, ids, task, s, device.type == "cuda")[0].backward()
            return "strict"
        except RuntimeError as e:
            if "deterministic" not in str(e):
                raise
            print(
                f"warning: no deterministic kernel for an op here ({str(e).splitlines()[0]}); "
                f"continuing with warn_only",
                file=sys.stderr,
            )
            torch.use_deterministic_algorithms(True, warn_only=True)
            return "warn_only"
        finally:
            del model


def train(s: Settings, stop_at: int | None = None, progress: bool = True) -> Path:
    """Run (or resume) training; returns the output directory."""
    import torch
    from tqdm import tqdm

    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _device(s.device)
    autocast = device.type == "cuda"
    run_json, ckpt_path, log_path = out / "run.json", out / "checkpoint.pt", out / "log.jsonl"

    resumed = None
    if run_json.exists() and ckpt_path.exists():
        old = json.loads(run_json.read_text())["settings"]
        mine = {**asdict(s), "minutes": old["minutes"]}
        if s.stages is None:  # planned by --minutes when the run started
            mine["stages"] = old["stages"]
        keys = [k for k in mine if k not in ("workers", "log_every", "device", "checkpoint_every")]
        diff = [k for k in keys if old.get(k) != mine[k]]
        if diff:
            raise UsageError(
                f"{out} holds a run with other settings ({', '.join(diff)}); "
                f"use another --out or delete it"
            )
        s = Settings(**mine)
        resumed = _load_checkpoint(ckpt_path)
    determinism = _enable_determinism(s, device) if s.deterministic else "off"
    if resumed is None and s.stages is None:
        s.stages = plan_stages(s, device, s.tokens_per_step, autocast)
        print(f"planned --stages {s.stages}")

    stages = parse_stages(s.stages, s.tokens_per_step)
    steps = schedule(stages)
    total = len(steps)
    model = build_model(s.model, s.seed, s.init).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": s.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=s.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    start, elapsed = 0, 0.0
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["optimizer"])
        start, elapsed = resumed["step"], resumed["elapsed_s"]
        _truncate_log(log_path, start)
        print(f"resuming {out} at step {start}/{total}")
    else:
        log_path.unlink(missing_ok=True)
    run_json.write_text(
        json.dumps(
            {
                "settings": asdict(s),
                "steps": total,
                "tokens": s.tokens_per_step * total,
                "parameters": sum(p.numel() for p in model.parameters()),
                "versions": _versions(device),
                "determinism": determinism,
                "command": command_line(s),
            },
            indent=1,
        )
    )

    def checkpoint(step: int) -> None:
        _atomic_save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "elapsed_s": elapsed,
            },
            ckpt_path,
        )

    end = total if stop_at is None else min(total, stop_at)
    loader = torch.utils.data.DataLoader(
        StepBatches(s.seed, steps, *_mixture(s)),
        batch_size=None,
        sampler=range(start, end),
        num_workers=s.workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if s.workers else None,
    )
    bar = tqdm(
        total=end,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=not progress,
    )
    acc_sum = {"loss": 0.0, "loss_answer": 0.0, "loss_context": 0.0, "n": 0}
    sums = None
    t_last = time.perf_counter()
    step = start
    for step, ids, task in loader:
        ids = ids.to(device, non_blocking=True)
        task = task.to(device, non_blocking=True)
        lr = lr_at(step, total, s)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, l_ans, l_rec, l_ctx, logits = loss_terms(model, ids, task, s, autocast)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss at step {step}; lower --lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        part = torch.stack([loss.detach(), l_ans.detach(), l_rec.detach(), l_ctx.detach()])
        sums = part if sums is None else sums + part
        acc_sum["n"] += 1
        done = step + 1
        if done % s.log_every == 0 or done == end:
            now = time.perf_counter()
            elapsed += now - t_last
            t_last = now
            mean = (sums / acc_sum["n"]).tolist()
            acc = answer_accuracy(logits.detach(), ids, task)
            length, rows = steps[step]
            entry = {
                "step": done,
                "length": length,
                "rows": rows,
                "lr": lr,
                "loss": mean[0],
                "loss_answer": mean[1],
                "loss_recall": mean[2],
                "loss_context": mean[3],
                **acc,
                "tokens": done * s.tokens_per_step,
                "elapsed_s": round(elapsed, 2),
            }
            with log_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            bar.set_postfix(len=length, ans=f"{mean[1]:.3f}", exact=f"{acc['exact']:.2f}")
            if not progress and done % (5 * s.log_every) == 0:
                by = " ".join(f"{k[:6]}={v:.2f}" for k, v in acc["exact_by_task"].items())
                print(
                    f"step {done}/{end} len {length} answer {mean[1]:.3f} recall {mean[2]:.3f} "
                    f"context {mean[3]:.3f} exact {acc['exact']:.2f} [{by}] {elapsed:.0f}s",
                    flush=True,
                )
            sums, acc_sum["n"] = None, 0
        bar.update(1)
        if done % s.checkpoint_every == 0 and done < end:
            checkpoint(done)
        step = done
    bar.close()
    elapsed += time.perf_counter() - t_last
    checkpoint(step)
    plot_log(log_path, out / "loss_curve.png")
    if step < total:
        print(f"stopped at step {step}/{total}; rerun the same command to continue")
        return out
    target = save_model(model, out)
    summary = {
        "steps": total,
        "tokens": total * s.tokens_per_step,
        "train_seconds": round(elapsed, 1),
        "final": json.loads(log_path.read_text().splitlines()[-1]),
        "model_sha256": _sha256(target / "model.safetensors"),
        "determinism": determinism,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"model: {target} (sha256 {summary['model_sha256'][:16]})")
    return out


def command_line(s: Settings) -> str:
    """The command that reproduces this run (stages explicit)."""
    parts = [
        "python -m rbs_bench.tinylm.train",
        f"--out {s.out}",
        f"--seed {s.seed}",
        f"--preset {s.preset}",
        f"--stages {s.stages}",
    ]
    defaults = Settings(out=s.out)
    for name in (
        "tokens_per_step",
        "lr",
        "min_lr_ratio",
        "warmup",
        "weight_decay",
        "grad_clip",
        "context_weight",
        "recall_weight",
        "layers",
        "hidden",
        "intermediate",
        "rope_theta",
        "init",
        "mixture",
        "fillers",
    ):
        value = getattr(s, name)
        if (
            value is not None
            and value != getattr(defaults, name)
            and not (name == "tokens_per_step" and value == PRESETS[s.preset]["tokens_per_step"])
        ):
            parts.append(f"--{name.replace('_', '-')} {value}")
    if not s.deterministic:
        parts.append("--no-deterministic")
    return " ".join(parts)


def parse_args(argv=None) -> tuple[Settings, int | None, bool]:
    p = argparse.ArgumentParser(
        prog="python -m rbs_bench.tinylm.train",
        description="Train the tiny retrieval LM on the synthetic long-context mixture.",
    )
    p.add_argument("--out", required=True, help="run directory (resumed if it holds a run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="full", choices=sorted(PRESETS))
    p.add_argument("--stages", help="curriculum as length:steps,... (e.g. 1024:300,8192:900)")
    p.add_argument("--minutes", type=float, help="size the curriculum to about M minutes here")
    p.add_argument("--tokens-per-step", type=int)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--context-weight", type=float, default=0.2)
    p.add_argument("--recall-weight", type=float, default=1.0)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--init", help="start from this trained model directory (a later stage)")
    p.add_argument("--mixture", help="task weights, e.g. kv_single=0.3,kv_lookup=0.3,...")
    p.add_argument("--fillers", help="filler kind weights, e.g. prose=2,repeat=2,copula=2")
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=8, help="data loader processes")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--stop-at", type=int, help="stop after this step (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    extra = {k: v for k, v in vars(a).items() if k not in ("stop_at", "progress")}
    return Settings(**extra), a.stop_at, a.progress


def main(argv=None) -> None:
    s, stop_at, progress = parse_args(argv)
    try:
        train(resolve(s), stop_at=stop_at, progress=progress)
    except UsageError as e:
        print(f"rbs_bench.tinylm.train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
