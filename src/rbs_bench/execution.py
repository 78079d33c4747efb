"""Run a `BlockSelection` as sparse attention with one of the executors.

`reference` is the PyTorch reference (any device); `triton` is our Triton kernel and `flex`
compiled FlexAttention (both CUDA only). `auto` picks triton on CUDA (flex when triton is not
installed) and the reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rbs_bench.kernels.block_sparse_attn import (
    HAS_TRITON,
    block_sparse_attention,
    block_sparse_attention_ref,
)
from rbs_bench.kernels.flex_attn import flex_block_sparse_attention
from rbs_bench.methods.selection import BlockSelection

EXECUTORS = ("reference", "flex", "triton")
_KERNELS = {
    "reference": block_sparse_attention_ref,
    "flex": flex_block_sparse_attention,
    "triton": block_sparse_attention,
}


def resolve_executor(name: str, device) -> str:
    """The executor that `name` means on `device`.

    "auto" -> "triton" on CUDA ("flex" if triton is not installed), "reference" elsewhere.
    """
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "reference"
        return "triton" if HAS_TRITON else "flex"
    if name not in EXECUTORS:
        valid = ", ".join(("auto", *EXECUTORS))
        raise ValueError(f"unknown executor {name!r}; choose one of: {valid}")
    return name


def execute(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    selection: BlockSelection,
    executor: str = "auto",
    scale: float | None = None,
    out: Tensor | None = None,
    out_scales: Tensor | None = None,
) -> Tensor:
    """Sparse causal prefill attention over the selection's kept blocks; out [B, Hq, N, D].

    q [B, Hq, N, D], k/v [B, Hkv, N, D]; the selection is per query head and N = seq_len.
    A pattern that is not block-level (e.g. MInference's vertical-slash) is not a
    `BlockSelection`: it brings its own executor as `selection.attend(q, k, v, scale)`.

    `out` (any non-overlapping [B, Hq, N, D] view, e.g. a model's [B, N, Hq, D] buffer seen
    through `.transpose(1, 2)`) lets the Triton kernel write there directly; the other
    executors fill it with one copy. The returned tensor is then `out`.

    `out_scales` fp32 [Hq, B * N] with an e4m3 `out` (head dim 128): the output quantised for a
    block-FP8 output projection (`block_sparse_attention`'s `out_scales`), in the Triton kernel's
    epilogue; the other executors quantise their output afterwards, to the same values.
    """
    if out_scales is not None:
        if out is None or out.dtype != torch.float8_e4m3fn:
            raise ValueError("out_scales needs an e4m3 `out` [B, Hq, N, D] to write into")
        if not (
            isinstance(selection, BlockSelection)
            and resolve_executor(executor, q.device) == "triton"
        ):
            result = execute(q, k, v, selection, executor, scale)
            return _quantised_into(result, out, out_scales)
    if not isinstance(selection, BlockSelection):  # brings its own executors
        own = "reference" if resolve_executor(executor, q.device) == "reference" else "auto"
        return _into(selection.attend(q, k, v, scale=scale, executor=own), out)
    if selection.seq_len != q.shape[2]:
        raise ValueError(
            f"selection was made for seq_len={selection.seq_len} but q has N={q.shape[2]}"
        )
    name = resolve_executor(executor, q.device)
    kernel = _KERNELS[name]
    lists = (selection.kv_count, selection.kv_indices, selection.block_q, selection.block_k)
    if name == "triton":
        return kernel(q, k, v, *lists, scale=scale, out=out, out_scales=out_scales)
    return _into(kernel(q, k, v, *lists, scale=scale), out)


def _quantised_into(result: Tensor, out: Tensor, out_scales: Tensor) -> Tensor:
    """`result` [B, Hq, N, D] seen as the rows [B * N, Hq * D] of an output projection, quantised
    per row and head (`fp8_gemm.fp8_act_quant`'s values) into `out` and `out_scales` [Hq, B * N]."""
    from rbs_bench.kernels.fp8_gemm import fp8_act_quant, fp8_act_quant_ref

    b, h, n, d = result.shape
    rows = result.transpose(1, 2).reshape(b * n, h * d)
    quantise = fp8_act_quant if rows.is_cuda and HAS_TRITON else fp8_act_quant_ref
    xq, xs = quantise(rows, d)
    out.copy_(xq.view(b, n, h, d).transpose(1, 2))
    out_scales.copy_(xs)
    return out


def _into(result: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return result
    return out.copy_(result)
