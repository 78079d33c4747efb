"""Run each decoder layer's feed-forward block over a bounded number of tokens at a time.

A prefill of N tokens holds the feed-forward block's intermediates for all N at once. In a
mixture of experts (Qwen3-MoE) every token goes to 8 experts, and transformers' grouped path keeps
the gathered inputs, the gate/up and down projections of all N x 8 (token, expert) rows: about
145 KB per token for Qwen3-30B-A3B, 18 GiB at 128K tokens and 73 GiB for a batch of four, more
than the weights of a 4-layer model and the KV cache together. A dense MLP (Qwen3-32B) holds
about 150 KB per token. The block is a function of each token alone, so running it over chunks of
the flattened tokens and writing each chunk's output into one buffer computes the same values
(rows are independent; only the matrix products' tiling differs) with the intermediates of one
chunk alive at a time. vLLM's fused MoE runs in token chunks for the same reason.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_ORIGINAL = "_rbs_ffn_forward"  # the block's own forward, kept on the module while wrapped


def decoder_feedforwards(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The feed-forward block (`mlp`) of every decoder layer (a module with `self_attn` and
    `mlp`): Qwen3, Qwen3-MoE, Llama, and the language model of Qwen3-VL."""
    return [
        m.mlp
        for m in model.modules()
        if isinstance(getattr(m, "mlp", None), torch.nn.Module) and hasattr(m, "self_attn")
    ]


def chunk_feedforward(model: torch.nn.Module, tokens: int | None) -> int:
    """Run every decoder layer's feed-forward block over at most `tokens` tokens at a time
    (None: unchunked again). Returns the number of blocks set."""
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"model.ffn_chunk_tokens={tokens!r}: a positive integer or null")
    blocks = decoder_feedforwards(model)
    for block in blocks:
        if _ORIGINAL in block.__dict__:  # set before: back to the block's own forward first
            own = block.__dict__.pop(_ORIGINAL)
            if own is None:
                del block.forward  # the class's forward
            else:
                block.forward = own  # e.g. accelerate's device hook
        if tokens is not None:
            block.__dict__[_ORIGINAL] = block.__dict__.get("forward")
            block.forward = functools.partial(_chunked, block.forward, tokens)
    return len(blocks)


def _chunked(forward, tokens: int, x: Tensor, *args, **kwargs) -> Tensor:
    """forward(x) for x [B, L, H] computed over the flattened tokens in chunks of `tokens`."""
    if x.dim() != 3 or x.shape[0] * x.shape[1] <= tokens:
        return forward(x, *args, **kwargs)
    b, n, h = x.shape
    flat = x.reshape(1, b * n, h)
    out = None
    for start in range(0, b * n, tokens):
        part = forward(flat[:, start : start + tokens], *args, **kwargs)
        if not isinstance(part, Tensor) or part.shape[-1] != h:
            raise ValueError(
                f"{type(forward).__name__}: the feed-forward block returned "
                f"{type(part).__name__}, not one tensor of its input's width; set "
                "model.ffn_chunk_tokens=null for this model"
            )
        if out is None:
            out = part.new_empty(1, b * n, h)
        out[:, start : start + part.shape[1]] = part
    return out.view(b, n, h)
