"""The embedded vision-language model: a tiny random-weight Qwen3-VL with a byte-level tokenizer.

It lets Video-MME run end to end on a CPU (frames -> vision tower -> language-model prefill with a
selector over text and video tokens -> decode -> score) with no hub access. Built from
`TEXT_CONFIG` / `VISION_CONFIG` and a fixed seed, saved once into the cache directory with its
video processor config and chat template, then loaded through `from_pretrained` like a hub
checkpoint. Its answers are noise: it measures the harness, not the method.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rbs_bench.models import tiny

# Bump when the builder changes what it writes; it is in the hash that names the directory.
BUILDER_VERSION = 1

# ids 256.. after the bytes; the vision tokens keep Qwen's spelling so the video inputs are built
# exactly as for a hub checkpoint.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKEN_IDS = {
    "vision_start_token_id": 259,
    "vision_end_token_id": 260,
    "image_token_id": 261,
    "video_token_id": 262,
}

# The language model is the tiny Qwen3's shape; multimodal RoPE splits the 32 rotary frequencies
# 12/10/10 over (time, height, width), the proportions of Qwen3-VL's 24/20/20 at head dim 128.
TEXT_CONFIG: dict = {
    **{k: tiny.TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
    **{k: tiny.TINY_CONFIG[k] for k in ("num_hidden_layers", "num_attention_heads", "head_dim")},
    "num_key_value_heads": tiny.TINY_CONFIG["num_key_value_heads"],
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "eos_token_id": 256,
    "pad_token_id": 256,
}
# Patch 16, temporal patch 2 and merge 2 are Qwen3-VL's: a 32x32-pixel area of two frames is one
# language-model token.
VISION_CONFIG: dict = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": tiny.TINY_CONFIG["hidden_size"],
    "num_position_embeddings": 256,
    "deepstack_visual_indexes": [0],
    "initializer_range": 0.02,
}
# The video processor json; fields left out take transformers' Qwen3VLVideoProcessor defaults.
# Small pixel budgets keep CPU runs cheap: at most 24 tokens per temporal patch.
VIDEO_PROCESSOR: dict = {
    "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 16 * 24 * 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "cap_pixels_per_frame": True,
    "max_video_tokens": 24,
    "video_processor_type": "Qwen3VLVideoProcessor",
}

# ChatML with Qwen-VL content lists: a video item is written as start, one pad, end. The part up
# to the assistant's opening is shared with the paper models' checkpoints (models.checkpoint).
CHATML_VL_OPEN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
)
CHAT_TEMPLATE = CHATML_VL_OPEN + "{% endif %}"


def tiny_vl_config(**overrides):
    """A `Qwen3VLConfig` of the tiny model, top-level fields overridden (for unit tests)."""
    from transformers import Qwen3VLConfig

    fields = {
        "text_config": dict(TEXT_CONFIG),
        "vision_config": dict(VISION_CONFIG),
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    return Qwen3VLConfig(**{**fields, **overrides})


def config_hash() -> str:
    blob = json.dumps(
        {
            "text": TEXT_CONFIG,
            "vision": VISION_CONFIG,
            "ids": TOKEN_IDS,
            "processor": VIDEO_PROCESSOR,
            "chat": CHAT_TEMPLATE,
            "tokens": SPECIAL_TOKENS,
            "builder": BUILDER_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer():
    """The tiny byte-level tokenizer with Qwen's vision tokens and the content-list template."""
    return tiny.build_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE)


def build_model(config=None):
    """Random-init tiny Qwen3-VL (seed 0), without touching the caller's RNG state."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    config = config if config is not None else tiny_vl_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(config)
    return model.eval()


def materialize(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the saved tiny VL model, tokenizer, video processor json and chat template
    (`<cache_dir>/tiny-qwen3-vl-<hash>`), built there first if it is missing."""

    def write(tmp: Path) -> None:
        build_model().save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        (tmp / "video_preprocessor_config.json").write_text(
            json.dumps(VIDEO_PROCESSOR, indent=2) + "\n", encoding="utf-8"
        )
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")

    return tiny.save_once(cache_dir, f"tiny-qwen3-vl-{config_hash()}", write)
