"""The RMSNorm that writes FP8 rows (`kernels.fp8_norm`) and the product that reads quantised rows
(`fp8_gemm.fp8_linear_quantised`), against their PyTorch references.

Kernel tests run on a GPU, or on the CPU under Triton's interpreter in a fresh Python
(`test_interpreter_suite`, fp32/fp16 inputs: the interpreter's bf16 casts do not round to nearest).
"""

from __future__ import annotations

import interpreter_suite
import pytest
import torch
from interpreter_suite import CUDA, DEVICE, kernel_test
from rbs_bench.kernels import fp8_gemm
from rbs_bench.kernels.fp8_gemm import FP8_DTYPE, act_quant_ref, fp8_act_quant
from rbs_bench.kernels.fp8_norm import rmsnorm_quant, rmsnorm_quant_ref, rmsnorm_ref

FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)
fp8_kernel_test = pytest.mark.skipif(
    DEVICE == "cuda" and not FP8_GPU, reason="fp8 tensor cores need capability 8.9 or newer"
)
E4M3_STEP = 2.0**-3  # e4m3 keeps 3 fraction bits: neighbours differ by at most 1/8 of a value


def rows_and_weight(m, k, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
    x[:, :: max(1, k // 16)] *= 8  # outlier channels
    w = 1 + 0.2 * torch.randn(k, generator=gen)
    return x.to(device, dtype), w.to(device, dtype)


def quantized_weight(n, k, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    blocks = w.reshape(n // 128, 128, k // 128, 128)
    s = blocks.abs().amax((1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(FP8_DTYPE)
    return q.reshape(n, k).to(device), s.to(device)


def test_reference_is_the_qwen3_norm_then_the_quantisation():
    """`rmsnorm_ref` is Qwen3-MoE's RMSNorm module, bit for bit, in bf16; `rmsnorm_quant_ref` is
    `act_quant_ref` of it, scales group-major."""
    mod = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    x, w = rows_and_weight(9, 256, torch.bfloat16)
    norm = mod.Qwen3MoeRMSNorm(256, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = w
    assert torch.equal(norm(x), rmsnorm_ref(x, w, 1e-6))
    q, s = rmsnorm_quant_ref(x, w, 1e-6)
    q_ref, s_ref = act_quant_ref(norm(x), 128)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref.t()) and s.is_contiguous()


def test_quantised_product_reference_is_the_linear_reference():
    """The product of rows quantised beforehand is `fp8_linear_ref` of the unquantised rows."""
    x, _ = rows_and_weight(7, 256, torch.float32, seed=1)
    wq, s = quantized_weight(128, 256)
    a, a_s = act_quant_ref(x, 128)
    got = fp8_gemm.fp8_linear_quantised_ref(a, a_s.t(), wq, s, (128, 128), torch.float32)
    torch.testing.assert_close(got, fp8_gemm.fp8_linear_ref(x, wq, s, (128, 128)))


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize("m,k", [(1, 128), (5, 256), (33, 384), (70, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_norm_quant_matches_reference(m, k, dtype):
    """Scales within a few ulp of the reference's (the mean's summation order); bytes equal but
    where a value sits on the rounding boundary, and those one e4m3 step apart."""
    x, w = rows_and_weight(m, k, dtype, seed=m + k, device=DEVICE)
    q, s = rmsnorm_quant(x, w, 1e-6)
    q_ref, s_ref = rmsnorm_quant_ref(x, w, 1e-6)
    assert q.shape == (m, k) and s.shape == (k // 128, m)
    torch.testing.assert_close(s, s_ref, rtol=2**-20, atol=0)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert int(differ.sum()) <= max(1, differ.numel() // 1000)
    deq = q.float() * s.t().repeat_interleave(128, 1)
    deq_ref = q_ref.float() * s_ref.t().repeat_interleave(128, 1)
    assert bool(((deq - deq_ref).abs() <= E4M3_STEP * deq_ref.abs() + 1e-30)[differ].all())


@kernel_test
@fp8_kernel_test
@pytest.mark.parametrize("m", [1, 7, 129])
def test_kernel_quantised_product_is_the_linear_product(m):
    """`fp8_linear_quantised` on `fp8_act_quant`'s output is `fp8_linear` of the rows, exactly
    (the same product of the same operands), and its reference within the rounding of the
    output."""
    x, _ = rows_and_weight(m, 512, torch.float16, seed=m, device=DEVICE)
    wq, s = quantized_weight(512, 512, device=DEVICE)
    a, a_s = fp8_act_quant(x, 128)
    got = fp8_gemm.fp8_linear_quantised(a, a_s, wq, s, (128, 128), torch.float16)
    assert torch.equal(got, fp8_gemm.fp8_linear(x, wq, s, (128, 128)))
    ref = fp8_gemm.fp8_linear_quantised_ref(a, a_s, wq, s, (128, 128), torch.float32)
    rounding = (ref.to(torch.float16).float() - ref).norm(dim=-1)
    accumulation = 2.0**-11 if DEVICE == "cuda" else 0.0  # see tests/kernels/test_fp8_gemm.py
    bound = 2 * rounding + accumulation * ref.abs().sum(-1) * 4 + 1e-6
    assert bool(((got.float() - ref).norm(dim=-1) <= bound).all())


def test_norm_quant_rejects_what_it_cannot_normalise():
    x, w = rows_and_weight(4, 200, torch.float32)
    with pytest.raises(ValueError, match="a multiple of 128"):
        rmsnorm_quant(x, w, 1e-6)
    x, w = rows_and_weight(4, 256, torch.float32)
    with pytest.raises(ValueError, match="weight \\[K\\] of x's dtype"):
        rmsnorm_quant(x, w.half(), 1e-6)


def test_quantised_product_rejects_mismatched_scales():
    wq, s = quantized_weight(128, 256)
    a = torch.zeros(5, 256).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="fp32 scales \\[2, 5\\]"):
        fp8_gemm.fp8_linear_quantised(a, torch.ones(5, 2), wq, s)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_gemm.fp8_linear_quantised(a.float(), torch.ones(2, 5), wq, s)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with fp8 tensor cores")
def test_kernel_norm_quant_bf16_model_shape_gpu():
    """The FP8 checkpoints' q/k/v input (hidden 2048) in bf16 at 4099 rows: as on the CPU."""
    x, w = rows_and_weight(4099, 2048, torch.bfloat16, seed=3, device="cuda")
    q, s = rmsnorm_quant(x, w, 1e-6)
    q_ref, s_ref = rmsnorm_quant_ref(x, w, 1e-6)
    torch.testing.assert_close(s, s_ref, rtol=2**-7, atol=0)  # a bf16 rounding of one value
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert int(differ.sum()) <= differ.numel() // 1000


@interpreter_suite.fresh
def test_interpreter_suite():
    """Run this file's kernel tests on CPU under Triton's interpreter, in a fresh Python."""
    interpreter_suite.check(__file__, "-k", "kernel", at_least=11)
