"""How much GPU memory a prefill of one model at one context needs: an estimate before renting.

    python -m rbs_bench.models.memory                          # the paper's models, 32K-128K
    python -m rbs_bench.models.memory qwen3_32b --contexts 131072 --batch 4 --gpus 2

The peak of a prefill with the KV cache is the weights, the KV cache of every layer, and the
working set of the one layer running at that moment (layers run one after another; nothing else
is held: the harness keeps the last position's logits only). The working set is the larger of:

- attention: per token, at its fullest moment (RoPE applied to the normed queries and keys): the
  residual stream and its normed copy, the queries and keys with RoPE's temporaries, the values;
- feed-forward: per token of one chunk (`model.ffn_chunk_tokens`), for a mixture of experts the
  gathered inputs, gate/up projections, activation temporaries, down projection and weighted
  output of each of its top-k experts; for a dense MLP the gate, up, activation, product and down
  projection; plus the residual stream of every token.

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


def parameter_count(config) -> int:
    """Parameters of a Qwen3 / Qwen3-MoE / Llama-style decoder from its config."""
    h, v, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    d = _get(config, "head_dim") or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    attention = h * q + 2 * h * kv + q * h + 2 * d  # projections and Qwen3's q/k norms
    experts = _get(config, "num_experts", 0) or 0
    if experts:
        ffn = experts * 3 * h * config.moe_intermediate_size + experts * h  # experts + router
    else:
        ffn = 3 * h * config.intermediate_size
    embeddings = v * h * (1 if _get(config, "tie_word_embeddings", False) else 2)
    return embeddings + h + layers * (attention + ffn + 2 * h)


def estimate(
    config, context: int, batch: int = 1, weight_bytes: int = 2, ffn_chunk_tokens: int | None = None
) -> Estimate:
    """The peak memory of a prefill of `batch` prompts of `context` tokens that fills the cache:
    weights of `weight_bytes` per parameter (2: bf16, 1: FP8), activations and cache in bf16."""
    h, layers = config.hidden_size, config.num_hidden_layers
    d = _get(config, "head_dim") or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    tokens = batch * context
    b = 2  # bf16 activations and KV cache
    # attention sublayer, per token, at its fullest (RoPE on the normed queries): the residual
    # stream and its normed copy, the normed queries with RoPE's two temporaries and its result,
    # and keys (likewise) and values; Qwen3's fp32 q-norm intermediate peaks no higher
    attention = tokens * b * (2 * h + 4 * q + 5 * kv)
    chunk = tokens if ffn_chunk_tokens is None else min(tokens, ffn_chunk_tokens)
    experts = _get(config, "num_experts", 0) or 0
    if experts:
        k, inter = config.num_experts_per_tok, config.moe_intermediate_size
        per_token = k * b * (3 * h + 4 * inter)  # gathered, gate/up, activation, down, weighted
    else:
        per_token = b * (4 * config.intermediate_size + h)  # gate, up, act, product, down
    feedforward = chunk * per_token + tokens * h * 3 * b  # + residual, normed input, output
    return Estimate(
        weights=parameter_count(config) * weight_bytes,
        kv_cache=2 * layers * tokens * kv * b,
        activations=max(attention, feedforward),
        logits=batch * config.vocab_size * 4,
    )


def model_config(name: str, layers: int | None = None):
    """The transformers config of a model name: a conf/model entry with a shipped architecture
    (qwen3_30b_a3b_random, qwen3_32b, ...) or a shipped architecture name."""
    from rbs_bench.models import rehearsal

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    arch = {
        "qwen3_30b_a3b_fp8": "qwen3_30b_a3b",
        "qwen3_30b_a3b_random": "qwen3_30b_a3b",
        "qwen3_32b": "qwen3_32b",
        "qwen3_32b_random": "qwen3_32b",
    }.get(name, name)
    return rehearsal.architecture_config(arch, **overrides)


def table(names, contexts, batch: int, gpus: int, gpu_gib: float, chunk: int | None, bytes_=2):
    """Markdown rows: per model and context, each term in GiB and whether it fits the GPUs."""
    lines = [
        "| model | context | batch | weights | KV cache | one layer's activations | total | "
        f"fits {gpus} x {gpu_gib:g} GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        config = model_config(name)
        for n in contexts:
            e = estimate(config, n, batch, bytes_, chunk).gib()
            # layers spread evenly over the GPUs; the busiest GPU also holds one layer's activations
            per_gpu = (e["weights"] + e["kv_cache"]) / gpus + e["activations"] + CUDA_CONTEXT_GIB
            fits = "yes" if per_gpu <= gpu_gib else f"no ({per_gpu:.0f} GiB per GPU)"
            lines.append(
                f"| {name} | {n} | {batch} | {e['weights']:.1f} | {e['kv_cache']:.1f} | "
                f"{e['activations']:.1f} | {e['total']:.1f} | {fits} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["qwen3_30b_a3b", "qwen3_32b"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu-gib", type=float, default=79.0, help="usable memory per GPU (H100: 79)")
    ap.add_argument(
        "--ffn-chunk-tokens", type=int, default=FFN_CHUNK_TOKENS, help="0: unchunked"
    )
    ap.add_argument("--weight-bytes", type=int, default=2, help="2 for bf16 weights, 1 for FP8")
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
            )
        )
    except ValueError as e:
        print(f"rbs-bench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
