"""Greedy generation as the runner times it: one prefill (the last position's logits only), then
one token at a time until an end token or the budget of new tokens."""

from __future__ import annotations

import time

import torch

from rbs_bench.errors import UserError


@torch.inference_mode()
def greedy_generate(
    model, input_ids: torch.Tensor, max_new_tokens: int, eos: set[int], **prefill_inputs
):
    """Prefill + greedy decode. Returns (new token ids, seconds to first token, seconds total).

    `prefill_inputs` (a video's pixels, grid and token types) go to the prefill call only."""
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
    while len(new) < max_new_tokens and new[-1] not in eos:
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(token))
    sync()
    return new, ttft, time.perf_counter() - t0


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a generation: the model's generation config's and the tokenizer's."""
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids
