"""The decoder layer outside attention at matrix-product speed: regional `torch.compile`.

In eager mode a prefill spends far more time outside attention than the layer's matrix products
need: every RMSNorm is six passes over the hidden states in fp32, the q/k norms and RoPE copy the
queries several times, SwiGLU three more, and a mixture of experts adds its routing, a sort,
gathers, a weighted sum and the reduction over its top-k experts, each a separate kernel. At 128K
tokens of Qwen3-30B-A3B these passes cost several times the layer's GEMMs
(`python -m rbs_bench.bench.layer_profile` breaks a layer into kernel families and measures the
GEMM-only time beside it).

`install(model)` compiles, in every decoder layer, the regions that hold no attention, and keeps
the attention itself eager and opaque, so every method (its selector, its kernel, the recorder)
runs exactly as before:

- the input and post-attention RMSNorms (one fused kernel each);
- the attention module's projections, q/k norms and rotary embedding, as one region: its
  key/value cache update and the attention function (`rbs_sparse`, SDPA, ...) run eagerly after it,
  then the output projection. Block-FP8 q, k and v projections run first, eagerly, as one product
  (`fp8.fuse_linears`: one quantisation of the input, one GEMM), and the region takes its output;
- block-FP8 inputs quantised by their producers, as serving engines fuse them: the input RMSNorm
  moves into the attention module (the layer's own call passes the hidden states through) and
  writes q/k/v's e4m3 rows itself (`kernels.fp8_norm`), and where the sparse kernel runs the
  attention (`rbs_sparse`, head dim 128) its epilogue writes the output projection's e4m3 input
  and scales (`block_sparse_attention`'s `out_scales`); dense SDPA's output is quantised by the
  projection as before. Each saves a pass over the rows (`bench.fp8_gemm` times both; the same
  values, tests/models/test_fp8.py). RBS_BENCH_FP8_PRODUCERS=0 keeps each layer quantising its
  own input;
- the feed-forward block (MoE router and grouped experts, or a dense SwiGLU MLP; a top-k
  router's softmax, top-k and normalisation as one kernel, `kernels.router_topk`), which
  `rbs_bench.models.feedforward` still runs over bounded token chunks.

A region is compiled once per process for all layers (each call passes its module, whose
parameters are graph inputs), with the token dimension dynamic, so prompts of any length reuse one
graph; a one-token decode step gets its own. Supported attention modules are the Qwen3 family's
and Llama's (the `ATTENTION_CLASSES` below); a layer whose attention module is another keeps its
eager attention forward and still has its norms and feed-forward block compiled.
Under `model.device_map=auto` accelerate hooks every module that holds weights, down to each
projection, and its hooks are opaque to the compiler: each one inside a region broke the graph,
and the pieces, one per module shape, ran into dynamo's recompile limit and fell back to eager
(seen on two GPUs with Qwen3-32B). A layer's weights sit on one device and its own hook brings
its inputs there, so `install` removes the hooks of its submodules that only move tensors (not
those that load offloaded weights). `install(model, False)` restores every eager forward.
`model.compile` (default: on CUDA only) selects the path in the runner, calibration and
`bench.ttft`; tests/models/test_fastpath.py checks that the compiled model's logits equal the
eager model's.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import Tensor

from rbs_bench.models import fp8

# Attention modules whose forward is: q/k/v projections (q/k norms over the head dim, if any),
# rotary embedding, cache update, the attention interface, output projection.
ATTENTION_CLASSES = (
    "Qwen3Attention",
    "Qwen3MoeAttention",
    "Qwen3VLTextAttention",
    "Qwen3VLMoeTextAttention",
    "LlamaAttention",
)
_EAGER = "_rbs_eager_forwards"  # on the model: {module: its own forward attribute or None}
_REGIONS: dict = {}  # function -> its compiled version, shared by every layer
_QKV = "_rbs_qkv"  # on an attention module: its FP8 q, k and v as one product (fp8.fuse_linears)
_NORM = "_rbs_norm"  # on an attention module: the input RMSNorm it applies itself (`_norm_fusable`)
_O = "_rbs_o"  # on an attention module: its FP8 output projection (fp8.quantised_linear)
# Decoder layers whose input RMSNorm output goes to the attention module only (residual before it)
NORM_IN_ATTENTION = (
    "Qwen3DecoderLayer",
    "Qwen3MoeDecoderLayer",
    "Qwen3VLTextDecoderLayer",
    "Qwen3VLMoeTextDecoderLayer",
    "LlamaDecoderLayer",
)


def enabled(setting: bool | None, device: torch.device) -> bool:
    """`model.compile`: True / False as given; None compiles on CUDA only (on a CPU, inductor's
    C++ compile takes longer than the small prompts there save)."""
    return device.type == "cuda" if setting is None else bool(setting)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: modules with `self_attn`, `mlp` and both RMSNorms."""
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return [m for m in model.modules() if all(hasattr(m, n) for n in names)]


def install(model: torch.nn.Module, compile: bool = True) -> int:
    """Compile every decoder layer's regions outside attention (`compile=False`: back to eager).
    Returns the number of layers set. Call before `chunk_feedforward`, which then chunks the
    compiled feed-forward blocks."""
    _restore(model)
    layers = decoder_layers(model)
    if not compile:
        return len(layers)
    saved: dict = {}
    for layer in layers:
        _drop_inner_device_hooks(layer)
        attn = layer.self_attn
        norm_in_attention = False
        if type(attn).__name__ in ATTENTION_CLASSES:
            _set_forward(attn, types.MethodType(_attention_forward, attn), saved)
            qkv = fp8.fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            if qkv is not None:
                attn.__dict__[_QKV] = qkv
                norm_in_attention = _norm_fusable(layer, qkv)
            o_proj = fp8.quantised_linear(attn.o_proj)
            if o_proj is not None:
                attn.__dict__[_O] = o_proj
        if norm_in_attention:  # the attention region normalises, writing q/k/v's FP8 input
            attn.__dict__[_NORM] = layer.input_layernorm
            _set_forward(layer.input_layernorm, _passthrough, saved)
        else:
            _set_forward(layer.input_layernorm, _bind(_norm_forward, layer.input_layernorm), saved)
        norm = layer.post_attention_layernorm
        _set_forward(norm, _bind(_norm_forward, norm), saved)
        _set_forward(layer.mlp, _bind(_feedforward, layer.mlp), saved)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and _router_fusable(gate):
            _set_forward(gate, types.MethodType(_router_forward, gate), saved)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and _grouped_experts(experts):
            experts._rbs_fp8_fused = _fp8_fusable(experts)
            _set_forward(experts, types.MethodType(_experts_forward, experts), saved)
    model.__dict__[_EAGER] = saved
    return len(layers)


def _drop_inner_device_hooks(layer: torch.nn.Module) -> None:
    """Remove accelerate's device hooks from the layer's submodules where they only move inputs
    to the device every weight of the layer is on (no offload). The layer's own hook, which
    brings the hidden states to it, stays."""
    hooked = [
        m
        for m in layer.modules()
        if m is not layer and type(getattr(m, "_hf_hook", None)).__name__ == "AlignDevicesHook"
    ]
    own = getattr(layer, "_hf_hook", None)
    devices = {p.device for p in layer.parameters()}
    if (
        not hooked
        or type(own).__name__ != "AlignDevicesHook"
        or {torch.device(own.execution_device)} != devices
        or any(m._hf_hook.offload for m in hooked)
    ):
        return
    from accelerate.hooks import remove_hook_from_module

    for m in hooked:
        remove_hook_from_module(m)


def is_installed(model: torch.nn.Module) -> bool:
    return bool(model.__dict__.get(_EAGER))


def _restore(model: torch.nn.Module) -> None:
    for module in model.modules():
        for key in (_QKV, _NORM, _O):  # the layers' weights stay views of the fused ones
            module.__dict__.pop(key, None)
    for module, own in model.__dict__.pop(_EAGER, {}).items():
        attr = "_old_forward" if hasattr(module, "_hf_hook") else "forward"
        if own is None:
            module.__dict__.pop(attr, None)
        else:
            setattr(module, attr, own)


def _set_forward(module: torch.nn.Module, forward, saved: dict) -> None:
    """Replace the module's forward; under accelerate's device hook (model.device_map=auto) the
    hook's inner forward, so that inputs still move to the module's device first."""
    attr = "_old_forward" if hasattr(module, "_hf_hook") else "forward"
    saved[module] = module.__dict__.get(attr)
    setattr(module, attr, forward)


def _region(fn):
    """fn compiled once per process: every layer's module runs the same graph."""
    compiled = _REGIONS.get(fn)
    if compiled is None:
        compiled = _REGIONS[fn] = torch.compile(fn, dynamic=False)
    return compiled


def _tokens_dynamic(*tensors: Tensor) -> None:
    """Mark the token dimension (-2) of [..., N, X] inputs dynamic when N > 1, so that prompts
    of every length share one graph (one-token decode steps keep their own)."""
    for t in tensors:
        if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] > 1:
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)


def _bind(fn, module: torch.nn.Module):
    """A forward for `module` that runs the compiled `fn(module, x, ...)`."""
    own = type(module).forward

    @functools.wraps(own)
    def forward(x: Tensor, *args, **kwargs):
        _tokens_dynamic(x)
        return _region(fn)(module, x, *args, **kwargs)

    return forward


def _norm_forward(norm: torch.nn.Module, x: Tensor) -> Tensor:
    return type(norm).forward(norm, x)


def _passthrough(x: Tensor, *args, **kwargs) -> Tensor:
    """The input RMSNorm's forward where the attention module applies it (`_NORM`)."""
    return x


def _norm_fusable(layer: torch.nn.Module, qkv: fp8.FusedLinears) -> bool:
    """Whether the layer's input RMSNorm can move into its attention module, as one pass that
    normalises and quantises q/k/v's input (`FusedLinears.normalised`): a decoder layer of
    `NORM_IN_ATTENTION`, the fused q/k/v on this harness's kernels, and a norm whose forward is
    `kernels.fp8_norm.rmsnorm_ref` (checked on a small input: an offset weight like Gemma's is
    not). RBS_BENCH_FP8_PRODUCERS=0 keeps the norm apart."""
    from rbs_bench.kernels import fp8_norm

    norm = layer.input_layernorm
    eps = getattr(norm, "variance_epsilon", None)
    weight = getattr(norm, "weight", None)
    if (
        not fp8.producers_enabled()
        or type(layer).__name__ not in NORM_IN_ATTENTION
        or qkv.backend is None
        or eps is None
        or not isinstance(weight, Tensor)
        or weight.device.type == "meta"
        or not fp8_norm.fusable(weight.new_empty(1, weight.shape[-1]), weight)
    ):
        return False
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(4, weight.shape[-1], generator=gen, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        return torch.equal(type(norm).forward(norm, x), fp8_norm.rmsnorm_ref(x, weight, eps))


def _feedforward(block: torch.nn.Module, x: Tensor) -> Tensor:
    return type(block).forward(block, x)


def _project(attn: torch.nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor):
    """q [B, Hq, N, D], k and v [B, Hkv, N, D]: projections, q/k norms, rotary embedding."""
    return _heads(attn, attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden), cos, sin)


def _project_fused(attn: torch.nn.Module, qkv: Tensor, sizes: tuple, cos: Tensor, sin: Tensor):
    """`_project` after one product of the three projections (q, k, v concatenated)."""
    q, k, v = qkv.split(sizes, dim=-1)
    return _heads(attn, q, k, v, cos, sin)


def _heads(attn: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor):
    shape = (*q.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the model's own RoPE
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    # q is left in the projections' [B, N, H, D] memory: made contiguous here, the queries cost
    # a further copy in dense SDPA (measured, results/speed/layer_profile_*.csv). k and v are
    # written contiguous [B, H, N, D] by this region (k by its RoPE kernel, v by one copy): a
    # prefill's cache keeps them as they are (`_first_update`), and a view of the fused q/k/v
    # product would keep the whole product, q included, alive in the cache.
    return q, k.contiguous(), v.contiguous()


def _attention_forward(
    self: torch.nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None,
    *args,
    **kwargs,
):
    """The attention module's forward with its projections compiled: the cache update and the
    attention function run eagerly, as the model's own forward runs them. The cache comes as
    `past_key_values` (transformers up to 5.2x) or `cache` (later releases)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rbs_bench.models.hf_attention import rbs_attention_forward

    cache = args[0] if args else kwargs.pop("cache", kwargs.pop("past_key_values", None))
    cos, sin = position_embeddings
    _tokens_dynamic(hidden_states, cos, sin)
    fused = self.__dict__.get(_QKV)
    norm = self.__dict__.get(_NORM)
    if fused is None:
        q, k, v = _region(_project)(self, hidden_states, cos, sin)
    else:  # the product runs eagerly (an opaque op either way), the rest compiled
        if norm is None:
            qkv = fused(hidden_states)
        else:  # the input norm passed the hidden states through: it runs here, quantising
            qkv = fused.normalised(hidden_states, norm.weight, norm.variance_epsilon)
        _tokens_dynamic(qkv)
        q, k, v = _region(_project_fused)(self, qkv, fused.sizes, cos, sin)
    if cache is not None:
        k, v = _update(cache, k, v, self, kwargs)
    eager = sys.modules[type(self).__module__].eager_attention_forward
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    window = getattr(self, "sliding_window", None)
    extra = {} if window is None else {"sliding_window": window}
    o_proj = self.__dict__.get(_O)
    if o_proj is not None and attend is rbs_attention_forward:  # may write o's FP8 input
        extra["quantise_out"] = True
    out, weights = attend(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    if isinstance(out, fp8.QuantisedRows):  # the attention kernel quantised o's input
        y = o_proj.quantised(out, hidden_states.dtype)
        return y.reshape(*hidden_states.shape[:-1], -1), weights
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(out), weights


def _update(cache, k: Tensor, v: Tensor, attn: torch.nn.Module, kwargs: dict):
    """The cache update as the model's own attention forward makes it (later transformers
    releases hand the call's keyword arguments on to the cache layer).

    A prefill into an empty dynamic cache layer keeps k and v themselves (`_first_update`):
    transformers' update concatenates them onto an empty tensor, a copy of both that took
    0.9 ms a layer at 128K tokens on an H200 (`CatArrayBatchedCopy`,
    results/speed/layer_profile_nvidia_h200.csv)."""
    if _first_update(cache, k, v, attn.layer_idx):
        return k, v
    if _passes_kwargs(type(attn)):
        return cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    return cache.update(k, v, attn.layer_idx)


def _first_update(cache, k: Tensor, v: Tensor, layer_idx: int) -> bool:
    """Store k and v as the layer's cache without a copy, where that is all its update would do:
    a plain DynamicCache (not offloaded) whose layer `layer_idx` is a DynamicLayer not yet
    written. Later updates (decode steps) concatenate onto them as before. False: nothing done,
    the caller runs the cache's own update."""
    from transformers import cache_utils

    dynamic_cache = getattr(cache_utils, "DynamicCache", None)
    dynamic_layer = getattr(cache_utils, "DynamicLayer", None)
    layers = getattr(cache, "layers", None)
    if (
        dynamic_cache is None
        or type(cache) is not dynamic_cache
        or getattr(cache, "offloading", False)
        or layers is None
        or layer_idx >= len(layers)
    ):
        return False
    layer = layers[layer_idx]
    if type(layer) is not dynamic_layer or getattr(layer, "is_initialized", True):
        return False
    layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v
    return True


@functools.cache
def _passes_kwargs(cls: type) -> bool:
    import inspect

    return "self.layer_idx, kwargs=kwargs)" in inspect.getsource(cls.forward)


_ROUTERS: dict = {}  # router class -> whether `_router_forward` computes its forward


def _router_fusable(gate: torch.nn.Module) -> bool:
    """A top-k router (logits = hidden @ weight.T, softmax, top-k, optionally normalised: the
    Qwen3-MoE family's) whose own forward `_router_forward` reproduces, checked once per class on
    a small input: the same experts up to ties, weights within bf16 rounding.
    RBS_BENCH_ROUTER_TOPK=0 keeps the router's own forward."""
    import os

    names = ("top_k", "num_experts", "norm_topk_prob", "hidden_dim", "weight")
    if os.environ.get("RBS_BENCH_ROUTER_TOPK", "1") == "0" or not all(
        hasattr(gate, n) for n in names
    ):
        return False
    if getattr(gate, "bias", None) is not None or gate.weight.dim() != 2:
        return False
    cls = type(gate)
    if cls not in _ROUTERS:
        w = gate.weight
        gen = torch.Generator(device=w.device).manual_seed(0)
        x = torch.randn(64, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        with torch.no_grad():
            own, mine = type(gate).forward(gate, x), _router_forward(gate, x)
        ok = len(own) == 3 and own[2].shape == mine[2].shape and own[1].dtype == mine[1].dtype
        if ok:
            p = torch.softmax(own[0].double(), -1)
            ok = torch.equal(p.gather(1, own[2]), p.gather(1, mine[2])) and torch.allclose(
                own[1].double(), mine[1].double(), rtol=2**-7, atol=1e-6
            )
        _ROUTERS[cls] = bool(ok)
    return _ROUTERS[cls]


def _router_forward(self, hidden_states: Tensor):
    """The router's forward with its softmax, top-k and normalisation in one kernel
    (`kernels.router_topk`): (logits, weights, expert ids)."""
    from rbs_bench.kernels.router_topk import router_topk

    hidden = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden, self.weight)
    weights, index = router_topk(logits, self.top_k, bool(self.norm_topk_prob))
    return logits, weights, index


def _grouped_experts(experts: torch.nn.Module) -> bool:
    """Experts stored as [E, 2I, H] gate-up and [E, H, I] down weights without biases (bf16 or
    block-FP8 with dynamic activation scales): the layout `_experts_forward` runs."""
    return (
        hasattr(experts, "gate_up_proj")
        and hasattr(experts, "down_proj")
        and getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "_is_expert_parallel", False)
        and getattr(experts, "activation_scheme", "dynamic") == "dynamic"
    )


def _fp8_fusable(experts: torch.nn.Module) -> bool:
    """Block-FP8 experts (activation groups of 128) whose gate is transformers' default on
    concatenated [gate; up] weights, silu(gate) * up, checked on a small input: the experts
    `kernels.fp8_moe` runs in four passes. RBS_BENCH_FP8_MOE=0 keeps the unfused path."""
    import os

    from rbs_bench.kernels.fp8_moe import silu_gate_ref

    weight = experts.gate_up_proj
    block = getattr(experts, "block_size", None)
    if (
        os.environ.get("RBS_BENCH_FP8_MOE", "1") == "0"
        or weight.element_size() != 1
        or weight.device.type != "cuda"
        or block is None
        or int(block[1]) != 128
        or not getattr(experts, "is_concatenated", True)
    ):
        return False
    gen = torch.Generator(device=weight.device).manual_seed(0)
    h = torch.randn(8, weight.shape[1], generator=gen, device=weight.device).to(torch.bfloat16)
    with torch.no_grad():
        return torch.equal(experts._apply_gate(h), silu_gate_ref(h))


def _experts_forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The experts of a MoE block: rows sorted by expert, two grouped GEMMs, the gated
    activation, and each token's weighted sum in one pass (`kernels.moe_combine`) instead of
    transformers' unpermute-multiply-sum over a new [N x k, H] buffer. Block-FP8 experts with
    the default gate run as one op, `kernels.fp8_moe` (quantised rows gathered, the gate fused
    with the down product's quantisation).

    hidden [N, H], top_k_index / top_k_weights [N, k] -> [N, H]."""
    from rbs_bench.kernels.moe_combine import moe_combine

    if getattr(self, "_rbs_fp8_fused", False):
        from rbs_bench.kernels.fp8_moe import fp8_moe_experts

        return fp8_moe_experts(
            hidden, top_k_index, top_k_weights, self.gate_up_proj, self.gate_up_proj_scale_inv,
            self.down_proj, self.down_proj_scale_inv, self.block_size,
        )  # fmt: skip

    n, k = top_k_index.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden[perm // k]  # [N x k, H] in expert order
    counts = torch.histc(
        ids.int() if ids.is_cuda else ids.float(), bins=self.num_experts, min=0,
        max=self.num_experts - 1,
    )  # fmt: skip
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = _grouped_linear(self, x, "gate_up_proj", offsets, counts)
    y = _grouped_linear(self, self._apply_gate(h), "down_proj", offsets, counts)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=perm.device)
    return moe_combine(y, pos.view(n, k), top_k_weights.to(y.dtype))


def _grouped_linear(experts, x: Tensor, name: str, offsets: Tensor, counts: Tensor) -> Tensor:
    """x @ W[e].T for each expert's rows; FP8 weights through transformers' FP8 grouped matmul."""
    weight = getattr(experts, name)
    if weight.element_size() == 1:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        return load_finegrained_fp8_kernel().grouped_matmul(
            x,
            weight,
            getattr(experts, f"{name}_scale_inv"),
            offsets=offsets,
            tokens_per_expert=counts,
            block_size=experts.block_size,
        )
    from transformers.integrations.moe import _grouped_linear as grouped

    return grouped(x, weight, offsets)
