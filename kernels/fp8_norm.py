"""An RMSNorm that writes its output quantised for the block-FP8 product that reads it.

In a decoder layer the input RMSNorm's only reader is the attention's q/k/v product. With FP8
q, k and v (one product, `models.fp8.fuse_linears`) the norm wrote bf16 rows that a second pass
(`fp8_gemm.fp8_act_quant`) read back to quantise. `rmsnorm_quant` does both in one read of the
hidden states and writes e4m3 rows and their scales, in the layout `fp8_gemm.fp8_linear_quantised`
takes. The arithmetic is the Qwen3 / Llama RMSNorm's in eager PyTorch, y = w * (x * rsqrt(mean(x^2)
+ eps)) with the normalised rows rounded to x's dtype before the weight and the product rounded
again, then `fp8_act_quant`'s per-row, per-128-column quantisation of y. On an H200 at 128K
tokens of hidden size 2048 it takes 0.25 ms, where the compiled norm alone took 0.29 ms and the
norm then the quantisation 0.51 ms; 99.9999% of its bytes equal the eager norm's quantised
(results/scale/logs/h200_s24_callA_quant_probe.txt).

`rmsnorm_quant_ref` is the PyTorch reference: the eager norm, then `fp8_gemm.fp8_act_quant_ref`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .fp8_gemm import (
    CUBLAS_BLOCK,
    FP8_DTYPE,
    _dynamic_scales,
    _rounded,
    _to_e4m3,
    fp8_act_quant_ref,
)
from .triton_util import INTERPRET, check_triton_launch, jit, tl, triton

GROUP = CUBLAS_BLOCK[1]  # the activation group of the FP8 checkpoints' 128 x 128 weight blocks
MAX_K = 16384  # one program holds a whole row


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The RMSNorm of Qwen3 and Llama as their modules compute it, in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rmsnorm_quant_ref(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(e4m3 [M, K], fp32 scales [K / 128, M] group-major) of `rmsnorm_ref(x [M, K])`."""
    return fp8_act_quant_ref(rmsnorm_ref(x, weight, eps), GROUP)


def fusable(x: Tensor, weight: Tensor) -> bool:
    """Whether `rmsnorm_quant` computes this norm: x [..., K] bf16/fp16/fp32 with a weight [K] of
    its dtype, K a multiple of 128 and at most `MAX_K`."""
    k = x.shape[-1]
    return (
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and tuple(weight.shape) == (k,)
        and k % GROUP == 0
        and 0 < k <= MAX_K
    )


@jit
def _rmsnorm_quant_kernel(
    X,
    W,
    XQ,
    XS,
    M,
    K,
    eps,
    stride_xm,
    ROUND: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
):
    # one program: one row, whole; the scales group-major at g * M + row
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_G * GROUP)
    c_ok = cols < K
    x = tl.load(X + row * stride_xm + cols, mask=c_ok, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / K + eps)
    normed = _rounded(xf * inv, x.dtype, ROUND)
    w = tl.load(W + cols, mask=c_ok, other=0.0).to(tl.float32)
    y = tl.reshape(_rounded(w * normed, x.dtype, ROUND), (BLOCK_G, GROUP))
    s = _dynamic_scales(y)
    q = tl.reshape(_to_e4m3(y, s, ROUND), (BLOCK_G * GROUP,))
    tl.store(XQ + row * K + cols, q, mask=c_ok)
    g = tl.arange(0, BLOCK_G)
    tl.store(XS + g * M + row, s, mask=g < K // GROUP)


def rmsnorm_quant(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`rmsnorm_quant_ref` in one Triton pass: x [M, K] (`fusable`) -> (e4m3 [M, K], fp32 scales
    [K / 128, M])."""
    if x.dim() != 2 or not fusable(x, weight):
        raise ValueError(
            f"rmsnorm_quant takes x [M, K] (K a multiple of {GROUP}, at most {MAX_K}) and a "
            f"weight [K] of x's dtype; got x {x.dtype} {list(x.shape)}, weight {weight.dtype} "
            f"{list(weight.shape)}"
        )
    check_triton_launch("rmsnorm_quant", x, weight)
    m, k = x.shape
    xq = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty(k // GROUP, m, dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, xs
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight.contiguous()
    block_g = triton.next_power_of_2(k // GROUP)
    # 2 warps for K = 2048, 4 for 4096: the fastest of 1-16 on an H200 (the log above)
    warps = max(2, min(8, k // 1024))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _rmsnorm_quant_kernel[(m,)](
            x, w, xq, xs, m, k, float(eps), x.stride(0), ROUND=INTERPRET, BLOCK_G=block_g,
            GROUP=GROUP, num_warps=warps,
        )  # fmt: skip
    return xq, xs
