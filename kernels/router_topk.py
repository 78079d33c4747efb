"""A mixture-of-experts router's top-k in one pass: softmax, the k largest, their sum to one.

A top-k MoE router (Qwen3-MoE's, Qwen3-VL-MoE's) turns each token's expert logits [N, E] into
its k experts and their weights:

    p = softmax(logits) in fp32;  (w, idx) = topk(p, k), largest first;
    w = w / sum(w)  (when the config says norm_topk_prob);  w in the logits' dtype.

`torch.topk` on [131072, 128] fp32 rows takes 1.0 ms on an H200, the whole layer's largest
non-product kernel after the experts' passes (results/speed/layer_profile_nvidia_h200.csv, family
index), plus a sort and the normalisation's passes. `router_topk` is one program per tile of
rows: each row's E logits are read once, and the k winners are taken by k rounds of a row max
(ties go to the lower expert id), written with their normalised weights.

`router_topk_ref` is the PyTorch reference (the router's own steps). Exposed as the custom op
`rbs_bench::router_topk`, opaque to `torch.compile`: the kernel on CUDA and under
TRITON_INTERPRET=1, the reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_util import INTERPRET, check_triton_launch, jit, tl, triton


def router_topk_ref(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [N, k] in logits' dtype, expert ids [N, k] int64) as the router computes them."""
    _check(logits, top_k)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), index


def _check(logits: Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router_topk: logits must be [N, E]; got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"router_topk: top_k must be in [1, {logits.shape[1]}]; got {top_k}")


@jit
def _router_topk_kernel(
    L,
    W,
    Idx,
    n_rows,
    n_experts,
    stride_l,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    r_ok = rows < n_rows
    c_ok = cols < n_experts
    rows64 = rows.to(tl.int64)
    x = tl.load(
        L + rows64[:, None] * stride_l + cols[None, :],
        mask=r_ok[:, None] & c_ok[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    top = tl.max(x, axis=1)
    e = tl.exp(x - top[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(c_ok[None, :], p, -1.0)  # padding columns never win
    slots = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        win = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        vals = tl.where(slots[None, :] == j, best[:, None], vals)
        ids = tl.where(slots[None, :] == j, win[:, None], ids)
        p = tl.where(cols[None, :] == win[:, None], -2.0, p)
    if NORMALIZE:
        vals = vals / tl.sum(vals, axis=1)[:, None]  # the padding slots hold zeros
    ok = r_ok[:, None] & (slots[None, :] < TOP_K)
    where = rows64[:, None] * TOP_K + slots[None, :]
    tl.store(W + where, vals.to(W.dtype.element_ty), mask=ok)
    tl.store(Idx + where, ids.to(tl.int64), mask=ok)


def _launch(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    _check(logits, top_k)
    check_triton_launch("router_topk", logits)
    n, experts = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = logits.new_empty(n, top_k)
    index = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, index
    block_e = triton.next_power_of_2(experts)
    block_m = max(1, min(64, 8192 // block_e))
    _router_topk_kernel[(triton.cdiv(n, block_m),)](
        logits, weights, index, n, experts, logits.stride(0),
        TOP_K=top_k, NORMALIZE=normalize, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
    )  # fmt: skip
    return weights, index


@torch.library.custom_op("rbs_bench::router_topk", mutates_args=())
def router_topk(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [N, k] in logits' dtype, expert ids [N, k] int64) of logits [N, E]: softmax in
    fp32, the k largest (largest first), normalised to sum to one when `normalize`. Triton on
    CUDA (and under TRITON_INTERPRET=1), `router_topk_ref` elsewhere."""
    if logits.is_cuda or (logits.device.type == "cpu" and INTERPRET):
        return _launch(logits, top_k, normalize)
    return router_topk_ref(logits, top_k, normalize)


@router_topk.register_fake
def _(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    n = logits.shape[0]
    return logits.new_empty(n, top_k), logits.new_empty(n, top_k, dtype=torch.int64)
