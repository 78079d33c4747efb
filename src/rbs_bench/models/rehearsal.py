"""Full-size models with seeded random weights: the paper's architectures without a checkpoint.

`model=qwen3_30b_a3b_random` and `model=qwen3_32b_random` (`model.random_init=true`) build the real
architecture from its shipped `config.json` (`architectures/<name>.json`: no hub access), with
random weights drawn on the device from `model.seed`, and read prompts with the embedded byte-level
tokenizer of `model=tiny`. Their answers are noise, so their scores mean nothing; every other
number a run records is real: time, memory, measured density, calibration cost. That makes them the
way to rehearse a cluster setup (memory per GPU, seconds per sample, SLURM limits) before spending
GPU hours on the real checkpoints.

Rehearsal checkpoints go one step further: `python -m rbs_bench.models.rehearsal write --model
qwen3_30b_a3b_fp8 --out DIR` (`write_checkpoint`) writes a shipped architecture with seeded random
weights as the hub's checkpoint of that model lays it out (FP8 weights and scales for the FP8
models, `rbs_bench.models.checkpoint`), which `model=qwen3_30b_a3b_fp8 model.path=DIR` loads
through from_pretrained exactly as the hub id.
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


# conf/model names whose architecture is shipped: the rehearsal models and the paper's checkpoints
ARCHITECTURE_OF = {
    "qwen3_30b_a3b_fp8": "qwen3_30b_a3b",
    "qwen3_30b_a3b_random": "qwen3_30b_a3b",
    "qwen3_32b": "qwen3_32b",
    "qwen3_32b_random": "qwen3_32b",
    "qwen3_vl_30b_a3b_thinking_fp8": "qwen3_vl_30b_a3b",
}


def architecture_of(name: str) -> str | None:
    """The shipped architecture of a model or architecture name; None for any other name."""
    arch = ARCHITECTURE_OF.get(name, name)
    return arch if arch in architectures() else None


def full_depth(name: str) -> int | None:
    """Decoder layers (of the language model) of a shipped architecture, or of a model name that
    has one (qwen3_30b_a3b_fp8, ...); None for any other name."""
    arch = architecture_of(name)
    if arch is None:
        return None
    fields = architecture_fields(arch)
    return int(fields.get("text_config", fields)["num_hidden_layers"])


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


def checkpoint_fields(name: str, layers: int | None = None, overrides: dict | None = None):
    """The architecture fields of model `name`'s rehearsal checkpoint: its shipped architecture
    with `layers` decoder layers and `overrides` merged in (nested for the VL model:
    {"text_config": {...}, "vision_config": {...}})."""
    from rbs_bench.models import checkpoint

    fields = checkpoint.merge(
        architecture_fields(checkpoint.layout(name).architecture), overrides or {}
    )
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}; give at least 1")
        fields.get("text_config", fields)["num_hidden_layers"] = int(layers)
    return fields


def write_checkpoint(
    name: str,
    out,
    layers: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    overrides: dict | None = None,
    **kwargs,
):
    """Write the rehearsal checkpoint of model `name` (a conf/model name: qwen3_30b_a3b_fp8,
    qwen3_32b, qwen3_vl_30b_a3b_thinking_fp8) to `out`: its real architecture in the hub's
    layout with seeded random weights (`rbs_bench.models.checkpoint`); `kwargs` go to
    `checkpoint.write` (shard_bytes, progress). Returns `out`."""
    from rbs_bench.models import checkpoint

    fields = checkpoint_fields(name, layers, overrides)
    return checkpoint.write(name, out, fields, seed=seed, device=device, **kwargs)


def _field_overrides(items: list[str]) -> dict:
    """{"text_config": {"num_experts": 8}} from ["text_config.num_experts=8"] (JSON values)."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: give FIELD=VALUE, e.g. --set hidden_size=256")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value  # a bare string
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = parsed
    return out


def main(argv: list[str] | None = None) -> int:
    """`write`: a rehearsal checkpoint in the hub's layout (rbs_bench.models.checkpoint)."""
    import argparse
    import sys

    from rbs_bench.models import checkpoint

    ap = argparse.ArgumentParser(prog="python -m rbs_bench.models.rehearsal")
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help=checkpoint.__doc__.splitlines()[0])
    w.add_argument("--model", required=True, choices=sorted(checkpoint.LAYOUTS))
    w.add_argument("--out", required=True, help="the checkpoint directory to write")
    w.add_argument("--layers", type=int, help="decoder layers (default: the model's own)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--device", default="cpu", help="where tensors are drawn: cpu or cuda")
    w.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an architecture field to replace, VALUE as JSON (e.g. hidden_size=256, "
        "text_config.num_experts=8): a smaller model of the same layout, for smoke tests",
    )
    w.add_argument("--shard-gib", type=float, default=checkpoint.DEFAULT_SHARD_BYTES / 2**30)
    w.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        write_checkpoint(
            args.model,
            args.out,
            layers=args.layers,
            seed=args.seed,
            device=args.device,
            overrides=_field_overrides(args.set),
            shard_bytes=int(args.shard_gib * 2**30),
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as e:
        print(f"rbs-bench: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
