"""Greedy generation as the runner times it: one prefill (the last position's logits only), then
one token at a time until an end token or the budget of new tokens, on a CUDA graph where the model
allows it (`graph_decode`)."""

from __future__ import annotations

import time

import torch

from rbs_bench.errors import UserError
from rbs_bench.models import graph_decode


@torch.inference_mode()
def greedy_generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos: set[int],
    graphs: bool | None = None,
    **prefill_inputs,
):
    """Prefill + greedy decode. Returns (new token ids, seconds to first token, seconds total,
    how the tokens after the first were decoded: "cuda_graph" or "eager").

    `graphs`: decode on a CUDA graph (`graph_decode`) where the model allows it; None: on CUDA.
    `prefill_inputs` (a video's pixels, grid and token types) go to the prefill call only; such
    prompts decode eagerly (their position state is the model's own)."""
    from rbs_bench.models.vision import reset_position_state

    reset_position_state(model)  # a multimodal model's RoPE offset belongs to one prompt
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    # The last position's logits only: a 128K prompt's full logits (N x vocab) would take more
    # memory than the KV cache of every layer.
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **prefill_inputs)
    logits = out.logits[:, -1]
    if not torch.isfinite(logits).all():
        raise UserError(
            "the model produced NaN/Inf logits in prefill; check model.dtype "
            "(float16 can overflow) and the checkpoint"
        )
    token = logits.argmax(-1, keepdim=True)  # [1, 1]
    sync()
    ttft = time.perf_counter() - t0
    new = [int(token)]
    past = out.past_key_values
    mode = "eager"
    if len(new) < max_new_tokens and new[-1] not in eos:
        if graphs is None:
            graphs = input_ids.is_cuda
        decoder = graph_decode.decoder_of(model) if graphs and not prefill_inputs else None
        if decoder is not None and decoder.usable(past, input_ids, max_new_tokens):
            mode = _graph_decode(decoder, model, past, token, new, max_new_tokens, eos)
        else:
            _eager_decode(model, past, token, new, max_new_tokens, eos)
    sync()
    return new, ttft, time.perf_counter() - t0, mode


def _eager_steps(model, past, token, new: list[int], max_new_tokens: int, eos: set[int]):
    """Decode one token at a time on the dynamic cache, appending to `new`; yields each step's
    last logits ([1, vocab]) once its token is appended."""
    while len(new) < max_new_tokens and new[-1] not in eos:
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        new.append(int(token))
        yield logits


def _eager_decode(model, past, token, new: list[int], max_new_tokens: int, eos: set[int]) -> None:
    """Decode one token at a time on the dynamic cache, appending to `new`."""
    for _ in _eager_steps(model, past, token, new, max_new_tokens, eos):
        pass


def _graph_decode(decoder, model, past, token, new, max_new_tokens, eos) -> str:
    """Decode on the decoder's graph, appending to `new`; returns how the tokens were decoded.

    The decoder's first prompt decodes both ways, step by step: the graph is kept only where each
    step's token is the eager one and the logits agree within `graph_decode.tolerance`. Until then,
    and where anything fails, the eager tokens are the ones returned."""
    try:
        decoder.start(past, token)
    except RuntimeError as err:  # graph_decode.GraphUnavailable among them
        decoder.disable(f"its decode step could not be captured ({type(err).__name__}: {err})")
        _eager_decode(model, past, token, new, max_new_tokens, eos)
        return "eager"
    if decoder.validated:
        while len(new) < max_new_tokens and new[-1] not in eos:
            new.append(int(decoder.step()))
        return "cuda_graph"
    steps = _eager_steps(model, past, token, new, max_new_tokens, eos)
    for logits in steps:
        bound = graph_decode.tolerance(logits.dtype)
        want = logits.float()
        got_token = int(decoder.step())
        got = decoder.logits.float()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if got_token != new[-1] or not err <= bound:
            decoder.disable(
                f"its graph's step {len(new) - 1} gave token {got_token} where eager decoding "
                f"gave {new[-1]} (logits apart by {err:.3g} of their largest, bound {bound:.3g})"
            )
            for _ in steps:  # the rest eagerly, on the same cache
                pass
            return "eager"
    decoder.validated = True
    return "eager"


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a generation: the model's generation config's and the tokenizer's."""
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids
