"""Full-size models with seeded random weights: the paper's architectures without a checkpoint.

`model=qwen3_30b_a3b_random` and `model=qwen3_32b_random` (`model.random_init=true`) build the real
architecture from its shipped `config.json` (`architectures/<name>.json`: no hub access), with
random weights drawn on the device from `model.seed`, and read prompts with the embedded byte-level
tokenizer of `model=tiny`. Their answers are noise, so their scores mean nothing; every other
number a run records is real: time, memory, measured density, calibration cost. That makes them the
way to rehearse a cluster setup (memory per GPU, seconds per sample, SLURM limits) before spending
GPU hours on the real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURES = Path(__file__).parent / "architectures"  # package data: config.json files


def architectures() -> list[str]:
    """Names of the shipped architectures (`model.architecture`)."""
    return sorted(p.stem for p in ARCHITECTURES.glob("*.json"))


def architecture_fields(name: str) -> dict:
    """The config.json fields of a shipped architecture."""
    if name not in architectures():
        raise ValueError(
            f"unknown model.architecture {name!r}; shipped: {', '.join(architectures())}"
        )
    return json.loads((ARCHITECTURES / f"{name}.json").read_text())


def full_depth(name: str) -> int | None:
    """Decoder layers of a shipped architecture; None for any other model name."""
    if name not in architectures():
        return None
    return int(architecture_fields(name)["num_hidden_layers"])


def architecture_config(name: str, **overrides):
    """The transformers config of a shipped architecture, with fields overridden (e.g.
    num_hidden_layers for a shallower timing model, YaRN rope parameters for a longer context)."""
    from transformers import AutoConfig

    fields = {**architecture_fields(name), **overrides}
    fields.pop("architectures", None)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build(config, device, dtype, seed: int, attn_implementation: str):
    """A causal LM of `config` with seeded random weights, built directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # seeds the CUDA generators too
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    return model.eval()


def weights_id(model_cfg) -> str:
    """What names a random model's weights in records and calibrations: architecture and seed."""
    return f"random:{model_cfg.architecture}:seed{model_cfg.seed}"
