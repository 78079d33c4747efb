"""Sparse prefill attention inside HF transformers models, through the `AttentionInterface`.

`install(model, selector)` attaches a selector to every attention module and switches the model to
the `rbs_sparse` implementation. The registered function reads its state from the `module` it is
called with (no global state), so two models can run two methods in one process. Per call:

- prefill (Lq == Lk > 1): `selector.select(q, k)` -> `execute(...)`, or SDPA for a dense selector;
  the per-head density and the selector / attention seconds go to the `PrefillRecorder`;
- decode and chunked prefill (Lq != Lk or Lq == 1), and modules without state: transformers' SDPA.

The model layout is q [B, Hq, L, D], k/v [B, Hkv, L, D] (GQA not expanded), output [B, L, Hq, D];
the selection API uses [B, H, N, D] and the conversion happens only here.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from rbs_bench.kernels.block_sparse_attn import QUANT_GROUP
from rbs_bench.methods.selection import SCORE_LIMIT, finite_checked
from rbs_bench.models.fp8 import QuantisedRows

ATTN_IMPL = "rbs_sparse"
_STATE = "_rbs_state"  # attribute on each attention module
_PREV_IMPL = "_rbs_prev_attn_impl"  # attribute on the model, restored by uninstall()


class _Elapsed:
    """Seconds between pairs of CUDA events, summed, read when converted with float() (after the
    forward, in `PrefillRecorder.summary`): timing a region adds no synchronisation to it."""

    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __add__(self, other):
        if isinstance(other, _Elapsed):
            return _Elapsed(self.pairs + other.pairs)
        return self if other == 0 else NotImplemented

    __radd__ = __add__

    def __float__(self) -> float:
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.pairs) / 1e3


class _Mark:
    """A CUDA event recorded on the current stream; `later - earlier` is their `_Elapsed`."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, earlier: _Mark) -> _Elapsed:
        return _Elapsed([(earlier.event, self.event)])


Seconds = float | _Elapsed  # a region's seconds: now (perf_counter) or after the forward


@dataclass
class _LayerRecord:
    density: Tensor  # float [Hq], mean over the batch; left on the device until summary()
    selector_s: Seconds
    attention_s: Seconds
    recall: Tensor | None = None  # float [Hq], mean over the batch (with `recall` only)
    recall_s: Seconds = 0.0  # seconds of the recall pass (inside the forward, outside the others)


@dataclass
class PrefillRecorder:
    """Per-layer density and timings of the latest prefill forward.

    A layer recorded a second time means a new forward has begun, so the previous one is dropped;
    call `reset()` before each sample anyway. With `timing` (default) each timed region on a GPU
    lies between two CUDA events, read in `summary()` once the forward is done, so the seconds
    are the device's and the forward runs without synchronisation (the host keeps queueing the
    next layers' kernels, as an engine does); on a CPU they are `perf_counter` seconds.
    """

    timing: bool = True
    # Also the attention recall of each layer: the share of the dense softmax mass on the kept
    # pairs (rbs_bench.methods.mass.attention_recall); costs a dense pass per layer, timed apart
    # (recall_s) so that the runner can leave it out of the prefill's time.
    recall: bool = False
    layers: dict[int, _LayerRecord] = field(default_factory=dict)
    _pending: list[tuple[int, Tensor]] = field(default_factory=list)  # deferred finiteness checks

    def reset(self) -> None:
        self.layers.clear()
        self._pending.clear()

    def clock(self, like: Tensor) -> float | _Mark:
        """A point in time: a CUDA event on `like`'s device (with `timing`), else perf_counter.
        `later - earlier` gives a region's seconds either way."""
        if self.timing and like.is_cuda:
            with torch.cuda.device(like.device):
                return _Mark()
        return time.perf_counter()

    def record(
        self,
        layer: int,
        density: Tensor,
        selector_s: Seconds,
        attention_s: Seconds,
        recall: Tensor | None = None,
        recall_s: Seconds = 0.0,
    ) -> None:
        if layer in self.layers:  # a new forward: settle the last one's deferred checks
            self.check_finite()
            self.layers.clear()
        recall = None if recall is None else recall.detach()
        self.layers[layer] = _LayerRecord(
            density.detach(), selector_s, attention_s, recall, recall_s
        )

    def check_finite(self) -> None:
        """Raise for the first deferred non-finite q/k flag (CUDA runs)."""
        pending, self._pending = self._pending, []
        for layer, bad in pending:
            if bool(bad):
                raise FloatingPointError(_nonfinite_message(layer))

    def summary(self) -> dict:
        """density_mean (over layers and heads), density_layers_heads, selector_s, attention_s,
        num_layers; with `recall`, also recall_mean (over layers and heads), recall_layers (per
        layer, mean over heads) and recall_s (the recall passes' seconds: they run inside the
        forward, so a prefill time taken around it includes them; at 128K about 0.2-0.4 s a
        layer)."""
        self.check_finite()
        order = sorted(self.layers)
        per_layer = [self.layers[i].density.double().cpu().tolist() for i in order]
        flat = [d for row in per_layer for d in row]
        return {
            "density_mean": sum(flat) / len(flat) if flat else math.nan,
            "density_layers_heads": [[round(d, 5) for d in row] for row in per_layer],
            "selector_s": sum(float(self.layers[i].selector_s) for i in order),
            "attention_s": sum(float(self.layers[i].attention_s) for i in order),
            "num_layers": len(order),
        } | self._recall_summary(order)

    def _recall_summary(self, order: list[int]) -> dict:
        got = [self.layers[i].recall for i in order]
        if not got or any(r is None for r in got):
            return {}
        per_layer = [float(r.double().mean()) for r in got]
        return {
            "recall_mean": sum(per_layer) / len(per_layer),
            "recall_layers": [round(r, 5) for r in per_layer],
            "recall_s": sum(float(self.layers[i].recall_s) for i in order),
        }


@dataclass
class _State:
    selector: object
    executor: str
    recorder: PrefillRecorder
    execute: object  # rbs_bench.execution.execute, or None for a dense selector


def _nonfinite_message(layer: int) -> str:
    return (
        f"NaN/Inf in layer {layer} queries/keys, or values so large that their scores overflow "
        f"float32 (past {SCORE_LIMIT:g}); check the model's dtype and weights"
    )


def register() -> None:
    """Register `rbs_sparse` with transformers (idempotent).

    The mask function matters: transformers builds no attention mask for an implementation that
    has none registered, and padded batches would then silently attend to their pad tokens.
    """
    AttentionInterface.register(ATTN_IMPL, rbs_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that call the attention interface (Qwen3, Qwen3-MoE, Llama self-attention)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and hasattr(m, "num_key_value_groups")
        and hasattr(m, "scaling")
    ]


def install(
    model: torch.nn.Module, selector, executor: str = "auto", recall: bool = False
) -> PrefillRecorder:
    """Run `selector` in every prefill of `model`; returns the recorder of densities and timings
    (and, with `recall`, of each layer's attention recall)."""
    register()
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module with layer_idx "
            f"(supported: Qwen3, Qwen3-MoE, Llama)"
        )
    execute = None
    if not selector.is_dense:
        from rbs_bench.execution import execute, resolve_executor

        resolve_executor(executor, next(model.parameters()).device)  # unknown names fail here
    recorder = PrefillRecorder(recall=recall)
    for m in modules:
        setattr(m, _STATE, _State(selector, executor, recorder, execute))
    current = model.config._attn_implementation
    if current != ATTN_IMPL:
        setattr(model, _PREV_IMPL, current)
        model.set_attn_implementation(ATTN_IMPL)
    stuck = {m.config._attn_implementation for m in modules if hasattr(m, "config")} - {ATTN_IMPL}
    if stuck:
        uninstall(model)
        raise ValueError(
            f"{type(model).__name__} kept attention {sorted(stuck)}; load it with "
            f"attn_implementation={ATTN_IMPL!r}"
        )
    return recorder


def uninstall(model: torch.nn.Module) -> None:
    """Remove the selector state and restore the attention implementation install() replaced."""
    for m in attention_modules(model):
        if hasattr(m, _STATE):
            delattr(m, _STATE)
    prev = model.__dict__.pop(_PREV_IMPL, None)
    if prev is not None:
        model.set_attn_implementation(prev)


def rbs_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [B, Hq, Lq, D]
    key: Tensor,  # [B, Hkv, Lk, D]
    value: Tensor,  # [B, Hkv, Lk, D]
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The `rbs_sparse` attention function; returns ([B, Lq, Hq, D], None).

    `quantise_out=True` (from `models.fastpath`, for a block-FP8 output projection) asks for the
    output quantised where the sparse kernel writes it (head dim 128, no padding): it returns
    then `fp8.QuantisedRows` of the rows [B * Lq, Hq * D] instead, in the kernel's epilogue;
    every other path returns the tensor as before."""
    quantise = bool(kwargs.pop("quantise_out", False))
    state: _State | None = getattr(module, _STATE, None)
    lq, lk = query.shape[2], key.shape[2]
    if state is None or lq != lk or lq == 1 or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )

    layer = module.layer_idx
    if dropout:
        raise ValueError(f"attention dropout {dropout} in layer {layer}; call model.eval() first")
    rec = state.recorder
    _check_finite(query, key, layer, rec)

    if state.selector.is_dense:
        t0 = rec.clock(query)
        out, _ = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
        ones = query.new_ones(query.shape[1], dtype=torch.float32)
        rec.record(layer, ones, 0.0, rec.clock(query) - t0, ones if rec.recall else None)
        return out, None

    if sliding_window is not None:
        raise ValueError(
            f"layer {layer} uses sliding-window attention ({sliding_window}), which "
            f"the sparse prefill path does not support; use a full-attention model"
        )
    scales = None  # o's input scales, where the kernel writes it quantised
    if attention_mask is None:
        # [B, N, Hq, D] memory seen as [B, Hq, N, D]: the kernel writes the layout the model
        # reads next, so no transpose copy follows
        b, hq, n, d = query.shape
        if quantise and d == QUANT_GROUP:
            buf = query.new_empty(b, n, hq, d, dtype=torch.float8_e4m3fn).transpose(1, 2)
            scales = query.new_empty(hq, b * n, dtype=torch.float32)
        else:
            buf = query.new_empty(b, n, hq, d).transpose(1, 2)
        out, density, sel_s, attn_s, recall, recall_s = _sparse(
            state, query, key, value, scaling, out=buf, out_scales=scales
        )
        density = density.mean(0)
        recall = None if recall is None else recall.mean(0)
    else:
        out, density, sel_s, attn_s, recall, recall_s = _sparse_padded(
            state, query, key, value, attention_mask, scaling, layer
        )
    if density is not None:
        rec.record(layer, density, sel_s, attn_s, recall, recall_s)
    if scales is not None:  # o's e4m3 input [B * N, Hq * D]: a view of the buffer
        return QuantisedRows(out.transpose(1, 2).flatten(0, 1).flatten(1), scales), None
    return out.transpose(1, 2).contiguous(), None  # a no-op view for the unpadded buffer


def _check_finite(query: Tensor, key: Tensor, layer: int, rec: PrefillRecorder) -> None:
    """The selection API's input rule (`methods.selection.check_inputs`) at a layer's cost: no
    NaN or Inf, and no score q.k that overflows float32. max |x| is NaN or inf exactly when x holds
    a NaN or an inf, and every score is at most D max|q| max|k|: one reduction per tensor, no
    [B, H, N, D] buffer, no host sync yet (a 0-dim flag)."""
    inf = float("inf")
    qm = torch.linalg.vector_norm(query, inf, dtype=torch.float32)
    km = torch.linalg.vector_norm(key, inf, dtype=torch.float32)
    bound = qm * km * query.shape[-1]
    bad = ~(torch.isfinite(qm + km) & (bound <= SCORE_LIMIT))
    if query.is_cuda:
        rec._pending.append((layer, bad))  # checked at summary(): no host sync in the forward
    elif bool(bad):
        raise FloatingPointError(_nonfinite_message(layer))


def _sparse(
    state: _State,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    out: Tensor | None = None,
    out_scales: Tensor | None = None,
):
    """(out [B, Hq, N, D], head density [B, Hq], selector s, attention s, head recall [B, Hq] or
    None, recall s) of unpadded rows.

    `out`, if given, receives the output (the kernel writes the model's layout directly); with
    `out_scales` it is e4m3, quantised for the output projection (`execution.execute`).
    """
    rec = state.recorder
    # Triton launches on the current device: a layer on another GPU (model.device_map=auto)
    # must make its own device current
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        t0 = rec.clock(q)
        with finite_checked():  # the hook checked q and k already (`_check_finite`)
            sel = state.selector.select(q, k, scale=scale)
        t1 = rec.clock(q)
        out = state.execute(
            q, k, v, sel, state.executor, scale=scale, out=out, out_scales=out_scales
        )
        t2 = rec.clock(q)
        recall, t3 = None, t2
        if rec.recall:
            from rbs_bench.methods.mass import attention_recall

            recall = attention_recall(q, k, sel, scale)
            t3 = rec.clock(q)
    return out, sel.head_density().float(), t1 - t0, t2 - t1, recall, t3 - t2


def _sparse_padded(
    state: _State, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, layer: int
):
    """Run each batch row on its valid tokens only; pad positions get output 0."""
    b, n = q.shape[0], q.shape[2]
    # The last query row sees every valid key: all of them with left padding, and with right
    # padding (where that row is itself a pad) the causal mask ANDed with padding shows the same.
    keep = mask[:, 0, -1, :]
    keep = keep if keep.dtype == torch.bool else keep == 0  # additive float masks: 0 = attend
    keep = keep.expand(b, n)
    count = keep.sum(-1)
    first = keep.to(torch.int8).argmax(-1)
    pos = torch.arange(n, device=keep.device)
    span = (pos >= first[:, None]) & (pos < (first + count)[:, None])
    ok = (span == keep).all(-1)
    rows = torch.stack([count, first, ok.long()], dim=1).tolist()  # one host sync for the batch

    out = q.new_zeros(q.shape)
    densities, recalls, sel_s, attn_s, recall_s = [], [], 0.0, 0.0, 0.0
    for i, (cnt, start, contiguous) in enumerate(rows):
        if not contiguous:
            raise ValueError(
                f"layer {layer}: batch row {i} has non-contiguous valid tokens; only "
                f"left or right padding is supported"
            )
        if cnt == 0:
            continue
        sl = slice(start, start + cnt)
        o, d, s_s, a_s, r, r_s = _sparse(
            state, q[i : i + 1, :, sl], k[i : i + 1, :, sl], v[i : i + 1, :, sl], scale
        )
        out[i : i + 1, :, sl] = o
        densities.append(d[0])
        if r is not None:
            recalls.append(r[0])
        sel_s, attn_s, recall_s = sel_s + s_s, attn_s + a_s, recall_s + r_s
    density = torch.stack(densities).mean(0) if densities else None
    recall = torch.stack(recalls).mean(0) if recalls else None
    return out, density, sel_s, attn_s, recall, recall_s
