"""Decoding on a captured step (models/graph_decode.py): the static cache it decodes on, its check
against eager decoding, and its fall-backs. On the CPU the "graph" is the same step run eagerly on
the static cache (`Replayed`); the capture itself runs in the gpu test at the end."""

from __future__ import annotations

import logging

import pytest
import torch

from rbs_bench.models import generate, graph_decode
from rbs_bench.models.tiny import tiny_config


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(tiny_config(num_hidden_layers=2)).eval()
    m.config._attn_implementation = "sdpa"
    return m


class Replayed(graph_decode.GraphDecoder):
    """A decoder whose "graph" replays the step eagerly (the CPU has no CUDA graphs); `corrupt`
    adds a constant to one logit from the step it names on."""

    captures = 0

    def __init__(self, model, corrupt: int | None = None):
        super().__init__(model)
        self.corrupt, self.steps = corrupt, 0

    def _capture(self):
        Replayed.captures += 1
        self.graph = self

    def replay(self):
        self._step_eagerly()
        self.steps += 1
        if self.corrupt is not None and self.steps >= self.corrupt:
            self.logits[0, 7] += 1e3
            self.token.copy_(self.logits.argmax(-1, keepdim=True))


def _prompt(n, seed=1):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _eager(model, ids, steps):
    new, _, _, mode = generate.greedy_generate(model, ids, steps, set(), graphs=False)
    assert mode == "eager"
    return new


def test_the_first_prompt_is_checked_then_the_graph_decodes_the_same_tokens(model, monkeypatch):
    decoder = Replayed(model)
    monkeypatch.setattr(graph_decode, "decoder_of", lambda m: decoder)
    for seed, n in ((1, 300), (2, 257), (3, 300)):
        ids = _prompt(n, seed)
        want = _eager(model, ids, 12)
        got, _, _, mode = generate.greedy_generate(model, ids, 12, set(), graphs=True)
        assert got == want
        # the checked prompt's tokens are eager ones; after it the graph's
        assert mode == ("eager" if seed == 1 else "cuda_graph")
        assert decoder.validated and decoder.disabled is None
    assert decoder.capacity == graph_decode.CAPACITY_STEP


def test_a_graph_that_disagrees_is_dropped_and_eager_tokens_are_returned(
    model, monkeypatch, caplog
):
    decoder = Replayed(model, corrupt=3)
    monkeypatch.setattr(graph_decode, "decoder_of", lambda m: decoder)
    ids = _prompt(200)
    want = _eager(model, ids, 8)
    with caplog.at_level(logging.WARNING):
        got, _, _, mode = generate.greedy_generate(model, ids, 8, set(), graphs=True)
    assert got == want and mode == "eager"
    assert "step 3 gave token 7" in decoder.disabled
    assert "decoding eagerly" in caplog.text
    got, _, _, mode = generate.greedy_generate(model, ids, 8, set(), graphs=True)
    assert got == want and mode == "eager"  # disabled for good


def test_a_longer_prompt_than_the_capacity_captures_again(model, monkeypatch):
    decoder = Replayed(model)
    monkeypatch.setattr(graph_decode, "decoder_of", lambda m: decoder)
    monkeypatch.setattr(graph_decode, "CAPACITY_STEP", 256)
    before = Replayed.captures
    for n in (100, 120, 300):
        ids = _prompt(n, n)
        got, *_ = generate.greedy_generate(model, ids, 6, set(), graphs=True)
        assert got == _eager(model, ids, 6)
    assert decoder.capacity == 512 and Replayed.captures - before == 2


def test_end_tokens_and_budgets_stop_both_ways(model, monkeypatch):
    decoder = Replayed(model)
    monkeypatch.setattr(graph_decode, "decoder_of", lambda m: decoder)
    ids = _prompt(150)
    want = _eager(model, ids, 10)
    for eos in ({want[0]}, {want[4]}):
        a, *_ = generate.greedy_generate(model, ids, 10, eos, graphs=False)
        generate.greedy_generate(model, ids, 10, set(), graphs=True)  # validated after this
        b, _, _, mode = generate.greedy_generate(model, ids, 10, eos, graphs=True)
        assert a == b == want[: want.index(next(iter(eos))) + 1]
    one, _, _, mode = generate.greedy_generate(model, ids, 1, set(), graphs=True)
    assert one == want[:1] and mode == "eager"  # no decode step


def test_graphs_asked_for_on_a_cpu_fall_back_with_one_line(model, caplog):
    model.__dict__.pop("_rbs_graph_decoder", None)
    ids = _prompt(120)
    want = _eager(model, ids, 5)
    with caplog.at_level(logging.WARNING):
        got, _, _, mode = generate.greedy_generate(model, ids, 5, set(), graphs=True)
    assert got == want and mode == "eager"
    assert "could not be captured" in graph_decode.decoder_of(model).disabled
    model.__dict__.pop("_rbs_graph_decoder", None)


def test_a_static_cache_too_large_is_not_made(model, monkeypatch):
    decoder = Replayed(model)
    monkeypatch.setattr(graph_decode, "decoder_of", lambda m: decoder)
    monkeypatch.setattr(graph_decode, "MAX_CACHE_BYTES", 1024)
    ids = _prompt(100)
    got, _, _, mode = generate.greedy_generate(model, ids, 4, set(), graphs=True)
    assert got == _eager(model, ids, 4) and mode == "eager" and decoder.cache is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_captured_step_decodes_the_eager_tokens_on_cuda(dtype):
    """The real capture: the shipped model's architecture at 5K tokens, random weights."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(tiny_config()).eval().to("cuda", dtype)
    m.config._attn_implementation = "sdpa"
    for seed in range(3):
        ids = _prompt(5000 + 7 * seed, seed).cuda()
        want = _eager(m, ids, 16)
        got, _, _, mode = generate.greedy_generate(m, ids, 16, set(), graphs=True)
        assert got == want, (seed, mode, graph_decode.decoder_of(m).disabled)
        assert mode == ("eager" if seed == 0 else "cuda_graph"), graph_decode.decoder_of(m).disabled
