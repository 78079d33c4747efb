"""Models: load an HF causal LM or a Qwen3-VL model (hub id, local path, or an embedded tiny one)
and its tokenizer; for Qwen3-VL also its video processor (`rbs_bench.models.vision`).

Every model is loaded with the `rbs_sparse` attention implementation; until a selector is attached
with `install(model, selector)` it runs transformers' SDPA, so a loaded model is a dense model. In
a vision-language model the hook sits in the language model's layers only: their prefill covers
the text and video tokens, the vision tower keeps dense attention.
Importing this package is cheap: transformers is imported on first use.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "ATTN_IMPL",
    "PrefillRecorder",
    "cuda_devices",
    "encoder",
    "identity",
    "install",
    "load",
    "load_video_processor",
    "uninstall",
    "weights_digest",
    "wrap_prompt",
]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Model fields that change how a prediction is computed, not what it is: not in a fingerprint.
# A local checkpoint's path is how, too: its weights are named by their digest (weights_digest),
# so the same weights moved, copied or staged to another node's disk resume their cells.
HOW_FIELDS = ("ffn_chunk_tokens", "device_map", "compile", "path", "allow_pickle")
RANDOM_FIELDS = ("random_init", "architecture", "seed")  # only a random-weight model's identity
_LAZY = ("ATTN_IMPL", "PrefillRecorder", "install", "uninstall", "register")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rbs_bench.models import hf_attention

        return getattr(hf_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(model_cfg, device="cpu"):
    """(model in eval mode on `device`, tokenizer) for a model config.

    model_cfg fields: name, hf_id (None = an embedded model: `tiny_vl` for the name tiny_vl, the
    random-weight tiny Qwen3 for tiny_random, the shipped trained tiny LM for any other),
    path (a local checkpoint directory read instead of hf_id, e.g. a rehearsal checkpoint of
    `rbs_bench.models.checkpoint`), revision, max_context, dtype ("auto" | "float32" |
    "bfloat16" | "float16"), chat_template, chat_template_kwargs, trust_remote_code,
    config_overrides (config attributes to replace, e.g. rope scaling). A config with a vision
    tower (Qwen3-VL) loads as an image-text-to-text model.
    """
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    from rbs_bench.models import checkpoint, fp8, hf_attention, vision

    if model_cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype={model_cfg.dtype!r} is not one of {', '.join(_DTYPES)}")
    dtype = model_cfg.dtype if model_cfg.dtype == "auto" else getattr(torch, model_cfg.dtype)
    hf_attention.register()
    device = torch.device(device)
    if _random_init(model_cfg):
        model, tokenizer = _load_random(model_cfg, device, dtype)
        return _finish(model, model_cfg), tokenizer
    kwargs = {"dtype": dtype, "attn_implementation": hf_attention.ATTN_IMPL}
    if not getattr(model_cfg, "allow_pickle", False):
        kwargs["use_safetensors"] = True  # pickle weights run code when loaded (pickle_problem)
    device_map = _device_map(model_cfg, device)
    if device_map is not None:
        kwargs["device_map"] = device_map  # load the weights straight onto the accelerator(s)

    source, extra = _source(model_cfg)
    checkpoint.register_per_expert_layout()  # Qwen3-VL-MoE FP8 experts, stored one per expert
    try:
        config = AutoConfig.from_pretrained(source, **extra, **_plain(model_cfg.config_overrides))
        _check_context(model_cfg, config)  # before the (possibly long) weight load
        fp8.prepare(config, device)  # block-FP8 checkpoints: kernels for transformers' layers
        auto = AutoModelForCausalLM
        if vision.is_vision_language(config):
            vision.check_supported(config)
            auto = AutoModelForImageTextToText
        model = auto.from_pretrained(source, config=config, **extra, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    except OSError as e:  # no network, gated, unknown id, missing files
        text = str(e).strip()
        reason = text.splitlines()[0] if text else type(e).__name__
        raise ValueError(
            f"cannot load model {str(source)!r} ({reason}); if the hub is out of "
            f"reach, download it and set model.path=/local/path"
        ) from e
    if device_map is None or device_map == str(device):
        model = model.to(device)
    return _finish(model.eval(), model_cfg), tokenizer


def cuda_devices(model) -> list:
    """The CUDA devices holding the model's parameters (several under model.device_map=auto)."""
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def _finish(model, model_cfg):
    """The harness's settings on a loaded model: the layers' regions outside attention compiled
    (`model.compile`, default on CUDA), feed-forward blocks in token chunks."""
    from rbs_bench.models import fastpath
    from rbs_bench.models.feedforward import chunk_feedforward

    device = next(model.parameters()).device
    fastpath.install(model, fastpath.enabled(getattr(model_cfg, "compile", None), device))
    chunk_feedforward(model, getattr(model_cfg, "ffn_chunk_tokens", None))
    return model


def _random_init(model_cfg) -> bool:
    return bool(getattr(model_cfg, "random_init", False))


def _device_map(model_cfg, device) -> str | None:
    """`model.device_map` ("auto": accelerate spreads the layers over every visible GPU), else
    the one accelerator the run uses (None on a CPU: the weights load on the host)."""
    wanted = getattr(model_cfg, "device_map", None)
    if wanted is not None:
        if wanted != "auto":
            raise ValueError(f"model.device_map={wanted!r}; use auto or null")
        if device.type != "cuda":
            raise ValueError("model.device_map=auto spreads a model over GPUs; use device=cuda")
        return "auto"
    return None if device.type == "cpu" else str(device)


def _load_random(model_cfg, device, dtype):
    """(model, tokenizer) of a rehearsal model: a shipped architecture with seeded random weights
    built on `device`, and the embedded byte-level tokenizer."""
    import torch

    from rbs_bench.models import hf_attention, rehearsal, tiny

    for key in ("hf_id", "path"):
        if getattr(model_cfg, key, None) is not None:
            raise ValueError(
                f"model {model_cfg.name!r} sets both random_init and {key}="
                f"{getattr(model_cfg, key)}; a "
                "random-weight model reads no checkpoint: drop one "
                "(e.g. model=qwen3_30b_a3b_random)"
            )
    if not model_cfg.architecture:
        raise ValueError(
            "model.random_init=true needs model.architecture, one of: "
            + ", ".join(rehearsal.architectures())
        )
    if getattr(model_cfg, "device_map", None) is not None:
        raise ValueError(
            "model.device_map with model.random_init is not supported: random weights are built "
            "on one device; use a GPU that holds the model (python -m rbs_bench.models.memory)"
        )
    config = rehearsal.architecture_config(
        model_cfg.architecture, **_plain(model_cfg.config_overrides)
    )
    _check_context(model_cfg, config)
    dtype = torch.bfloat16 if dtype == "auto" else dtype
    model = rehearsal.build(config, device, dtype, model_cfg.seed, hf_attention.ATTN_IMPL)
    tokenizer = tiny.build_tokenizer()
    tokenizer.model_max_length = model_cfg.max_context
    return model, tokenizer


def _embedded(model_cfg) -> str | None:
    """Which embedded model a config loads ("tiny_vl", "tiny_random", "trained"), or None."""
    if model_cfg.hf_id is not None or _random_init(model_cfg) or _local_path(model_cfg):
        return None
    return model_cfg.name if model_cfg.name in ("tiny_vl", "tiny_random") else "trained"


def weights_digest(model_cfg) -> str | None:
    """What names the weights a config loads, in run records and calibrations, so that results
    made with other weights under the same model name (or the same local path) never mix:

    - the shipped trained model: the first 16 hex digits of the sha256 of its weights;
    - a model read from a local directory (whatever `_source` resolves to): `local_digest`, the
      names and sizes of its weight files and a sample of their bytes (headers, each tensor's
      first bytes);
    - a random-weight model: its architecture and seed (`rehearsal.weights_id`);
    - None for a hub id (its revision is in the config) or a model built from code (its builder
      version is in its cache name).

    Reading a local directory also checks its files (`check_local_files`): a truncated weight
    file or tokenizer is a ValueError naming the file."""
    if _random_init(model_cfg):
        from rbs_bench.models.rehearsal import weights_id

        return weights_id(model_cfg)
    kind = _embedded(model_cfg)
    if kind == "trained":
        from rbs_bench.models import tiny

        check_local_files(tiny.trained_dir())
        return _file_digest(str(tiny.trained_dir() / "model.safetensors"))
    if kind is not None:
        return None
    source, _ = _source(model_cfg)
    local = Path(source)
    return local_digest(local) if local.is_dir() else None


def identity(model_cfg) -> dict:
    """The model config as a plain dict, with `weights` (its digest) where weights_digest has one:
    what run records are fingerprinted with."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(model_cfg, resolve=True)
    for key in HOW_FIELDS:
        out.pop(key, None)
    if not out.get("random_init"):
        for key in RANDOM_FIELDS:
            out.pop(key, None)
    digest = weights_digest(model_cfg)
    return out | {"weights": digest} if digest else out


@functools.lru_cache(maxsize=4)
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _local_path(model_cfg) -> str | None:
    return getattr(model_cfg, "path", None) or None


def _checkpoint_dir(model_cfg) -> Path:
    """model.path as a checkpoint directory, or ValueError saying what to change."""
    given = _local_path(model_cfg)
    path = Path(given).expanduser()
    if not path.is_dir():
        partial = path.with_name(path.name + ".partial")
        if partial.is_dir():
            raise ValueError(
                f"model.path={given} is not written yet ({partial} is an unfinished write); rerun "
                "the same `python -m rbs_bench.models.rehearsal write` command to finish it"
            )
        raise ValueError(
            f"model.path={given} is not a directory; give a local copy of the checkpoint, or "
            f"write one: python -m rbs_bench.models.rehearsal write --model {model_cfg.name} "
            f"--out {given}"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"model.path={given} is not readable by this user")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path={given} holds no config.json; point it at a checkpoint directory "
            "(config.json, *.safetensors and the tokenizer files)"
        )
    return path


# The files of a local model directory that hold weights (the digest) and the JSON files that
# from_pretrained reads (checked to parse, so a truncated one is named before a model loads).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


def local_digest(directory) -> str:
    """The first 16 hex digits of the sha256 of a local model directory's weight files: each
    one's name and size, and a sample of its bytes (`_content_sample`: for safetensors the
    header, which names every tensor's dtype, shape and offsets, and the first bytes of every
    tensor), after `check_local_files`. It follows the content, not the copy: the same weights
    staged to another node's disk, rewritten from the same seed or copied without keeping
    modification times keep their digest, so results made there resume and merge; other weights
    (any retrained or edited tensor) get another one. Reading it costs a header and one short
    read per tensor (cached while a file's size and modification time hold), not a pass over
    the weights."""
    directory = Path(directory)
    check_local_files(directory)
    parts = []
    for path in _weight_files(directory):
        size, mtime_ns = _stamp(path)
        parts.append([path.name, size, _content_sample(str(path), size, mtime_ns)])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


SAMPLE_BYTES = 64  # read from the start of each tensor (32 bf16 or 64 fp8 values)


@functools.lru_cache(maxsize=256)
def _content_sample(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a weight file's sampled bytes: for safetensors its header and the first
    SAMPLE_BYTES of each tensor's data; for other formats 64 windows of 4 KiB spread evenly."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if path.endswith(".safetensors"):
            header, spans = _read_safetensors_header(path, size, mtime_ns)
            h.update(header)
            base = 8 + len(header)
            for start, end in spans:
                f.seek(base + start)
                h.update(f.read(min(SAMPLE_BYTES, end - start)))
        else:
            for i in range(64):
                f.seek(size * i // 64)
                h.update(f.read(4096))
    return h.hexdigest()


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # weights torch.load unpickles


def pickle_problem(model_cfg) -> str | None:
    """Why a local model directory cannot load as configured: its weights are pickle files only
    (pytorch_model.bin, ...), which can run code when loaded; safetensors are required unless
    `model.allow_pickle=true` says the user trusts them. None when that is not the case."""
    if getattr(model_cfg, "allow_pickle", False) or _random_init(model_cfg):
        return None
    if _embedded(model_cfg) is not None:
        return None
    local = Path(_source(model_cfg)[0])
    if not local.is_dir():
        return None  # a hub id: from_pretrained(use_safetensors=True) refuses pickles itself
    files = _weight_files(local)
    pickles = [p.name for p in files if p.suffix in PICKLE_SUFFIXES]
    if not pickles or any(p.suffix == ".safetensors" for p in files):
        return None
    return (
        f"{local} holds its weights only as pickle files ({', '.join(pickles[:3])}), which can "
        "run code when loaded; convert them to safetensors (save_pretrained with "
        "safe_serialization=True), or set model.allow_pickle=true if you trust them"
    )


def check_local_files(directory) -> None:
    """ValueError naming the file unless every JSON file from_pretrained reads there parses and
    every safetensors file is whole (its header parses and its tensors end where the file
    ends)."""
    directory = Path(directory)
    for name in JSON_FILES + tuple(p.name for p in directory.glob("*.index.json")):
        path = directory / name
        if path.is_file():
            _check_json(str(path), *_stamp(path))
    for path in _weight_files(directory):
        if path.suffix == ".safetensors":
            _safetensors_header(path)


def _weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _damaged(path, problem: str) -> ValueError:
    return ValueError(
        f"{path} {problem}: the file is truncated or damaged; copy or download it again"
    )


@functools.lru_cache(maxsize=64)
def _check_json(path: str, size: int, mtime_ns: int) -> None:
    try:
        json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise _damaged(path, "is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"is not valid JSON ({e.msg} at line {e.lineno})") from None


def _safetensors_header(path: Path) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    return _read_safetensors_header(str(path), *_stamp(path))


@functools.lru_cache(maxsize=64)
def _read_safetensors_header(
    path: str, size: int, mtime_ns: int
) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """(the JSON header of a safetensors file, its tensors' data spans (start, end) in ascending
    order), checked against the file's size: 8 bytes of header length (little endian), the
    header, then the tensors' bytes up to the last tensor's end."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise _damaged(path, f"holds {size} bytes, too few for its safetensors header")
        header = f.read(length)
    try:
        spans = tuple(
            sorted(
                (int(t["data_offsets"][0]), int(t["data_offsets"][1]))
                for k, t in json.loads(header).items()
                if k != "__metadata__"
            )
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise _damaged(path, "has no readable safetensors header") from None
    end = max((e for _, e in spans), default=0)
    if 8 + length + end != size:
        raise _damaged(
            path,
            f"holds {size} bytes where its safetensors header describes {8 + length + end}",
        )
    return header, spans


def _source(model_cfg) -> tuple[str | Path, dict]:
    """(where from_pretrained reads the model, its revision/trust_remote_code kwargs): model.path
    when set (a local checkpoint directory, nothing fetched), else hf_id, else an embedded
    model."""
    if _local_path(model_cfg):
        return str(_checkpoint_dir(model_cfg)), {
            "trust_remote_code": bool(model_cfg.trust_remote_code)
        }
    kind = _embedded(model_cfg)
    if kind is not None:
        from rbs_bench.models import tiny, tiny_vl

        if kind == "tiny_vl":
            return tiny_vl.materialize(), {}
        if kind == "tiny_random":  # random weights: for tests of the harness
            return tiny.materialize(), {}
        return tiny.trained_dir(), {}  # the shipped trained model
    source = model_cfg.hf_id
    if str(source).startswith(("/", ".", "~")) and not Path(source).expanduser().is_dir():
        raise ValueError(
            f"model.hf_id={source} is not a directory; give a local model "
            f"directory or a hub id such as Qwen/Qwen3-8B"
        )
    source = str(Path(source).expanduser()) if str(source).startswith("~") else source
    extra = {
        "revision": getattr(model_cfg, "revision", None),
        "trust_remote_code": bool(model_cfg.trust_remote_code),
    }
    return source, extra


def load_video_processor(model_cfg, model, tokenizer):
    """The video processor (`vision.VideoProcessor`) of a loaded Qwen3-VL model; None for a
    text-only model."""
    from rbs_bench.models import vision

    if not vision.is_vision_language(model.config):
        return None
    source, extra = _source(model_cfg)
    try:
        return vision.VideoProcessor.from_pretrained(
            str(source), model.config, tokenizer, extra.get("revision")
        )
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the video processor config of {str(source)!r} ({e})") from e


def _plain(overrides) -> dict:
    """Config overrides (e.g. YaRN rope parameters) as plain Python containers."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(overrides, DictConfig):
        return OmegaConf.to_container(overrides, resolve=True)
    return dict(overrides or {})


def _check_context(model_cfg, config) -> None:
    limit = context_limit(config)
    if limit is not None and model_cfg.max_context > limit:
        raise ValueError(
            f"model.max_context={model_cfg.max_context} exceeds what "
            f"{model_cfg.name} allows ({limit} positions); lower model.max_context"
        )


def context_limit(config) -> int | None:
    """Positions the model supports: max_position_embeddings, or the YaRN-extended length."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if limit is not None and factor and original:
        limit = max(limit, int(factor * original))
    return limit


def wrap_prompt(tokenizer, model_cfg, user_text: str, video: bool = False, processor=None) -> str:
    """The user turn in the model's chat template plus the opening of the assistant turn, or
    the raw text when model.chat_template is false.

    With `video` the turn holds one video before the text, written as the model's video
    placeholder (`processor`, a `vision.VideoProcessor`, expands it when the frames are known).
    """
    if video and processor is None:
        raise ValueError(
            f"model {model_cfg.name!r} is not a vision-language model; video benchmarks need a "
            f"Qwen3-VL model (e.g. model=tiny_vl or model=qwen3_vl_30b_a3b_thinking_fp8)"
        )
    if not model_cfg.chat_template:
        return processor.placeholder + user_text if video else user_text
    template = (processor.chat_template if video else None) or getattr(
        tokenizer, "chat_template", None
    )
    if not template:
        raise ValueError(
            f"model {model_cfg.name!r} has no chat template; set model.chat_template=false"
        )
    if video:
        from rbs_bench.models.vision import video_prompt_messages

        messages = video_prompt_messages(user_text)
    else:
        messages = [{"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
        **dict(model_cfg.chat_template_kwargs or {}),
    )
    if video and text.count(processor.video_token) != 1:
        raise ValueError(
            f"the chat template of {model_cfg.name!r} wrote {text.count(processor.video_token)} "
            f"video placeholders for one video"
        )
    return text


class _Encoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def encoder(tokenizer) -> _Encoder:
    """An object whose `.encode(text)` returns token ids without any added special tokens."""
    return _Encoder(tokenizer)
