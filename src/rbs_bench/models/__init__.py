"""Models: load an HF causal LM (hub id, local path, or the embedded tiny Qwen3) and its tokenizer.

Every model is loaded with the `rbs_sparse` attention implementation; until a selector is attached
with `install(model, selector)` it runs transformers' SDPA, so a loaded model is a dense model.
Importing this package is cheap: transformers is imported on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ATTN_IMPL", "PrefillRecorder", "encoder", "install", "load", "uninstall", "wrap_prompt"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LAZY = ("ATTN_IMPL", "PrefillRecorder", "install", "uninstall", "register")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rbs_bench.models import hf_attention

        return getattr(hf_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(model_cfg, device="cpu"):
    """(model in eval mode on `device`, tokenizer) for a model config.

    model_cfg fields: name, hf_id (None = the embedded tiny model), revision, max_context, dtype
    ("auto" | "float32" | "bfloat16" | "float16"), chat_template, chat_template_kwargs,
    trust_remote_code, config_overrides (config attributes to replace, e.g. rope scaling).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rbs_bench.models import hf_attention, tiny

    if model_cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype={model_cfg.dtype!r} is not one of {', '.join(_DTYPES)}")
    dtype = model_cfg.dtype if model_cfg.dtype == "auto" else getattr(torch, model_cfg.dtype)
    hf_attention.register()
    device = torch.device(device)
    kwargs = {"dtype": dtype, "attn_implementation": hf_attention.ATTN_IMPL}
    if device.type != "cpu":
        kwargs["device_map"] = str(device)  # load the weights straight onto the accelerator

    if model_cfg.hf_id is None:
        source, extra = tiny.materialize(), {}
    else:
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
    try:
        config = AutoConfig.from_pretrained(source, **extra, **_plain(model_cfg.config_overrides))
        _check_context(model_cfg, config)  # before the (possibly long) weight load
        model = AutoModelForCausalLM.from_pretrained(source, config=config, **extra, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    except OSError as e:  # no network, gated, unknown id, missing files
        text = str(e).strip()
        reason = text.splitlines()[0] if text else type(e).__name__
        raise ValueError(
            f"cannot load model {str(source)!r} ({reason}); if the hub is out of "
            f"reach, download it and set model.hf_id=/local/path"
        ) from e
    model = model.to(device).eval()
    return model, tokenizer


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


def wrap_prompt(tokenizer, model_cfg, user_text: str) -> str:
    """The user turn in the model's chat template plus the opening of the assistant turn, or
    the raw text when model.chat_template is false."""
    if not model_cfg.chat_template:
        return user_text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"model {model_cfg.name!r} has no chat template; set model.chat_template=false"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}],
        tokenize=False,
        add_generation_prompt=True,
        **dict(model_cfg.chat_template_kwargs or {}),
    )


class _Encoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def encoder(tokenizer) -> _Encoder:
    """An object whose `.encode(text)` returns token ids without any added special tokens."""
    return _Encoder(tokenizer)
