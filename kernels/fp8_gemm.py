"""Block-quantised FP8 linear layers (the format of DeepSeek-V3-style FP8 checkpoints).

Format. A weight W is e4m3 [N, K] (per expert: [E, N, K]) with fp32 `weight_scale_inv` S_w
[ceil(N / bn), ceil(K / bk)] ([E, ...]) for blocks of bn x bk (128 x 128 in the checkpoints this
harness runs): the real weight is W[n, k] * S_w[n // bn, k // bk]. Activations are quantised
dynamically per row and group of G = bk consecutive K entries: s = max |x| over the group / 448
(floored at 1e-10 / 448), x_q = x / s rounded to the nearest e4m3 value (ties to even). Then

    y[m, n] = sum over groups g of  s[m, g] * S_w[n // bn, g] * sum_{k in g} x_q[m, k] W[n, k]

accumulated in fp32, returned in x's dtype. With a static `activation_scale` (one fp32 scalar)
every group uses it instead. A per-tensor weight (block_size None, S_w a scalar) keeps G = 128.

Kernels. `fp8_act_quant` writes x_q and the scales (one read of x); `_fp8_gemm_kernel` multiplies
e4m3 tiles on the tensor cores (one `tl.dot` per 128-wide K group, scaled and added to an fp32
accumulator, so the tensor cores' reduced-precision fp8 accumulation never spans more than one
group) and either reads the quantised activations or quantises its own tile (`fused`: no
second pass over x, but every column tile of the output quantises the same rows again).
The grouped form takes rows sorted by expert and int32 cumulative row ends `offsets` [E]; each
program finds its expert and row range from `offsets` on the device (no host synchronisation);
rows past offsets[-1] are written as zeros. On Hopper the product of quantised activations runs
in a persistent form instead (`_fp8_gemm_tma_kernel`, `_tma_config`): one program per SM walks
the output tiles and reads the e4m3 tiles through tensor descriptors (TMA), where K is a
multiple of 128, N of the tile and the weight blocks 128 x 128 (every FP8 MoE shape); same
values, 0-10% faster than the pointer kernel on those shapes (docs/kernels.md), and
RBS_BENCH_FP8_TMA=0 keeps the pointer kernel. The batched form (one expert id per row) sorts the
rows by expert on the device and runs the grouped form.

cuBLAS. On Hopper (capability 9.0+) a 2-d product with 128 x 128 weight blocks, dynamic
activation scales and K and N multiples of 512 goes to cuBLAS's block-scaled FP8 GEMM instead
(`torch._scaled_mm` with 1 x 128 activation and 128 x 128 weight scales: the same function, at
1,040-1,180 TFLOP/s where the Triton product reaches 530-790 on the FP8 MoE's shapes at 128K
tokens, results/speed/fp8_scaled_mm_probe_nvidia_h100_80gb_hbm3.csv). cuBLAS takes only row
counts that are a multiple of 4 (others are padded with zero rows), refuses other row counts, and
returned wrong values (inf) for K = 768, a K / 128 that is not a multiple of 4: such shapes stay
on the Triton kernel. Before its first use on a device the path is checked once against the
Triton product on a small shape; RBS_BENCH_FP8_CUBLAS=0 keeps every product on Triton.
The grouped (experts') product takes the same recipe one expert at a time
(`cublas_grouped_linear`) when its K and N qualify and the rows average at least
`CUBLAS_GROUPED_MIN_ROWS` per expert (a prefill, not a decode step);
RBS_BENCH_FP8_CUBLAS_GROUPED=0 keeps it on Triton.

`fp8_linear_ref`, `fp8_grouped_linear_ref`, `fp8_batched_linear_ref` and `act_quant_ref` are the
PyTorch references: the same activation quantisation, then an fp32 product of the dequantised
operands. The public kernels are torch.library custom ops (`torch.ops.rbs_bench.fp8_linear`,
`...fp8_grouped_linear`) with fake implementations, so torch.compile treats them as opaque.

They need a GPU with fp8 tensor cores (capability 8.9 or newer); on older GPUs transformers
dequantises FP8 checkpoints to bf16 at load time and never calls them. Under TRITON_INTERPRET=1
they run on CPU tensors; triton's interpreter rounds fp32 -> e4m3 casts with ties away from zero
and without carrying into the exponent (triton 3.9), so the interpreted kernels round to the e4m3
grid in fp32 first (`_e4m3_rne`) and the cast is exact; on a GPU the cast itself rounds.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
from torch import Tensor

from .triton_util import (
    INTERPRET,
    autotune,
    autotune_space,
    check_triton_launch,
    jit,
    kernel_arch,
    tl,
    triton,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
AMAX_FLOOR = 1e-10  # a group of zeros gets the scale 1e-10 / 448 (x_q = 0), never 0
GROUP_DEFAULT = 128  # activation group for per-tensor weights


# ------------------------------------------------------------------------------ references


def _blocks(weight: Tensor, weight_scale_inv: Tensor, block_size) -> tuple[int, int, int]:
    """(bn, bk, activation group G) of a weight and its scales; a one-line error if they do not
    fit together (2-d [N, K] with [ceil(N / bn), ceil(K / bk)], or 3-d per expert)."""
    n, k = weight.shape[-2:]
    if block_size is None:
        if weight_scale_inv.numel() != (1 if weight.dim() == 2 else weight.shape[0]):
            raise ValueError(
                f"a per-tensor FP8 weight (block_size None) needs one scale"
                f"{'' if weight.dim() == 2 else ' per expert'}; got weight_scale_inv "
                f"{tuple(weight_scale_inv.shape)}"
            )
        return n, k, GROUP_DEFAULT
    bn, bk = (int(b) for b in block_size)
    if bn < 1 or bk < 16 or bk & (bk - 1) or bk > 256:
        raise ValueError(
            f"block_size must be [bn >= 1, bk a power of two in 16..256]; got {list(block_size)}"
        )
    want = (*weight.shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv must be {list(want)} for weight {list(weight.shape)} and block_size "
            f"{list(block_size)}; got {list(weight_scale_inv.shape)}"
        )
    return bn, bk, bk


def act_quant_ref(
    x: Tensor, group: int, activation_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(x_q e4m3 [M, K], scales fp32 [M, ceil(K / group)]) of x [M, K]: per row and group of K,
    s = max |x| / 448 (floored), x_q = x / s rounded to e4m3; or s = activation_scale."""
    m, k = x.shape
    groups = math.ceil(k / group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    if activation_scale is None:
        amax = xf.abs().amax(-1).clamp_min(AMAX_FLOOR)  # [M, G]
        # divided by a tensor: on CUDA torch multiplies by the reciprocal of a Python scalar,
        # which can differ from the quotient in the last bit; the kernels divide (IEEE)
        s = amax / torch.full_like(amax, FP8_MAX)
    else:
        s = activation_scale.float().reshape(1, 1).expand(m, groups)
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], s.contiguous()


def dequantize_weight_ref(weight: Tensor, weight_scale_inv: Tensor, block_size) -> Tensor:
    """fp32 [..., N, K]: each weight block times its scale."""
    n, k = weight.shape[-2:]
    bn, bk, _ = _blocks(weight, weight_scale_inv, block_size)
    s = weight_scale_inv.float().reshape(*weight.shape[:-2], -1, math.ceil(k / bk))
    s = s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return weight.float() * s


def fp8_act_quant_ref(x: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """`fp8_act_quant` in PyTorch, in its layout: (e4m3 [M, K], fp32 scales [ceil(K / group), M]
    group-major) of `act_quant_ref(x [M, K], group)`."""
    q, s = act_quant_ref(x, group)
    return q, s.t().contiguous()


def _dequantized(q: Tensor, s: Tensor, group: int) -> Tensor:
    """fp32 e4m3 q [M, K] times its scales s [M, ceil(K / group)], each over its group."""
    return q.float() * s.float().repeat_interleave(group, -1)[:, : q.shape[1]]


def _dequantize_act(x: Tensor, group: int, activation_scale: Tensor | None) -> Tensor:
    return _dequantized(*act_quant_ref(x, group, activation_scale), group)


def fp8_linear_ref(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size=(128, 128),
    activation_scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x [..., K] -> [..., N]: `act_quant_ref`, then an fp32 product with the dequantised weight
    [N, K]; returned in `out_dtype` (x's dtype by default)."""
    _check_linear(x, weight, weight_scale_inv)
    _, _, group = _blocks(weight, weight_scale_inv, block_size)
    x2 = x.reshape(-1, x.shape[-1])
    w = dequantize_weight_ref(weight, weight_scale_inv, block_size)
    y = _dequantize_act(x2, group, activation_scale) @ w.T
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_quantised_ref(
    a: Tensor,
    a_s: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size=(128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`fp8_linear_quantised` in PyTorch: a [M, K] e4m3 times its group-major scales a_s [G, M],
    then an fp32 product with the dequantised weight [N, K]."""
    _, _, group = _blocks(weight, weight_scale_inv, block_size)
    y = (
        _dequantized(a, a_s.t(), group)
        @ dequantize_weight_ref(weight, weight_scale_inv, block_size).T
    )
    return y.to(out_dtype)


def fp8_grouped_linear_ref(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    offsets: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """x [S, K] with rows sorted by expert, offsets [E] the cumulative row ends -> [S, N]: rows
    [offsets[e - 1], offsets[e]) go through expert e's weight [E, N, K]; rows past offsets[-1]
    are zeros."""
    _check_grouped(x, weight, weight_scale_inv, offsets)
    _, _, group = _blocks(weight, weight_scale_inv, block_size)
    w = dequantize_weight_ref(weight, weight_scale_inv, block_size)  # [E, N, K]
    xd = _dequantize_act(x, group, None)
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    ends = offsets.tolist()
    for e, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends)):
        if hi > lo:
            out[lo:hi] = xd[lo:hi] @ w[e].T
    return out.to(x.dtype)


def fp8_batched_linear_ref(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    expert_ids: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """x [S, K], expert_ids [S] -> [S, N]: row s through expert expert_ids[s]; rows whose id is
    not an expert (>= E, e.g. another rank's) are zeros."""
    _check_batched(x, weight, weight_scale_inv, expert_ids)
    _, _, group = _blocks(weight, weight_scale_inv, block_size)
    w = dequantize_weight_ref(weight, weight_scale_inv, block_size)
    xd = _dequantize_act(x, group, None)
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    for e in range(weight.shape[0]):
        rows = (expert_ids == e).nonzero().flatten()
        out[rows] = xd[rows] @ w[e].T
    return out.to(x.dtype)


def _check_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(
            f"weight must be float8_e4m3fn [N, K]; got {weight.dtype} {list(weight.shape)}"
        )
    _check_common(x, weight, weight_scale_inv)


def _check_grouped(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, offsets: Tensor) -> None:
    _check_experts(x, weight, weight_scale_inv)
    if offsets.dim() != 1 or offsets.numel() != weight.shape[0] or offsets.is_floating_point():
        raise ValueError(
            f"offsets must be integer [E] = [{weight.shape[0]}] (cumulative row ends per expert); "
            f"got {offsets.dtype} {list(offsets.shape)}"
        )


def _check_batched(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, ids: Tensor) -> None:
    _check_experts(x, weight, weight_scale_inv)
    if ids.dim() != 1 or ids.numel() != x.shape[0] or ids.is_floating_point():
        raise ValueError(
            f"expert_ids must be integer [S] = [{x.shape[0]}]; got {ids.dtype} {list(ids.shape)}"
        )


def _check_experts(x: Tensor, weight: Tensor, weight_scale_inv: Tensor) -> None:
    if weight.dim() != 3 or weight.dtype != FP8_DTYPE or weight.shape[0] < 1:
        raise ValueError(
            f"weight must be float8_e4m3fn [E, N, K] with E >= 1; got {weight.dtype} "
            f"{list(weight.shape)}"
        )
    if x.dim() != 2:
        raise ValueError(f"x must be [S, K]; got {list(x.shape)}")
    _check_common(x, weight, weight_scale_inv)


def _check_common(x: Tensor, weight: Tensor, weight_scale_inv: Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"x's last dim ({x.shape[-1]}) must match the weight's K ({weight.shape[-1]})"
        )
    if weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be float32; got {weight_scale_inv.dtype}")


# ------------------------------------------------------------------------------ kernels


@jit
def _e4m3_rne(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32 (exact)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23  # biased fp32 exponent
    man = (mag & 0x7FFFFF) | 0x800000
    # keep 3 fraction bits (20 dropped); below e4m3's smallest normal 2^-6 keep multiples of 2^-9
    shift = tl.minimum(tl.maximum(141 - exp, 20), 25)
    one = shift * 0 + 1
    q = man >> shift
    rem = man & ((one << shift) - 1)
    half = one << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)  # a carry is fine
    unit = ((exp - 23 + shift) << 23).to(tl.float32, bitcast=True)  # 2^(exponent of q's unit)
    val = tl.where(exp == 0, 0.0, q.to(tl.float32) * unit)
    return tl.where(bits < 0, -val, val)


@jit
def _dynamic_scales(x):
    """The per-row scales of a [rows, group] fp32 tile: max |x| / 448, floored at 1e-10 / 448
    (IEEE division, as torch divides)."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-10), 448.0)


@jit
def _to_e4m3(x, s, ROUND: tl.constexpr):
    """A [rows, group] fp32 tile over its per-row scales s, clamped to +-448, as e4m3 (ROUND:
    rounded to the e4m3 grid in fp32 first, for the interpreter; on a GPU the cast rounds). The
    division is IEEE's, as torch's: fp32 `/` on a GPU is approximate, and a quotient one ulp off
    can round to the other e4m3 neighbour of a near-tie, 6% of that value."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0)
    if ROUND:
        y = _e4m3_rne(y)
    return y.to(tl.float8e4nv)


@jit
def _rounded(x, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), as fp32. On a GPU the casts round so
    (one instruction each way); with BITS (the interpreter, which does not round fp32 -> bf16
    casts to nearest, triton 3.9) bf16 is rounded by its bits, a dozen integer operations per
    value that made the gate ALU-bound: 1.30 ms against 1.13 ms with the casts at 128K tokens
    on an H200, the same bytes (results/scale/logs/h200_s20_callA_gated_quant_probe.txt)."""
    if BITS and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@jit
def _expert_segments(Offsets, M, n_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """The grouped products' row segments, [E_PAD] each: segment e < E is expert e's rows
    [offsets[e - 1], offsets[e]), segment E the rows past offsets[-1] (up to M); (seg, starts,
    ends, tiles: BLOCK_M row tiles per segment, cum: their inclusive running sum)."""
    seg = tl.arange(0, E_PAD)
    is_real = seg < n_experts
    ends = tl.load(Offsets + seg, mask=is_real, other=0)
    starts = tl.load(Offsets + seg - 1, mask=is_real & (seg > 0), other=0)
    last = tl.load(Offsets + n_experts - 1)
    ends = tl.minimum(tl.where(seg == n_experts, M, ends), M)
    starts = tl.minimum(tl.where(seg == n_experts, last, starts), M)
    tiles = tl.where(seg <= n_experts, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    return seg, starts, ends, tiles, tl.cumsum(tiles, 0)


@jit
def _tile_rows(seg, starts, ends, tiles, cum, pid_m, BLOCK_M: tl.constexpr):
    """Row tile pid_m (< sum(tiles)) of `_expert_segments`: (its segment e, first row, the
    segment's end row)."""
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    own = seg == e
    first_tile = tl.sum(tl.where(own, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(own, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return e, row0, tl.sum(tl.where(own, ends, 0), 0)


@jit
def _act_quant_kernel(
    X,
    XQ,
    XS,
    ActScale,
    M,
    M_LOAD,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sg,
    stride_sm,
    STATIC: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    # one program: BLOCK_M of the M rows x one group of K, scales at g * stride_sg + row *
    # stride_sm; rows at and past M_LOAD (<= M) quantise zeros
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    r_ok = rows < M
    c_ok = (cols < K)[None, :]
    ok = r_ok[:, None] & c_ok
    rows64 = rows.to(tl.int64)
    x_ptrs = X + rows64[:, None] * stride_xm + cols[None, :] * stride_xk
    x = tl.load(x_ptrs, mask=(rows < M_LOAD)[:, None] & c_ok, other=0.0)
    x = x.to(tl.float32)
    if STATIC:
        s = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(ActScale)
    else:
        s = _dynamic_scales(x)
    y = _to_e4m3(x, s, ROUND)
    tl.store(XQ + rows64[:, None] * stride_qm + cols[None, :] * stride_qk, y, ok)
    tl.store(XS + tl.program_id(1) * stride_sg + rows64 * stride_sm, s, mask=r_ok)


@jit
def _fp8_gemm_kernel(
    A,
    AS,
    B,
    BS,
    C,
    Offsets,
    M,
    N,
    K,
    n_experts,
    stride_am,
    stride_ak,
    stride_sg,
    stride_sm,
    stride_be,
    stride_bn,
    stride_bk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_cm,
    stride_cn,
    m_bucket,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    GROUPED: tl.constexpr,
    FUSED: tl.constexpr,
    ROUND: tl.constexpr,
    EVEN_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Tile order: GROUP_M row tiles side by side for every column tile (their weight tiles are
    # read once from DRAM and then from L2). Grouped: row tiles are virtual, enough for any split
    # of the rows into E + 1 segments (the experts, then the rows past offsets[-1]).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if GROUPED:
        num_pid_m = tl.cdiv(M, BLOCK_M) + n_experts + 1
    else:
        num_pid_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    k_tiles = tl.cdiv(K, BLOCK_K)
    if GROUPED:  # the rows past offsets[-1] (segment E) are written as zeros (no K loop)
        seg, starts, ends, tiles, cum = _expert_segments(Offsets, M, n_experts, BLOCK_M, E_PAD)
        if pid_m >= tl.sum(tiles, 0):
            return
        e, row0, row_end = _tile_rows(seg, starts, ends, tiles, cum, pid_m, BLOCK_M)
        k_tiles = tl.where(e < n_experts, k_tiles, 0)
        e64 = tl.minimum(e, n_experts - 1).to(tl.int64)
    else:
        row0 = pid_m * BLOCK_M
        row_end = M
        e64 = 0

    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # loads clamp rows and columns into range instead of masking them (no masks in the loop);
    # what the clamped rows and columns compute is never stored
    rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
    cols_ld = tl.minimum(cols, N - 1).to(tl.int64)
    a_ptrs = A + rows_ld[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + e64 * stride_be + cols_ld[:, None] * stride_bn + offs_k[None, :] * stride_bk
    as_ptrs = AS + rows_ld * stride_sm
    # one weight scale per K group for the whole column tile when it lies in one block row
    # (128-row blocks and tiles of <= 128 columns); else one per column
    ONE_WS: tl.constexpr = SCALE_BN % BLOCK_N == 0
    if ONE_WS:
        bs_ptrs = BS + e64 * stride_se + ((pid_n * BLOCK_N) // SCALE_BN) * stride_sn
    else:
        bs_ptrs = BS + e64 * stride_se + (cols_ld // SCALE_BN) * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, k_tiles):
        k0 = kt * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        w_s = tl.load(bs_ptrs + (k0 // SCALE_BK) * stride_sk)  # scalar, or [BLOCK_N]
        if FUSED:
            af = a.to(tl.float32)
            a_s = _dynamic_scales(af)
            a = _to_e4m3(af, a_s, ROUND)
        else:
            a_s = tl.load(as_ptrs + kt * stride_sg)  # [BLOCK_M]
        if ONE_WS:
            acc += tl.dot(a, tl.trans(b)) * (a_s * w_s)[:, None]
        else:
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    ok = (rows < row_end)[:, None] & (cols < N)[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=ok)


@jit
def _fp8_gemm_tma_kernel(
    ADesc,
    AS,
    BDesc,
    BS,
    C,
    Offsets,
    M,
    N,
    K,
    n_experts,
    stride_sg,
    stride_sm,
    stride_se,
    stride_sn,
    stride_sk,
    stride_cm,
    stride_cn,
    GROUPED: tl.constexpr,
    E_PAD: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # `_fp8_gemm_kernel`'s product on quantised activations, persistent: NUM_PROGS programs walk
    # the output tiles (same order, GROUP_M row tiles per column sweep), and the e4m3 tiles come
    # in through tensor descriptors (TMA). N is a multiple of BLOCK_N and K of BLOCK_K (128), and
    # a column tile lies inside one 128-row weight-scale block, so there are no masks in the loop.
    # Grouped: a row tile starts at its expert's rows and may read the next expert's rows (or
    # zeros past M); only its own rows are stored.
    num_pid_n = N // BLOCK_N
    k_tiles = K // BLOCK_K
    if GROUPED:
        seg, starts, ends, tiles, cum = _expert_segments(Offsets, M, n_experts, BLOCK_M, E_PAD)
        num_pid_m = tl.sum(tiles, 0)
    else:
        num_pid_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * num_pid_n
    total = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), total, NUM_PROGS, flatten=FLATTEN):
        first_m = (tile // width) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % group_rows
        pid_n = (tile % width) // group_rows
        if GROUPED:
            e, row0, row_end = _tile_rows(seg, starts, ends, tiles, cum, pid_m, BLOCK_M)
            e_w = tl.minimum(e, n_experts - 1)
        else:
            e = 0
            row0 = pid_m * BLOCK_M
            row_end = M
            e_w = 0
        col0 = pid_n * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
        bs_ptr = BS + e_w.to(tl.int64) * stride_se + (col0 // 128) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, k_tiles):
            a = ADesc.load([row0, kt * BLOCK_K])
            b = BDesc.load([e_w * N + col0, kt * BLOCK_K])
            a_s = tl.load(AS + kt * stride_sg + rows_ld * stride_sm)
            w_s = tl.load(bs_ptr + kt * stride_sk)
            acc += tl.dot(a, tl.trans(b)) * (a_s * w_s)[:, None]
        if GROUPED:  # segment E: the rows past offsets[-1], zeros
            acc = tl.where(e < n_experts, acc, 0.0)
        cols = col0 + tl.arange(0, BLOCK_N)
        c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rows < row_end)[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the activation group (128), GROUP_M 8.
# Each K group's product lands in a fresh accumulator that is scaled into the running one, so a
# tile holds two fp32 accumulators: 128 x 128 in 8 warps takes 177 registers (one program per
# SM), 64 x 128 in 4 warps 168 (three per SM, 72 KB of shared memory each at 3 stages); 256-wide
# tiles spill (ptxas for sm_90a, triton 3.9).
HOPPER_SPACE = (
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (64, 128, 4, 3),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    (64, 64, 4, 4),
)
# Ada (capability 8.9, 100 KB of shared memory per SM): 2-3 stages of at most 32 KB.
ADA_SPACE = (
    (128, 128, 8, 2),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 4),
)


def tuning_space(device=None) -> tuple:
    """The autotuner's configurations for the device's architecture (`kernel_arch`)."""
    return HOPPER_SPACE if kernel_arch(device) >= 90 else ADA_SPACE


def _m_bucket(m: int) -> int:
    """Row counts that share one tuning result: powers of 4 from 16 up to 16384, then one."""
    bucket = 16
    while bucket < m and bucket < 16384:
        bucket *= 4
    return bucket


if triton is not None:

    @functools.cache
    def _tuned_gemm(space: tuple, block_k: int):
        configs = [
            triton.Config(
                {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": 8},
                num_warps=w,
                num_stages=s,
            )
            for bm, bn, w, s in space
        ]
        key = ["N", "K", "m_bucket", "GROUPED", "FUSED"]
        return autotune(configs, key)(_fp8_gemm_kernel)


def fp8_act_quant(
    x: Tensor, group: int = 128, activation_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(x_q e4m3 [M, K], scales fp32 [ceil(K / group), M], group-major) of x [M, K] (Triton);
    the values of `act_quant_ref` (whose scales are [M, groups])."""
    check_triton_launch("fp8_act_quant", x, activation_scale)
    m, k = x.shape
    groups = math.ceil(k / group)
    xq = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    xs = torch.empty(groups, m, device=x.device, dtype=torch.float32)
    if m == 0 or k == 0:
        return xq, xs
    static = activation_scale is not None
    scale = activation_scale.float().reshape(1) if static else xs
    _act_quant_kernel[(triton.cdiv(m, 32), groups)](
        x,
        xq,
        xs,
        scale,
        m,
        m,
        k,
        *x.stride(),
        *xq.stride(),
        *xs.stride(),
        STATIC=static,
        ROUND=INTERPRET,
        BLOCK_M=32,
        GROUP=group,
        num_warps=4,
    )
    return xq, xs


def _launch(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size,
    offsets: Tensor | None = None,
    activation_scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fused: bool = False,
    config: tuple | None = None,
    quantized: tuple[Tensor, Tensor] | None = None,
    tma: bool | None = None,
) -> Tensor:
    """The 2-d (offsets None) or grouped product, with the launch open for tests and tuning.

    fused: quantise x inside the product (dynamic scales only); config: (BLOCK_M, BLOCK_N,
    num_warps, num_stages) of the pointer kernel instead of the autotuner's choice, or
    (BLOCK_M, BLOCK_N, num_warps, num_stages, flatten) of the TMA form (which then runs, or
    raises where it cannot, whatever `tma` says); quantized:
    `fp8_act_quant(x)` already computed (to time the product alone); tma: the persistent TMA form
    (`_tma_config`) where it applies (None), always (True: an error where it cannot), or never.
    """
    grouped = offsets is not None
    check_triton_launch("fp8_linear", x, weight, weight_scale_inv, offsets, activation_scale)
    bn, bk, group = _blocks(weight, weight_scale_inv, block_size)
    m, k = x.shape
    n = weight.shape[-2]
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    fused = fused and activation_scale is None
    if fused:
        a, a_s = x, x  # a_s is never read
    elif quantized is not None:
        a, a_s = quantized
    else:
        a, a_s = fp8_act_quant(x, group, activation_scale)
    scales = weight_scale_inv.reshape(*weight.shape[:-2], -1, math.ceil(k / bk))  # per-tensor: 1x1
    w3, s3 = (weight, scales) if grouped else (weight[None], scales[None])
    e = w3.shape[0]
    offs = offsets.to(torch.int32) if grouped else a_s  # never read in the 2-d form
    tma_setting = config is not None and len(config) == 5  # never falls through to pointers
    if config is None or tma_setting:
        tma = True if tma_setting else tma
        tma_config = _tma_config(a, w3, n, k, block_size, fused, activation_scale, tma, config)
        if tma_config is not None:
            with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
                _launch_tma(a, a_s, w3, s3, out, offs, grouped, tma_config)
            return out

    def grid(meta):
        rows = triton.cdiv(m, meta["BLOCK_M"]) + (e + 1 if grouped else 0)
        return (rows * triton.cdiv(n, meta["BLOCK_N"]),)

    args = (
        a, a_s, w3, s3, out, offs, m, n, k, e,
        a.stride(0), a.stride(1), *((0, 0) if fused else a_s.stride()),
        *w3.stride(), *s3.stride(), *out.stride(), _m_bucket(m),
    )  # fmt: skip
    per_tensor = block_size is None  # one scale: every index 0
    meta = dict(
        SCALE_BN=1 << 30 if per_tensor else bn,
        SCALE_BK=1 << 30 if per_tensor else bk,
        GROUPED=grouped,
        FUSED=fused,
        ROUND=INTERPRET,
        EVEN_K=k % group == 0,
        E_PAD=triton.next_power_of_2(e + 1),
    )
    if INTERPRET and config is None:
        config = (32, 32, 4, 1)  # no timing under the interpreter
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        if config is None:
            _tuned_gemm(autotune_space(tuning_space(x.device)), group)[grid](*args, **meta)
        else:
            bm, bn_, warps, stages = config
            tile = dict(BLOCK_M=bm, BLOCK_N=bn_, BLOCK_K=group, GROUP_M=8)
            _fp8_gemm_kernel[grid(tile)](*args, **meta, **tile, num_warps=warps, num_stages=stages)
    return out


try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no triton, or one without them: the pointer kernel only
    TensorDescriptor = None

# The TMA form's launch: (BLOCK_M, BLOCK_N, num_warps, num_stages, flatten). On an H200 at 128K
# tokens the persistent, flattened 128 x 128 tile in 8 warps with 4 stages was the fastest of
# tile shape x stages x persistence x warp specialisation (results/scale/logs/h200_s15_call1_*).
TMA_CONFIG = (128, 128, 8, 4, True)
TMA_INTERPRET_CONFIG = (32, 32, 4, 1, True)  # small tiles for the interpreter's tests


def _tma_config(a, w3, n, k, block_size, fused, activation_scale, tma, config) -> tuple | None:
    """The TMA form's launch setting if it computes this product, else None: Hopper (or the
    interpreter), quantised activations with dynamic scales, the checkpoints' 128 x 128 weight
    blocks, K a multiple of 128 and N of BLOCK_N, and operands TMA can read (e4m3 rows
    contiguous and 16-byte aligned, the weight contiguous). RBS_BENCH_FP8_TMA=0 turns it off
    where `tma` is None."""
    if tma is False or (tma is None and os.environ.get("RBS_BENCH_FP8_TMA", "1") == "0"):
        return None
    config = config or (TMA_INTERPRET_CONFIG if INTERPRET else TMA_CONFIG)
    ok = (
        TensorDescriptor is not None
        and (INTERPRET or kernel_arch(a.device) >= 90)
        and not fused
        and activation_scale is None
        and block_size is not None
        and tuple(int(b) for b in block_size) == (128, 128)
        and k % 128 == 0
        and n % config[1] == 0
        and 128 % config[1] == 0
        and a.stride(1) == 1
        and a.stride(0) % 16 == 0
        and a.data_ptr() % 16 == 0
        and w3.is_contiguous()
        and w3.data_ptr() % 16 == 0
    )
    if tma and not ok:
        raise ValueError(
            "fp8_linear: the TMA form needs Hopper, dynamic activation scales, 128 x 128 weight "
            f"blocks, K a multiple of 128 and N of {config[1]}; got N={n}, K={k}"
        )
    return config if ok else None


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tma(a, a_s, w3, s3, out, offs, grouped: bool, config: tuple) -> None:
    """`_fp8_gemm_tma_kernel` on quantised rows a [M, K] (scales a_s [K / 128, M]) and the
    weights w3 [E, N, K] (scales s3 [E, N / 128, K / 128]) into out [M, N]."""
    bm, bn, warps, stages, flatten = config
    m, k = a.shape
    e, n = w3.shape[:2]
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, 128])
    b_desc = TensorDescriptor(w3.view(e * n, k), [e * n, k], [k, 1], [bn, 128])
    progs = _num_sms(a.device) if a.is_cuda else 4
    _fp8_gemm_tma_kernel[(progs,)](
        a_desc, a_s, b_desc, s3, out, offs, m, n, k, e,
        *a_s.stride(), *s3.stride(), *out.stride(),
        GROUPED=grouped, E_PAD=triton.next_power_of_2(e + 1), NUM_PROGS=progs, FLATTEN=flatten,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _block_args(block_n: int, block_k: int):
    return None if block_n <= 0 else (block_n, block_k)


CUBLAS_BLOCK = (128, 128)  # the one block shape of cuBLAS's block-scaled recipe
CUBLAS_ALIGN = 512  # K and N: a multiple of 4 blocks of 128 (K = 768 gave inf, see above)


def cublas_shape_ok(
    n: int, k: int, block_size, activation_scale, k_align: int = CUBLAS_ALIGN
) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM computes this product exactly as the Triton
    kernel does: 128 x 128 weight blocks, dynamic activation scales, N a multiple of 512 and K
    of `k_align` (512; 128 where the weight's scales are laid out as cuBLAS reads them,
    `fp8_moe.cublas_weight_scales`)."""
    return (
        block_size is not None
        and tuple(int(b) for b in block_size) == CUBLAS_BLOCK
        and activation_scale is None
        and k % k_align == 0
        and n % CUBLAS_ALIGN == 0
    )


def cublas_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, out_dtype) -> Tensor:
    """x [M, K] @ the block-FP8 weight [N, K] -> [M, N] in `out_dtype` (bf16) through
    `torch._scaled_mm`: activations quantised by `fp8_act_quant`, then `cublas_quantised`."""
    a, a_s = fp8_act_quant(x, CUBLAS_BLOCK[1])
    return cublas_quantised(a, a_s, weight, weight_scale_inv, out_dtype)


def cublas_quantised(a: Tensor, a_s: Tensor, weight: Tensor, weight_scale_inv: Tensor, out_dtype):
    """Quantised activations a (e4m3 [M, K]) with group-major scales a_s [K / 128, M] (as
    `fp8_act_quant` writes them, seen as [M, K / 128] with strides (1, M): the layout cuBLAS
    reads) @ the block-FP8 weight [N, K] (its scales [N / 128, K / 128] seen transposed) ->
    [M, N] through `torch._scaled_mm`; M not a multiple of 4 is padded with zero rows."""
    m = a.shape[0]
    pad = -m % 4
    if pad:
        a = torch.nn.functional.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(FP8_DTYPE)
        a_s = torch.nn.functional.pad(a_s, (0, pad), value=1.0)
    scales = weight_scale_inv.float().contiguous()
    out = torch._scaled_mm(a, weight.t(), a_s.t(), scales.t(), out_dtype=out_dtype)
    return out[:m] if pad else out


def cublas_grouped_linear(
    x: Tensor, weight: Tensor, weight_scale_inv: Tensor, offsets: Tensor, out_dtype
) -> Tensor:
    """The grouped product (`fp8_grouped_linear`'s contract) as one cuBLAS block-scaled GEMM per
    expert: the rows are quantised once (`fp8_act_quant`), then expert e's rows
    [offsets[e - 1], offsets[e]) times its weight [N, K] go to `torch._scaled_mm`.

    cuBLAS takes a multiple of 4 rows, so each expert's product covers its rows rounded up to one:
    the extra rows are the next expert's (finite, quantised like its own) and their outputs are
    overwritten by that expert's product, which runs later on the same stream; the last expert's
    spill lands in 3 spare rows of the output. Rows past offsets[-1] are zeros. Reads the row
    ends on the host (one synchronisation per call)."""
    xq, xs = fp8_act_quant(x, CUBLAS_BLOCK[1])  # [S, K] e4m3, scales [K / 128, S]
    s_rows = xq.shape[0]
    n = weight.shape[1]
    ends = offsets.tolist()
    out = torch.empty(s_rows + 3, n, dtype=out_dtype, device=xq.device)
    start = 0
    for e, end in enumerate(ends):
        end = min(end, s_rows)
        m = end - start
        if m <= 0:
            continue
        m4 = m + (-m % 4)
        if start + m4 <= s_rows:
            a = xq[start : start + m4]
            a_s = xs[:, start : start + m4].contiguous()
        else:  # the last rows: pad this expert's own rows
            a = torch.nn.functional.pad(xq[start:end].view(torch.uint8), (0, 0, 0, m4 - m))
            a = a.view(FP8_DTYPE)
            a_s = torch.nn.functional.pad(xs[:, start:end], (0, m4 - m), value=1.0).contiguous()
        w_s = weight_scale_inv[e].float().contiguous()
        torch._scaled_mm(
            a, weight[e].t(), a_s.t(), w_s.t(), out_dtype=out_dtype, out=out[start : start + m4]
        )
        start = end
    out = out[:s_rows]
    if start < s_rows:
        out[start:].zero_()
    return out


@functools.cache
def _cublas_works(device: torch.device) -> bool:
    """cuBLAS's recipe runs here and agrees with the Triton kernel on one small product (a
    torch built without it, or a GPU before Hopper, keeps the Triton kernel)."""
    if os.environ.get("RBS_BENCH_FP8_CUBLAS", "1") == "0" or kernel_arch(device) < 90:
        return False
    if not hasattr(torch, "_scaled_mm"):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(6, 1024, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(512, 1024, generator=gen, device=device) * 8).to(FP8_DTYPE)
    s = torch.rand(4, 8, generator=gen, device=device) / 64 + 1e-3
    try:
        got = cublas_linear(x, w, s, torch.bfloat16).float()
    except RuntimeError:
        return False
    ref = _launch(x, w, s, CUBLAS_BLOCK, out_dtype=torch.float32)
    return bool(torch.isfinite(got).all()) and float((got - ref).norm() / ref.norm()) < 1e-2


def _use_cublas(
    x: Tensor, weight: Tensor, block_size, activation_scale, out_dtype, k_align=CUBLAS_ALIGN
) -> bool:
    n, k = weight.shape[-2:]
    return (
        x.is_cuda
        and not INTERPRET
        and out_dtype == torch.bfloat16  # the output dtype of cuBLAS's block-scaled recipe
        and weight.dim() == 2
        and cublas_shape_ok(n, k, block_size, activation_scale, k_align)
        and _cublas_works(x.device)
    )


# The per-expert loop pays a host synchronisation, and a launch and a scale copy per expert:
# below this many rows per expert on average one grouped Triton launch is faster. On an H200 the
# experts' gate_up took 9.0 ms through the loop against 2.9 ms on Triton at 2,048 rows per expert
# (32K tokens), and 9.1 ms against 11.2 ms at 8,192 (results/speed/fp8_gemm_nvidia_h200.csv, rows
# time-gate_up-*); the same loop inside `fp8_moe` crosses over at 6,144 (CUBLAS_MIN_ROWS_SCALED_MM).
CUBLAS_GROUPED_MIN_ROWS = 6144


def _use_cublas_grouped(x: Tensor, weight: Tensor, block_size) -> bool:
    """Whether x's rows through the experts' weight [E, N, K] take `cublas_grouped_linear`: each
    expert's product as `_use_cublas` takes a 2-d one (x's dtype out), and on average at least
    `CUBLAS_GROUPED_MIN_ROWS` rows per expert."""
    return (
        x.shape[0] >= CUBLAS_GROUPED_MIN_ROWS * weight.shape[0]
        and os.environ.get("RBS_BENCH_FP8_CUBLAS_GROUPED", "1") != "0"
        and _use_cublas(x, weight[0], block_size, None, x.dtype)
    )


@torch.library.custom_op("rbs_bench::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
    activation_scale: Tensor | None,
) -> Tensor:
    blocks = _block_args(block_n, block_k)
    if _use_cublas(x, weight, blocks, activation_scale, out_dtype):
        with torch.cuda.device(x.device):
            return cublas_linear(x, weight, weight_scale_inv, out_dtype)
    return _launch(x, weight, weight_scale_inv, blocks, None, activation_scale, out_dtype)


@_fp8_linear_op.register_fake
def _(x, weight, weight_scale_inv, block_n, block_k, out_dtype, activation_scale):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("rbs_bench::fp8_linear_quantised", mutates_args=())
def _fp8_linear_quantised_op(
    a: Tensor,
    a_s: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> Tensor:
    blocks = _block_args(block_n, block_k)
    if _use_cublas(a, weight, blocks, None, out_dtype):
        with torch.cuda.device(a.device):
            return cublas_quantised(a, a_s, weight, weight_scale_inv, out_dtype)
    return _launch(a, weight, weight_scale_inv, blocks, out_dtype=out_dtype, quantized=(a, a_s))


@_fp8_linear_quantised_op.register_fake
def _(a, a_s, weight, weight_scale_inv, block_n, block_k, out_dtype):
    return a.new_empty(a.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("rbs_bench::fp8_grouped_linear", mutates_args=())
def _fp8_grouped_linear_op(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    offsets: Tensor,
    block_n: int,
    block_k: int,
) -> Tensor:
    blocks = _block_args(block_n, block_k)
    if _use_cublas_grouped(x, weight, blocks):
        with torch.cuda.device(x.device):
            return cublas_grouped_linear(x, weight, weight_scale_inv, offsets, x.dtype)
    return _launch(x, weight, weight_scale_inv, blocks, offsets)


@_fp8_grouped_linear_op.register_fake
def _(x, weight, weight_scale_inv, offsets, block_n, block_k):
    return x.new_empty(x.shape[0], weight.shape[1])


def _block_ints(block_size) -> tuple[int, int]:
    return (0, 0) if block_size is None else (int(block_size[0]), int(block_size[1]))


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size=(128, 128),
    activation_scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x [..., K] (bf16/fp16/fp32) @ the block-FP8 weight [N, K] -> [..., N] in `out_dtype`
    (x's dtype by default); Triton or, for the shapes it takes on Hopper, cuBLAS
    (`cublas_linear`), the values of `fp8_linear_ref`. block_size [bn, bk] of the
    scales [ceil(N / bn), ceil(K / bk)], or None for one per-tensor scale; activation_scale: a
    static per-tensor activation scale instead of dynamic per-group ones."""
    _check_linear(x, weight, weight_scale_inv)
    _blocks(weight, weight_scale_inv, block_size)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.rbs_bench.fp8_linear(
        x2,
        weight,
        weight_scale_inv,
        *_block_ints(block_size),
        out_dtype or x.dtype,
        activation_scale,
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_quantised(
    a: Tensor,
    a_s: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    block_size=(128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`fp8_linear` on activations quantised already (by their producer: `fp8_norm.rmsnorm_quant`,
    the attention kernel's epilogue): a e4m3 [M, K], a_s fp32 [ceil(K / bk), M] group-major, as
    `fp8_act_quant` writes them -> [M, N] in `out_dtype`; the values of
    `fp8_linear_quantised_ref`."""
    _check_linear(a.new_empty(0, a.shape[-1], dtype=out_dtype), weight, weight_scale_inv)
    _, _, group = _blocks(weight, weight_scale_inv, block_size)
    want = (math.ceil(a.shape[-1] / group), a.shape[0])
    if a.dtype != FP8_DTYPE or a.dim() != 2 or tuple(a_s.shape) != want:
        raise ValueError(
            f"quantised activations must be e4m3 [M, K] with fp32 scales {list(want)}; got "
            f"{a.dtype} {list(a.shape)} and {list(a_s.shape)}"
        )
    return torch.ops.rbs_bench.fp8_linear_quantised(
        a, a_s.float(), weight, weight_scale_inv, *_block_ints(block_size), out_dtype
    )


def fp8_grouped_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    offsets: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """x [S, K] with rows sorted by expert, offsets [E] (int32 cumulative row ends) -> [S, N] in
    x's dtype; Triton, the values of `fp8_grouped_linear_ref`. Rows past offsets[-1] are zeros.
    No host synchronisation: each program finds its expert from `offsets` on the device."""
    _check_grouped(x, weight, weight_scale_inv, offsets)
    _blocks(weight, weight_scale_inv, block_size)
    return torch.ops.rbs_bench.fp8_grouped_linear(
        x, weight, weight_scale_inv, offsets, *_block_ints(block_size)
    )


def sort_by_expert(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(permutation that sorts rows by expert, int32 cumulative row ends [E]) on the device; ids
    >= num_experts sort last and count for no expert."""
    ids = expert_ids.long()
    order = torch.sort(ids, stable=True).indices
    hits = (ids < num_experts) & (ids >= 0)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(hits, ids, num_experts), torch.ones_like(ids))
    return order, counts[:num_experts].cumsum(0).to(torch.int32)


def fp8_batched_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    expert_ids: Tensor,
    block_size=(128, 128),
) -> Tensor:
    """x [S, K], expert_ids [S] -> [S, N]: each row through its expert's weight; ids outside
    [0, E) give zeros. Sorts the rows by expert on the device, then `fp8_grouped_linear`."""
    _check_batched(x, weight, weight_scale_inv, expert_ids)
    order, offsets = sort_by_expert(expert_ids, weight.shape[0])
    y = fp8_grouped_linear(x[order], weight, weight_scale_inv, offsets, block_size)
    return torch.empty_like(y).index_copy_(0, order, y)


def main() -> None:
    """Quantise a random weight, run the reference (and the kernel where Triton can run)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k, m = 300, 384, 129
    w = torch.randn(n, k, device=device) * 0.05
    s = w.abs().reshape(3, 100, 3, 128).amax((1, 3)) / FP8_MAX  # blocks of 100 x 128
    wq = (w / s.repeat_interleave(100, 0).repeat_interleave(128, 1)).to(FP8_DTYPE)
    x = torch.randn(m, k, device=device, dtype=torch.float16)
    truth = x.double() @ dequantize_weight_ref(wq, s, (100, 128)).double().T
    ref = fp8_linear_ref(x, wq, s, (100, 128), out_dtype=torch.float32)
    rel = lambda y: float((y.double() - truth).norm() / truth.norm())  # noqa: E731
    print(f"M={m} N={n} K={k}, blocks 100x128: reference vs unquantised x: {rel(ref):.2e}")
    fp8_tc = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    if triton is not None and (fp8_tc or INTERPRET):
        got = fp8_linear(x, wq, s, (100, 128), out_dtype=torch.float32)
        print(f"kernel vs reference: {float((got - ref).norm() / ref.norm()):.2e} ({device})")


if __name__ == "__main__":
    main()
