"""Decoding on a CUDA graph: one captured decode step, replayed per new token.

A small model's decode step is bound by Python and kernel launches, not by the GPU: the embedded
model's 6 layers take about 9 ms a token on an H100 in eager mode, 30 times its prefill's GPU
time per token of answer. A CUDA graph replays the step's kernels without Python.

How it works (`GraphDecoder`):
- the prefill runs as before, into the model's own dynamic cache, so the sparse prefill path and
  its timings do not change;
- its keys and values are copied into a static cache of `capacity` tokens (transformers'
  `StaticCache`, whose write position is a device tensor);
- the decode step (embedding, layers, last logits, argmax, feeding the token back) is captured
  once and replayed per token; a longer prompt than the capacity captures again.

The static cache attends over its whole capacity with a mask, where the dynamic cache attends over
exactly the tokens so far: the same keys, through another SDPA kernel, so the logits agree to
rounding, not bit for bit. The first sample of each decoder is therefore decoded both ways, and
the graph is used only where every step's token agrees and its logits lie within the rounding of
the model's dtype; otherwise the model decodes eagerly, with one line saying why. Each record
says how its tokens were decoded (`decode`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# A static cache (keys and values of every layer) larger than this is not worth a second copy of
# the prefill's cache: a large model's decode steps are not launch-bound anyway.
MAX_CACHE_BYTES = 2 << 30
# Capacities are rounded up to a multiple of this, so prompts of nearby lengths share a graph.
CAPACITY_STEP = 4096


class GraphUnavailable(RuntimeError):
    """The model's decode step cannot run on a graph here (the reason is the message)."""


def _static_cache_class():
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    return StaticCache, StaticLayer


def cache_bytes(past, capacity: int) -> int:
    """Bytes of a static cache of `capacity` tokens shaped like the dynamic cache `past`."""
    total = 0
    for layer in past.layers:
        for t in (layer.keys, layer.values):
            b, h, _, d = t.shape
            total += b * h * capacity * d * t.element_size()
    return total


class GraphDecoder:
    """The decode steps of one model on one device, on a captured CUDA graph."""

    def __init__(self, model):
        self.model = model
        self.capacity = 0
        self.cache = None
        self.graph = None
        self.token = None  # [1, 1] int64: the graph's input, replaced by its output
        self.logits = None  # [1, vocab]: the last step's logits (validation)
        self.validated = False
        self.disabled: str | None = None  # why the graph is not used

    def usable(self, past, input_ids: torch.Tensor, max_new_tokens: int) -> bool:
        """True when this prompt's remaining tokens can decode on the graph."""
        if self.disabled is not None or input_ids.shape[0] != 1:
            return False
        layers = getattr(past, "layers", None)
        if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            return False  # sliding windows, linear attention, offloaded or quantised caches
        need = input_ids.shape[1] + max_new_tokens
        capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        if cache_bytes(past, max(capacity, self.capacity)) > MAX_CACHE_BYTES:
            return False
        if capacity > self.capacity:
            self.capacity, self.cache, self.graph = capacity, None, None
        return True

    def load(self, past) -> None:
        """Copy the prefill's keys and values into the static cache (built on first use)."""
        static_cache, static_layer = _static_cache_class()
        if self.cache is None:
            self.cache = static_cache(config=self.model.config, max_cache_len=self.capacity)
            if len(self.cache.layers) != len(past.layers) or any(
                type(layer) is not static_layer for layer in self.cache.layers
            ):
                raise GraphUnavailable("its static cache has other layers than its dynamic one")
        for mine, theirs in zip(self.cache.layers, past.layers):
            if mine.is_initialized:
                mine.cumulative_length.zero_()
            mine.update(theirs.keys, theirs.values)

    def _positions(self) -> list[torch.Tensor]:
        return [layer.cumulative_length.clone() for layer in self.cache.layers]

    def _restore(self, positions: list[torch.Tensor]) -> None:
        for layer, pos in zip(self.cache.layers, positions):
            layer.cumulative_length.copy_(pos)

    def _step_eagerly(self) -> None:
        out = self.model(input_ids=self.token, past_key_values=self.cache, use_cache=True)
        self.logits = out.logits[:, -1]
        self.token.copy_(self.logits.argmax(-1, keepdim=True))

    def _capture(self) -> None:
        """Warm up on a side stream (allocator pools, lazy kernels), then capture one step."""
        positions = self._positions()
        first = self.token.clone()
        stream = torch.cuda.Stream(self.token.device)
        stream.wait_stream(torch.cuda.current_stream(self.token.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.token.copy_(first)
                self._step_eagerly()
                self._restore(positions)
        torch.cuda.current_stream(self.token.device).wait_stream(stream)
        self.token.copy_(first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._step_eagerly()
        self.graph = graph

    def start(self, past, token: torch.Tensor) -> None:
        """Take the prefill's cache and its first token; capture if needed."""
        self.load(past)
        if self.token is None or self.token.device != token.device:
            self.token = torch.empty(1, 1, dtype=torch.long, device=token.device)
            self.graph = None
        self.token.copy_(token)
        if self.graph is None:
            self._capture()

    def step(self) -> torch.Tensor:
        """One decode step on the graph: returns the next token ([1, 1], the graph's buffer)."""
        self.graph.replay()
        return self.token

    def disable(self, why: str) -> None:
        self.disabled = why
        self.cache = self.graph = self.token = self.logits = None
        log.warning("decoding eagerly: %s", why)


def tolerance(dtype: torch.dtype) -> float:
    """Largest |logit difference| / max |logit| that two decodes of the same keys may show: a few
    units of the dtype's rounding (the two SDPA kernels round the softmax and the values apart),
    and no less than 1e-4 (float32 kernels sum in other orders)."""
    return max(8 * torch.finfo(dtype).eps, 1e-4)


def decoder_of(model) -> GraphDecoder:
    """The model's decoder, made on first use (one per loaded model)."""
    decoder = model.__dict__.get("_rbs_graph_decoder")
    if decoder is None:
        decoder = model.__dict__["_rbs_graph_decoder"] = GraphDecoder(model)
    return decoder
