"""The compiled layer path (`rbs_bench.models.fastpath`) computes what the eager model computes.

On the CPU inductor compiles the regions to C++; the logits are compared with the eager model's
in fp32, where the only differences are the fused kernels' summation order. On a GPU the same
check runs in bf16 on a Qwen3-30B-A3B-shaped layer, with the tolerance taken from the eager bf16
model's own distance to fp32.
"""

from __future__ import annotations

import pytest
import torch
from model_fakes import dispatch_layers

from rbs_bench import methods
from rbs_bench.models import fastpath, hf_attention, rehearsal, tiny
from rbs_bench.models.feedforward import chunk_feedforward

SMALL_MOE = dict(  # Qwen3-30B-A3B with its widths shrunk for a CPU
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=512,
)


def moe(layers: int, dtype=torch.float32, device="cpu", seed=0, **fields):
    hf_attention.register()
    config = rehearsal.architecture_config(
        "qwen3_30b_a3b", num_hidden_layers=layers, **(SMALL_MOE | fields)
    )
    return rehearsal.build(config, device, dtype, seed, hf_attention.ATTN_IMPL)


def dense_tiny():
    hf_attention.register()
    torch.manual_seed(0)
    return tiny.build_model(tiny.tiny_config(attn_implementation=hf_attention.ATTN_IMPL)).eval()


def logits(model, ids, **kw):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=0, **kw).logits


@pytest.mark.slow
@pytest.mark.parametrize("build", [lambda: moe(3), dense_tiny], ids=["qwen3_moe", "qwen3"])
def test_compiled_logits_equal_eager_prefill_and_decode(build):
    model = build()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=g)
    want = logits(model, ids)
    assert fastpath.install(model) == model.config.num_hidden_layers
    chunk_feedforward(model, 128)  # chunks of the compiled feed-forward blocks, as loaded
    assert fastpath.is_installed(model)
    torch.testing.assert_close(logits(model, ids), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(model, ids[:, :257]), want[:, :257], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():  # a decode step through the cache the compiled prefill filled
        out = model(input_ids=ids[:, :200], use_cache=True)
        for layer in out.past_key_values.layers:  # the prefill's own k and v, each its own buffer
            for t in (layer.keys, layer.values):
                assert t.is_contiguous() and t.shape[-2] == 200
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        step = model(input_ids=ids[:, 200:201], past_key_values=out.past_key_values)
    torch.testing.assert_close(step.logits[0, -1], want[0, 200], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_layers_run_the_sparse_method_unchanged():
    """The attention stays eager: a sparse method selects the same blocks and gives the same
    logits with the compiled layers around it."""
    model = moe(2)
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(2))
    selector = methods.build(
        "rbs", block_size=32, sink_blocks=1, window_blocks=1, last_q_blocks=1
    ).with_knob(4.0)
    rec = hf_attention.install(model, selector)
    want, want_density = logits(model, ids), rec.summary()["density_layers_heads"]
    fastpath.install(model)
    rec.reset()
    got = logits(model, ids)
    assert rec.summary()["density_layers_heads"] == want_density
    assert want_density[0][0] < 1.0  # the sparse path ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_layers_share_one_graph_per_region():
    """Parameters are graph inputs: a deeper model compiles no more graphs."""
    from torch._dynamo.utils import counters

    graphs = []
    for layers in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        model = moe(layers)
        fastpath.install(model)
        logits(model, torch.randint(0, 512, (1, 200)))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] > 0


def test_install_false_restores_every_eager_forward():
    model = moe(2)
    layer = fastpath.decoder_layers(model)[0]
    parts = (layer.self_attn, layer.mlp, layer.mlp.experts, layer.input_layernorm)
    own = [m.__dict__.get("forward") for m in parts]
    fastpath.install(model)
    assert all("forward" in m.__dict__ for m in parts)
    fastpath.install(model, compile=False)
    assert [m.__dict__.get("forward") for m in parts] == own
    assert not fastpath.is_installed(model)


def test_experts_forward_equals_transformers_grouped_experts():
    model = moe(1)
    experts = fastpath.decoder_layers(model)[0].mlp.experts
    assert fastpath._grouped_experts(experts)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(50, 64, generator=g)
    index = torch.randint(0, 8, (50, 2), generator=g)
    weights = torch.rand(50, 2, generator=g)
    want = type(experts).forward(experts, hidden, index, weights)  # transformers' own dispatch
    got = fastpath._experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_defaults_to_cuda_only():
    assert fastpath.enabled(None, torch.device("cpu")) is False
    assert fastpath.enabled(None, torch.device("cuda")) is True
    assert fastpath.enabled(True, torch.device("cpu")) is True
    assert fastpath.enabled(False, torch.device("cuda")) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_bf16_layers_are_as_close_to_fp32_as_eager_bf16():
    """Qwen3-30B-A3B's real layer widths, 2 layers, 4K tokens: the compiled bf16 model may be at
    most 1.5x as far from the fp32 model as the eager bf16 model is."""
    torch._dynamo.reset()
    hf_attention.register()  # the sparse attention's name, as models.load registers it
    config = rehearsal.architecture_config("qwen3_30b_a3b", num_hidden_layers=2)
    ref = rehearsal.build(config, "cuda", torch.float32, 0, hf_attention.ATTN_IMPL)
    # built on the GPU (no 1.8e9 random weights initialised on the host), then given ref's
    model = rehearsal.build(config, "cuda", torch.bfloat16, 0, hf_attention.ATTN_IMPL)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")
    exact = logits(ref, ids)[0, -64:]
    eager = logits(model, ids)[0, -64:].float()
    fastpath.install(model)
    chunk_feedforward(model, 1024)
    compiled = logits(model, ids)[0, -64:].float()
    eager_err = (eager - exact).norm() / exact.norm()
    assert (compiled - exact).norm() / exact.norm() <= 1.5 * eager_err


IDS = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_compiled_layers_lose_the_inner_device_hooks_of_a_dispatched_model(tmp_path):
    """Under accelerate (model.device_map=auto) every projection carries a device hook that the
    compiler cannot trace: each broke the compiled regions into pieces. A layer whose weights sit
    on its own device loses its submodules' hooks (no graph break left there); an offloaded
    layer keeps the hooks that bring its weights; the logits stay the eager model's."""
    model = _tiny_layers(3)
    want = logits(model, IDS)
    spread = dispatch_layers(model, ["cpu", "disk", "cpu"], tmp_path)
    layers = spread.model.layers
    assert hasattr(layers[2].self_attn.q_proj, "_hf_hook")  # accelerate's, before install
    compiled, breaks = _compiled_logits_and_graph_breaks(spread)
    assert hasattr(layers[2], "_hf_hook")  # the layer's own hook still moves its inputs
    assert not [n for n, m in layers[2].named_modules() if n and hasattr(m, "_hf_hook")]
    assert layers[1].self_attn.q_proj._hf_hook.offload  # the offloaded layer keeps its hooks
    torch.testing.assert_close(compiled, want, rtol=1e-4, atol=1e-4)
    fastpath.install(spread, compile=False)
    torch.testing.assert_close(logits(spread, IDS), want, rtol=1e-5, atol=1e-5)
    # the offloaded layer's hooks still break its regions; the cpu layer adds none
    one = dispatch_layers(_tiny_layers(2), ["cpu", "disk"], tmp_path / "one")
    assert breaks <= _compiled_logits_and_graph_breaks(one)[1]


def _tiny_layers(layers: int):
    """The tiny model with `layers` decoder layers and the sparse attention's name, seeded."""
    hf_attention.register()
    torch.manual_seed(0)
    config = tiny.tiny_config(num_hidden_layers=layers, attn_implementation=hf_attention.ATTN_IMPL)
    return tiny.build_model(config).eval()


def _compiled_logits_and_graph_breaks(model):
    """The fast path installed afresh: the logits of IDS and the graph breaks they took."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fastpath.install(model)
    out = logits(model, IDS)
    return out, sum(torch._dynamo.utils.counters["graph_break"].values())


def test_the_router_runs_its_top_k_as_one_op(monkeypatch):
    """A top-k router takes `_router_forward` (its softmax, top-k and normalisation as the
    `router_topk` op) with the same outputs as its own forward; install(False) restores it and
    RBS_BENCH_ROUTER_TOPK=0 leaves it alone."""
    model = moe(1)
    gate = model.model.layers[0].mlp.gate
    fastpath.install(model)
    assert gate.forward.__func__ is fastpath._router_forward
    x = torch.randn(10, SMALL_MOE["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own, mine = type(gate).forward(gate, x), gate(x)
    for a, b in zip(own, mine):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fastpath.install(model, compile=False)
    assert "forward" not in gate.__dict__
    monkeypatch.setenv("RBS_BENCH_ROUTER_TOPK", "0")
    fastpath.install(model)
    assert "forward" not in gate.__dict__
    fastpath.install(model, compile=False)


def test_a_prefill_into_an_empty_cache_layer_keeps_its_tensors():
    """The first update of a DynamicCache layer stores k and v themselves (no copy); a second
    goes through the cache's own update; a cache without that layer yet is left to its update."""
    from transformers import DynamicCache

    model = moe(1)
    cache = DynamicCache(config=model.config)
    k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    assert fastpath._first_update(cache, k, v, 0)
    assert cache.layers[0].keys is k and cache.layers[0].values is v
    assert cache.get_seq_length(0) == 5
    assert not fastpath._first_update(cache, k, v, 0)
    keys, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    torch.testing.assert_close(keys, torch.cat([k, k[:, :, :1]], -2))
    assert not fastpath._first_update(DynamicCache(), k, v, 0)
