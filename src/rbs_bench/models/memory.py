"""How much GPU memory a prefill of one model at one context needs: an estimate before renting.

    python -m rbs_bench.models.memory                          # the paper's models, 32K-128K
    python -m rbs_bench.models.memory qwen3_32b --contexts 131072 --batch 4 --gpus 2
    python -m rbs_bench.models.memory qwen3_30b_a3b_fp8 qwen3_vl_30b_a3b_thinking_fp8

Weights: bf16, or for the `*_fp8` models as Qwen's FP8 checkpoints hold them on a GPU (e4m3
attention and expert weights with a float32 scale per 128x128 block, everything else bf16). A
vision-language model is estimated at a Video-MME sample's context (32 frames of a 720p video
through Qwen3-VL's video processor and the text around them), its vision tower's parameters and
working set included.

The peak of a prefill with the KV cache is the weights, the KV cache of every layer, and the
working set of the one layer running at that moment (layers run one after another; nothing else
is held: the harness keeps the last position's logits only). The working set is the larger of:

- attention: per token, at its fullest moment (RoPE applied to the normed queries and keys): the
  residual stream and its normed copy, the queries and keys with RoPE's temporaries, the values;
- feed-forward: per token of one chunk (`model.ffn_chunk_tokens`), for a mixture of experts the
  gathered inputs, gate/up projections, activation temporaries, down projection and weighted
  output of each of its top-k experts; for a dense MLP the gate, up, activation, product and down
  projection; plus the residual stream of every token. With the layers compiled
  (`rbs_bench.models.fastpath`, `model.compile`), a mixture of experts holds less: its peak is
  the first grouped GEMM, with each top-k expert's gathered input and its gate/up projection
  (the gated activation, the down projection and the weighted sum follow after the inputs are
  freed; one kernel sums the experts' outputs), plus the router's float32 logits.

The terms are counted from transformers' Qwen3 / Qwen3-MoE code paths; `results/scale/` sets the
estimate beside the peak each run measured.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from rbs_bench.config import FFN_CHUNK_TOKENS

GiB = 2**30
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS/cuDNN workspaces and allocator slack, roughly
ALLOC_CONF = "expandable_segments:True"


def use_expandable_segments() -> None:
    """Let PyTorch's CUDA allocator grow its segments in place, unless PYTORCH_CUDA_ALLOC_CONF is
    set already. A long prefill frees and re-allocates GiB-sized activations in every layer
    while the KV cache grows between them; with fixed segments the free memory splits into
    pieces too small for the next layer's activations (see results/scale/ for the run that
    showed it). The entry points call this before their first CUDA allocation."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)


@dataclass
class Estimate:
    weights: float  # bytes of every parameter
    kv_cache: float  # bytes of the K/V cache of every layer
    activations: float  # bytes of the largest one-layer working set
    logits: float  # the last position's logits

    @property
    def total(self) -> float:
        return (
            self.weights + self.kv_cache + self.activations + self.logits + CUDA_CONTEXT_GIB * GiB
        )

    def gib(self) -> dict:
        fields = ("weights", "kv_cache", "activations", "logits", "total")
        return {f: getattr(self, f) / GiB for f in fields}


def _get(config, name, default=None):
    return getattr(config, name, default)


def _text(config):
    """The language model's config (a vision-language config's text_config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _vision(config):
    return getattr(config, "vision_config", None)


def parameter_count(config) -> int:
    """Parameters of a Qwen3 / Qwen3-MoE / Llama-style decoder from its config, and of a Qwen3-VL
    model's vision tower when it has one."""
    t = _text(config)
    h, v, layers = t.hidden_size, t.vocab_size, t.num_hidden_layers
    d = _get(t, "head_dim") or h // t.num_attention_heads
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    attention = h * q + 2 * h * kv + q * h + 2 * d  # projections and Qwen3's q/k norms
    experts = _get(t, "num_experts", 0) or 0
    if experts:
        ffn = experts * 3 * h * t.moe_intermediate_size + experts * h  # experts + router
    else:
        ffn = 3 * h * t.intermediate_size
    tied = _get(config, "tie_word_embeddings", _get(t, "tie_word_embeddings", False))
    embeddings = v * h * (1 if tied else 2)
    return embeddings + h + layers * (attention + ffn + 2 * h) + vision_parameter_count(config)


def vision_parameter_count(config) -> int:
    """Parameters of a Qwen3-VL vision tower (0 without one): patch embedding, position
    embeddings, the blocks (two LayerNorms, qkv, output projection, two-layer MLP, with biases)
    and the patch mergers (the final one, LayerNorm before the 2x2 merge; each DeepStack one,
    after it)."""
    vc = _vision(config)
    if vc is None:
        return 0
    h, i, out = vc.hidden_size, vc.intermediate_size, vc.out_hidden_size
    merged = h * vc.spatial_merge_size**2
    patch = h * vc.in_channels * vc.temporal_patch_size * vc.patch_size**2 + h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h)
    merger = (merged * merged + merged) + (out * merged + out)
    deepstack = len(vc.deepstack_visual_indexes) * (2 * merged + merger)
    return patch + vc.num_position_embeddings * h + vc.depth * block + 2 * h + merger + deepstack


def fp8_parameter_count(config) -> int:
    """Parameters an FP8 checkpoint of Qwen's stores in e4m3: the language model's attention
    projections and experts (or dense MLP). Embeddings, output head, norms, routers and the
    vision tower stay bf16 (their `modules_to_not_convert`; rbs_bench.models.checkpoint)."""
    t = _text(config)
    h = t.hidden_size
    d = _get(t, "head_dim") or h // t.num_attention_heads
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    experts = _get(t, "num_experts", 0) or 0
    ffn = experts * 3 * h * t.moe_intermediate_size if experts else 3 * h * t.intermediate_size
    return t.num_hidden_layers * (2 * h * q + 2 * h * kv + ffn)


def weight_bytes(config, fp8: bool = False, bytes_per_param: int = 2) -> float:
    """Bytes of the weights: every parameter at `bytes_per_param`, or with `fp8` the FP8
    checkpoint's layout as transformers holds it on a GPU: e4m3 linear weights (1 byte) with a
    float32 scale per 128x128 block, the rest bf16."""
    total = parameter_count(config)
    if not fp8:
        return total * bytes_per_param
    quantized = fp8_parameter_count(config)
    return quantized * (1 + 4 / 128**2) + (total - quantized) * 2


def vision_activations(config, patches: int) -> float:
    """Bytes of one vision block's working set over `patches` patches (bf16): the residual and its
    normed copy, qkv, the attention output, the MLP's two intermediates; plus the float32 pixels
    and the DeepStack features kept for the language model."""
    vc = _vision(config)
    if vc is None or not patches:
        return 0.0
    h, i = vc.hidden_size, vc.intermediate_size
    pixels = patches * vc.in_channels * vc.temporal_patch_size * vc.patch_size**2 * 4
    tokens = patches // vc.spatial_merge_size**2
    kept = (1 + len(vc.deepstack_visual_indexes)) * tokens * vc.out_hidden_size * 2
    return patches * 2 * (6 * h + 2 * i) + pixels + kept


def estimate(
    config,
    context: int,
    batch: int = 1,
    weight_bytes_per_param: int = 2,
    ffn_chunk_tokens: int | None = None,
    fp8: bool = False,
    visual_tokens: int = 0,
    compiled: bool = False,
) -> Estimate:
    """The peak memory of a prefill of `batch` prompts of `context` tokens that fills the cache:
    weights of `weight_bytes_per_param` per parameter (2: bf16) or, with `fp8`, in the layout of
    Qwen's FP8 checkpoints (`weight_bytes`); activations and cache in bf16. `visual_tokens` of the
    context come from a vision tower, which runs before the language model: its working set
    counts when it is the larger one. `compiled`: the layers' regions outside attention
    compiled (a mixture of experts' leaner working set)."""
    t = _text(config)
    h, layers = t.hidden_size, t.num_hidden_layers
    d = _get(t, "head_dim") or h // t.num_attention_heads
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    tokens = batch * context
    b = 2  # bf16 activations and KV cache
    # attention sublayer, per token, at its fullest (RoPE on the normed queries): the residual
    # stream and its normed copy, the normed queries with RoPE's two temporaries and its result,
    # and keys (likewise) and values; Qwen3's fp32 q-norm intermediate peaks no higher
    attention = tokens * b * (2 * h + 4 * q + 5 * kv)
    chunk = tokens if ffn_chunk_tokens is None else min(tokens, ffn_chunk_tokens)
    experts = _get(t, "num_experts", 0) or 0
    if experts:
        k, inter = t.num_experts_per_tok, t.moe_intermediate_size
        if compiled:  # gathered inputs and gate/up at the first grouped GEMM; fp32 router logits
            per_token = k * b * (h + 2 * inter) + experts * 4
        else:  # gathered, gate/up, activation, down, weighted
            per_token = k * b * (3 * h + 4 * inter)
    else:
        per_token = b * (4 * t.intermediate_size + h)  # gate, up, act, product, down
    feedforward = chunk * per_token + tokens * h * 3 * b  # + residual, normed input, output
    vc = _vision(config)
    patches = batch * visual_tokens * vc.spatial_merge_size**2 if vc is not None else 0
    return Estimate(
        weights=weight_bytes(config, fp8, weight_bytes_per_param),
        kv_cache=2 * layers * tokens * kv * b,
        activations=max(attention, feedforward, vision_activations(config, patches)),
        logits=batch * t.vocab_size * 4,
    )


def is_fp8(name: str) -> bool:
    """Whether model `name` runs from an FP8 checkpoint (the `*_fp8` model configs)."""
    return name.endswith("_fp8")


def model_config(name: str, layers: int | None = None):
    """The transformers config of a model name: a conf/model entry with a shipped architecture
    (qwen3_30b_a3b_random, qwen3_32b, qwen3_vl_30b_a3b_thinking_fp8, ...) or a shipped
    architecture name; `layers` decoder layers of its language model."""
    from rbs_bench.models import rehearsal

    arch = rehearsal.ARCHITECTURE_OF.get(name, name)
    overrides = {}
    if layers is not None:
        vl = "text_config" in rehearsal.architecture_fields(arch)
        overrides = {"text_config": {"num_hidden_layers": layers}} if vl else {}
        overrides = overrides or {"num_hidden_layers": layers}
    return rehearsal.architecture_config(arch, **overrides)


# Video-MME on a VL model (the paper's setting): 32 frames of a 720p video through Qwen3-VL's
# video processor (rbs_bench.models.checkpoint.VIDEO_PROCESSOR), plus the prompt's text and the
# answer; the frame budget, not the resolution, decides the count for any HD video.
VIDEOMME_FRAMES, VIDEOMME_SIZE, VIDEOMME_TEXT_TOKENS = 32, (720, 1280), 1024


def video_tokens(frames: int = VIDEOMME_FRAMES, size: tuple[int, int] = VIDEOMME_SIZE) -> int:
    """Video tokens of a `frames`-frame clip of `size` (height, width) under Qwen3-VL's video
    processor config (as rbs_bench.models.vision computes them for a run)."""
    from rbs_bench.models.checkpoint import VIDEO_PROCESSOR
    from rbs_bench.models.vision import VideoProcessor

    proc = VideoProcessor.for_counting(VIDEO_PROCESSOR)
    return proc.num_video_tokens(frames, *size)


def videomme_context(frames: int = VIDEOMME_FRAMES, size: tuple[int, int] = VIDEOMME_SIZE) -> int:
    """A Video-MME sample's context on a VL model: its video tokens and the text around them."""
    return video_tokens(frames, size) + VIDEOMME_TEXT_TOKENS


def estimate_model(
    name: str,
    context: int,
    batch: int = 1,
    layers: int | None = None,
    ffn_chunk_tokens: int | None = FFN_CHUNK_TOKENS,
    weight_bytes_per_param: int | None = None,
    visual_tokens: int | None = None,
    compiled: bool = True,
) -> Estimate:
    """`estimate` for a model name: FP8 weights for the `*_fp8` models (unless
    `weight_bytes_per_param` is given), and for a VL model `visual_tokens` of the context from its
    vision tower (default: a Video-MME sample's, at most `context`); `compiled` (default, as
    runs on a GPU are): the layers' regions outside attention compiled."""
    config = model_config(name, layers)
    fp8 = is_fp8(name) and weight_bytes_per_param is None
    if _vision(config) is None:
        visual = 0
    else:
        visual = min(video_tokens() if visual_tokens is None else visual_tokens, context)
    return estimate(
        config, context, batch, weight_bytes_per_param or 2, ffn_chunk_tokens, fp8, visual,
        compiled,
    )  # fmt: skip


def per_gpu(e: Estimate, gpus: int) -> float:
    """Bytes on the busiest of `gpus` GPUs with the layers spread evenly (model.device_map=auto):
    its share of weights and cache, one layer's activations and the logits, its CUDA context."""
    return (e.weights + e.kv_cache) / gpus + e.activations + e.logits + CUDA_CONTEXT_GIB * GiB


def default_contexts(name: str) -> list[int]:
    """The contexts to estimate a model at: a VL model's Video-MME context, else 32K-128K."""
    vl = _vision(model_config(name)) is not None
    return [videomme_context()] if vl else [32768, 65536, 131072]


def table(
    names,
    contexts,
    batch: int,
    gpus: int,
    gpu_gib: float,
    chunk: int | None,
    bytes_=None,
    compiled: bool = True,
):
    """Markdown rows: per model and context, each term in GiB and whether it fits the GPUs."""
    lines = [
        "| model | context | batch | weights | KV cache | one layer's activations | total | "
        f"fits {gpus} x {gpu_gib:g} GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        for n in contexts or default_contexts(name):
            est = estimate_model(
                name, n, batch, ffn_chunk_tokens=chunk, weight_bytes_per_param=bytes_,
                compiled=compiled,
            )  # fmt: skip
            e = est.gib()
            busiest = per_gpu(est, gpus) / GiB
            fits = "yes" if busiest <= gpu_gib else f"no ({busiest:.0f} GiB per GPU)"
            lines.append(
                f"| {name} | {n} | {batch} | {e['weights']:.1f} | {e['kv_cache']:.1f} | "
                f"{e['activations']:.1f} | {e['total']:.1f} | {fits} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["qwen3_30b_a3b", "qwen3_32b"])
    ap.add_argument(
        "--contexts", type=int, nargs="+", help="default: 32K-128K; a VL model's Video-MME context"
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu-gib", type=float, default=79.0, help="usable memory per GPU (H100: 79)")
    ap.add_argument("--ffn-chunk-tokens", type=int, default=FFN_CHUNK_TOKENS, help="0: unchunked")
    ap.add_argument(
        "--weight-bytes",
        type=int,
        help="bytes per parameter for every weight; default: the model's own (FP8 for *_fp8)",
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="layers run eagerly (model.compile=false; a CPU's default), not compiled",
    )
    args = ap.parse_args(argv)
    try:
        print(
            table(
                args.models,
                args.contexts,
                args.batch,
                args.gpus,
                args.gpu_gib,
                args.ffn_chunk_tokens or None,
                args.weight_bytes,
                compiled=not args.eager,
            )
        )
    except ValueError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
