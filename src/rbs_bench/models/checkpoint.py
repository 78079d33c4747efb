"""Rehearsal checkpoints: a random-weight checkpoint directory in the hub's own layout.

    python -m rbs_bench.models.rehearsal write --model qwen3_30b_a3b_fp8 --out DIR \\
        [--layers L] [--seed S] [--device cuda]

(`rbs_bench.models.rehearsal.write_checkpoint`) writes what `from_pretrained` reads from the hub for
that model, with its real architecture and seeded random weights:

- `config.json`: the shipped architecture (`architectures/<name>.json`) in the hub's spelling
  (`rope_theta`/`rope_scaling`, `torch_dtype`), and for the FP8 models the quantisation config the
  hub's FP8 checkpoints carry (`quantization_config`, see `quantization_config`);
- `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`: every tensor under the
  hub's names (per-expert `...mlp.experts.{j}.gate_proj.weight`, not transformers' fused in-memory
  `...mlp.experts.gate_up_proj`), bf16, and for the FP8 models the linear layers the quantisation
  config converts as float8_e4m3fn with one `weight_scale_inv` per 128x128 block (`quantize`);
- the embedded byte-level tokenizer (`tokenizer.json`, `tokenizer_config.json`) with the special
  tokens at the ids the real vocabulary gives them, a minimal ChatML chat template, a
  `generation_config.json` with the model's special-token ids; for the VL model the video processor
  config of Qwen3-VL;
- `rbs_rehearsal.json`: how the directory was made (model, layers, seed, device, writer version).

Weights are drawn like an initialised model's (transformers' `_init_weights`): linear, expert,
router, convolution and embedding weights from N(0, initializer_range), norm weights 1, biases 0,
in bf16, each tensor from its own generator seeded by (seed, tensor name), so a tensor does not
depend on the shard it lands in. `--device cuda` draws and quantises on the GPU (fast; a GPU's
generator gives other numbers than a CPU's, so the device is part of what names the weights).

The directory is written shard by shard (one shard in memory at a time) into `<out>.partial/`,
each shard renamed into place once complete; a rerun with the same settings keeps the finished
shards, and the directory is renamed to `<out>` only when everything is there. A killed write
therefore leaves no `<out>` that loads.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rbs_bench.models.tiny_vl import CHATML_VL_OPEN

# Bump when the writer changes what it writes: it is recorded in rbs_rehearsal.json.
WRITER_VERSION = 1
BLOCK = 128  # weight_block_size of the hub's FP8 checkpoints
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_SHARD_BYTES = 4 * 2**30
INDEX = "model.safetensors.index.json"
MARKER = "rbs_rehearsal.json"


@dataclass(frozen=True)
class Layout:
    """What a rehearsal checkpoint of one paper model holds."""

    name: str  # the conf/model name that loads it (model=<name> model.path=<dir>)
    architecture: str  # architectures/<architecture>.json
    hub_id: str  # whose layout it copies
    fp8: bool  # block-wise FP8 linear layers and a quantization_config
    max_length: int  # the tokenizer's model_max_length (the model's context)


LAYOUTS = {
    "qwen3_30b_a3b_fp8": Layout(
        "qwen3_30b_a3b_fp8", "qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8", True, 262144
    ),
    "qwen3_32b": Layout("qwen3_32b", "qwen3_32b", "Qwen/Qwen3-32B", False, 131072),
    "qwen3_vl_30b_a3b_thinking_fp8": Layout(
        "qwen3_vl_30b_a3b_thinking_fp8",
        "qwen3_vl_30b_a3b",
        "Qwen/Qwen3-VL-30B-A3B-Thinking-FP8",
        True,
        262144,
    ),
}

# Qwen's special tokens at their ids in the real 151,936-entry vocabulary, so that the config's
# token ids (bos/eos, the vision tokens) name the same tokens as in the hub checkpoint.
SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
TEXT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# <think> and </think> are plain added tokens in Qwen3's vocabulary (not special).
THINK_IDS = {"<think>": 151667, "</think>": 151668}

# ChatML as the Qwen3 family writes it, reduced to what the harness sends: one user turn and the
# assistant's opening. The one behaviour kept from the real templates: enable_thinking=false
# writes an empty think block, as Qwen3's own template does for non-thinking answers.
CHAT_TEMPLATE = (
    CHATML_VL_OPEN + "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)

# Qwen3-VL's video_preprocessor_config.json (its processor's pixel budget for a whole clip).
VIDEO_PROCESSOR = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"no rehearsal checkpoint for model {name!r}; valid: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


# ---------------------------------------------------------------------------------------------
# config.json


def merge(base: dict, over: dict) -> dict:
    """`base` with `over`'s fields, nested dicts merged field by field."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _hub_rope(section: dict) -> dict:
    """transformers 5's `rope_parameters` spelt as hub config.json files spell them."""
    out = dict(section)
    rope = out.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        out["rope_theta"] = rope.pop("rope_theta")
        extra = {k: v for k, v in rope.items() if k != "rope_type"}
        out["rope_scaling"] = ({**extra, "rope_type": rope["rope_type"]}) if extra else None
    return out


def hub_config(lay: Layout, fields: dict, modules_to_not_convert: list[str] | None) -> dict:
    """config.json as the hub checkpoint spells it."""
    out = _hub_rope(fields)
    if "text_config" in out:
        out["text_config"] = _hub_rope(out["text_config"]) | {"dtype": "bfloat16"}
    else:
        out["use_cache"] = True
        if "max_window_layers" not in out:
            out["max_window_layers"] = out["num_hidden_layers"]
    out["torch_dtype"] = "bfloat16"
    if lay.fp8:
        out["quantization_config"] = quantization_config(modules_to_not_convert)
    return out


def quantization_config(modules_to_not_convert: list[str] | None) -> dict:
    """The quantisation config of Qwen's block-FP8 checkpoints: e4m3 weights in 128x128 blocks,
    activations quantised at run time (dynamic), and the modules kept in bf16."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": list(modules_to_not_convert or []),
    }


def modules_to_not_convert(config) -> list[str]:
    """The bf16 modules that Qwen's FP8 checkpoints list: the output head; for the text MoE each
    layer's norms and router; for the VL model every linear layer of the vision tower and its
    mergers, each layer's router and the input embeddings."""
    if getattr(config, "vision_config", None) is not None:
        v, t = config.vision_config, config.text_config
        out = []
        for b in range(v.depth):
            out += [f"model.visual.blocks.{b}.{m}" for m in ("attn.qkv", "attn.proj")]
            out += [f"model.visual.blocks.{b}.mlp.linear_fc{i}" for i in (1, 2)]
        out += [f"model.visual.merger.linear_fc{i}" for i in (1, 2)]
        for d in range(len(v.deepstack_visual_indexes)):
            out += [f"model.visual.deepstack_merger_list.{d}.linear_fc{i}" for i in (1, 2)]
        out += [f"model.language_model.layers.{i}.mlp.gate" for i in range(t.num_hidden_layers)]
        return out + ["lm_head", "model.language_model.embed_tokens"]
    out = ["lm_head"]
    for i in range(config.num_hidden_layers):
        out += [f"model.layers.{i}.{m}" for m in ("input_layernorm", "mlp.gate")]
        out.append(f"model.layers.{i}.post_attention_layernorm")
    return out


# ---------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class Tensor:
    """One tensor of the checkpoint under its hub name."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (N(0, std)), "ones", "zeros"
    std: float
    fp8: bool  # stored as float8_e4m3fn with `<name>_scale_inv` beside it

    @property
    def scale_name(self) -> str:
        return self.name + "_scale_inv"

    @property
    def scale_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)

    @property
    def nbytes(self) -> int:
        n = math.prod(self.shape)
        return n + 2 * math.prod(self.scale_shape) if self.fp8 else 2 * n


def model_class(config):
    """The transformers auto class a config loads with (image-text-to-text for a VL model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def tensors(config, skip: list[str] | None) -> list[Tensor]:
    """Every tensor of the checkpoint, in the order of the model's parameters, under the hub's
    names: the model is built on the meta device (no memory) and each fused expert parameter is
    split into the per-expert tensors hub checkpoints store. `skip`: the modules_to_not_convert
    of an FP8 checkpoint (None: bf16); a linear layer or experts block outside it is FP8, decided
    by transformers' own rule (`should_convert_module`), as its FP8 loader decides."""
    import torch
    from torch import nn
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = model_class(config).from_config(config)
    std = float(config.get_text_config().initializer_range)
    modules = dict(model.named_modules())
    out: list[Tensor] = []
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        fp8 = (
            skip is not None
            and (type(module) is nn.Linear or owner.endswith(".experts"))
            and leaf != "bias"
            and should_convert_module(owner, skip)
        )
        if owner.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            out += _split_experts(owner, leaf, tuple(p.shape), std, fp8)
            continue
        if leaf == "bias":
            init = "zeros"
        elif "norm" in type(module).__name__.lower():
            init = "ones"
        else:
            init = "normal"
        out.append(Tensor(name, tuple(p.shape), init, std, fp8))
    return out


def _split_experts(owner: str, leaf: str, shape, std: float, fp8: bool) -> list[Tensor]:
    """transformers' fused experts ([E, 2I, H] gate_up, [E, H, I] down) as hub tensors."""
    experts, rows, cols = shape
    if leaf == "gate_up_proj":
        half = rows // 2
        return [
            Tensor(f"{owner}.{j}.{proj}.weight", (half, cols), "normal", std, fp8)
            for j in range(experts)
            for proj in ("gate_proj", "up_proj")
        ]
    return [
        Tensor(f"{owner}.{j}.down_proj.weight", (rows, cols), "normal", std, fp8)
        for j in range(experts)
    ]


def shards(specs: list[Tensor], shard_bytes: int) -> list[list[Tensor]]:
    """The tensors in order, cut into shards of at most `shard_bytes` (a larger tensor alone)."""
    out: list[list[Tensor]] = [[]]
    size = 0
    for t in specs:
        if out[-1] and size + t.nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def seed_of(seed: int, name: str) -> int:
    """The generator seed of one tensor: a hash of the run's seed and the tensor's name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(t: Tensor, seed: int, device):
    """The bf16 values of one tensor (before any quantisation), seeded by its name."""
    import torch

    if t.init == "ones":
        return torch.ones(t.shape, dtype=torch.bfloat16, device=device)
    if t.init == "zeros":
        return torch.zeros(t.shape, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(seed, t.name))
    return torch.empty(t.shape, dtype=torch.bfloat16, device=device).normal_(
        0.0, t.std, generator=g
    )


def quantize(w, block: int = BLOCK):
    """(float8_e4m3fn weight, bf16 scale per block) of a 2-D weight, block-wise as Qwen's FP8
    checkpoints store it: each `block` x `block` tile (the last ones may be smaller) has the scale
    amax / 448 rounded to bf16, and the tile divided by it, rounded to e4m3. Dequantised,
    `weight.float() * scale` (broadcast over each tile) is within e4m3's rounding of `w`."""
    import torch

    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    x = torch.zeros(br * block, bc * block, dtype=torch.float32, device=w.device)
    x[:rows, :cols] = w.float()
    tiles = x.view(br, block, bc, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    q = (tiles / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(br * block, bc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize(q, scale, block: int = BLOCK):
    """float32 weight of a block-FP8 weight and its per-block scales (the inverse of quantize,
    up to e4m3's rounding)."""
    rows, cols = q.shape
    s = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * s


def shard_tensors(shard: list[Tensor], seed: int, device) -> dict:
    """{hub name: CPU tensor} of one shard, drawn (and quantised) on `device`."""
    out = {}
    for t in shard:
        w = draw(t, seed, device)
        if t.fp8:
            q, s = quantize(w)
            out[t.name], out[t.scale_name] = q.cpu(), s.cpu()
        else:
            out[t.name] = w.cpu()
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer, generation config, processor


def build_tokenizer(vision: bool, max_length: int):
    """The embedded byte-level tokenizer (every byte one token, `rbs_bench.models.tiny`) with
    Qwen's special tokens at their real ids and the minimal ChatML template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rbs_bench.models.tiny import _byte_symbols

    specials = list(SPECIAL_IDS) if vision else list(TEXT_SPECIALS)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    vocab |= {s: SPECIAL_IDS[s] for s in specials} | THINK_IDS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in THINK_IDS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[s for s in specials if s not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def generation_config(config) -> dict:
    """The generation config's token ids (Qwen's: end of turn and end of text stop a reply). The
    sampling fields of the hub's file are left out: the harness decodes greedily."""
    return {
        "bos_token_id": SPECIAL_IDS["<|endoftext|>"],
        "eos_token_id": [SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]],
        "pad_token_id": SPECIAL_IDS["<|endoftext|>"],
    }


# ---------------------------------------------------------------------------------------------
# Writing


def plan(name: str, fields: dict, shard_bytes: int = DEFAULT_SHARD_BYTES):
    """(config.json dict, transformers config, shards of tensors) of the rehearsal checkpoint of
    model `name` with the architecture `fields` (a shipped architecture's config.json fields,
    `rbs_bench.models.rehearsal.checkpoint_fields`)."""
    from transformers import AutoConfig

    lay = layout(name)
    # a deep copy: a config's constructor may rewrite the nested dicts it is given
    spec = {k: v for k, v in copy.deepcopy(fields).items() if k != "architectures"}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    skip = modules_to_not_convert(config) if lay.fp8 else None
    return hub_config(lay, fields, skip), config, shards(tensors(config, skip), shard_bytes)


def describe(name: str, fields: dict, seed: int, device) -> dict:
    """What rbs_rehearsal.json records: everything that decides the weights."""
    import torch

    return {
        "model": name,
        "hub_layout": layout(name).hub_id,
        "seed": seed,
        "device": torch.device(device).type,
        "architecture": fields,
        "writer_version": WRITER_VERSION,
        "weights": "random (rbs_bench.models.checkpoint): scores mean nothing",
    }


def write(
    name: str,
    out,
    fields: dict,
    seed: int = 0,
    device: str = "cpu",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write the rehearsal checkpoint of model `name` with the architecture `fields` to `out`
    (see the module docstring); a finished `out` written with the same settings is left as it
    is. Returns `out`."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out).expanduser()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    about = describe(name, fields, seed, device)
    if out.exists():
        if _written(out) == about:
            print(f"{out}: already written ({name}, seed {seed})")
            return out
        raise ValueError(
            f"--out {out} exists and is not this rehearsal checkpoint; give a new directory or "
            "remove it"
        )
    config_json, config, cut = plan(name, fields, shard_bytes)
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    names = [shard_name(i, len(cut)) for i in range(len(cut))]
    left = sum(
        t.nbytes
        for shard, f in zip(cut, names, strict=True)
        for t in shard
        if not (partial / f).is_file()
    )
    free = shutil.disk_usage(partial).free
    if left > free:
        raise ValueError(
            f"{partial.parent} has {free / 2**30:.1f} GiB free, the checkpoint needs "
            f"{left / 2**30:.1f} GiB more; give --out on a larger disk"
        )
    job = about | {"shards": names}
    job_file = partial / "plan.json"
    if job_file.is_file() and json.loads(job_file.read_text()) != job:
        raise ValueError(
            f"{partial} holds an unfinished write with other settings; rerun it with those "
            "(see its plan.json) or remove the directory"
        )
    job_file.write_text(json.dumps(job, indent=2) + "\n")
    total = sum(t.nbytes for shard in cut for t in shard)
    weight_map, bar = {}, None
    if progress:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"write {name}", dynamic_ncols=True)
    for shard, file in zip(cut, names, strict=True):
        for t in shard:
            weight_map[t.name] = file
            if t.fp8:
                weight_map[t.scale_name] = file
        size = sum(t.nbytes for t in shard)
        if not (partial / file).is_file():
            tmp = partial / (file + ".tmp")
            save_file(shard_tensors(shard, seed, device), str(tmp), metadata={"format": "pt"})
            tmp.chmod(0o644)  # safetensors creates it owner-only; a checkpoint may be shared
            os.replace(tmp, partial / file)
        if bar is not None:
            bar.update(size)
    if bar is not None:
        bar.close()
    _write_json(partial / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(partial / "config.json", config_json)
    _write_json(partial / "generation_config.json", generation_config(config))
    vision = getattr(config, "vision_config", None) is not None
    build_tokenizer(vision, layout(name).max_length).save_pretrained(partial)
    if vision:
        _write_json(partial / "video_preprocessor_config.json", VIDEO_PROCESSOR)
        (partial / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(partial / MARKER, about)
    job_file.unlink()
    os.rename(partial, out)
    gib = total / 2**30
    print(f"{out}: {name}, {len(weight_map)} tensors in {len(names)} file(s), {gib:.1f} GiB")
    return out


def register_per_expert_layout() -> None:
    """Let transformers read Qwen3-VL-MoE experts stored one tensor per expert.

    Qwen's FP8 checkpoints store every expert's projections on their own
    (`...mlp.experts.{j}.gate_proj.weight` with its `weight_scale_inv`), as `qwen3_moe` ones do;
    transformers maps that layout onto its fused experts for `qwen3_moe` but, for `qwen3_vl_moe`,
    only the fused layout of the bf16 release. This adds the same per-expert converters to
    `qwen3_vl_moe` (those transformers applies to `qwen3_moe`, read from transformers itself, so
    its FP8 loader adds the scales or the dequantisation as it does there). Idempotent; a no-op
    where transformers has them already."""
    from transformers import conversion_mapping as cm

    current = cm.get_checkpoint_conversion_mapping("qwen3_vl_moe") or []
    have = {tuple(c.source_patterns) for c in current if hasattr(c, "source_patterns")}
    per_expert = cm.get_checkpoint_conversion_mapping("qwen3_moe") or []
    missing = [c for c in per_expert if tuple(getattr(c, "source_patterns", ())) not in have]
    if missing:
        cm.register_checkpoint_conversion_mapping("qwen3_vl_moe", current + missing, overwrite=True)


def _written(path: Path) -> dict | None:
    """The rbs_rehearsal.json of a finished rehearsal checkpoint, or None."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
