"""The Triton block-sparse kernel against dense SDPA with the block mask expanded to tokens.

CPU cases run the kernel under triton's interpreter. TRITON_INTERPRET is read when a kernel is
decorated, i.e. when `rbs_bench.kernels.block_sparse_attn` is first imported, and other test
modules import it (and Inductor's kernels read the variable too), so the interpreted runs happen
in worker subprocesses started with TRITON_INTERPRET=1: this file run as a script. The workers
only run the kernel and save its outputs; inputs, references and every assertion stay here.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import rbs_bench.kernels.block_sparse_attn as bsa  # noqa: E402
from rbs_bench.kernels.block_sparse_attn import (  # noqa: E402
    block_lists_from_mask,
    block_sparse_attention,
    block_sparse_attention_varlen_ref,
    expand_block_mask,
)
from rbs_bench.kernels.triton_util import kernel_arch  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One kernel run: lengths has one entry per batch row, or per sequence when varlen."""

    hq: int
    hkv: int
    lengths: tuple[int, ...]
    d: int
    dtype: torch.dtype = torch.float32
    density: str = "random"  # zero | random | full | empty-rows
    block_q: int = 64
    block_k: int = 64
    varlen: bool = False
    strided: bool = False  # q/k/v as [B, N, H, D] memory seen through a transpose
    scale: float | None = None
    seed: int = 0
    config: tuple = ()  # launch configuration items (a tuning choice) instead of the default
    out_bnhd: bool = False  # the kernel writes into [B, N, H, D] memory through `out`
    quant: bool = False  # also run with an e4m3 [B, N, H, D] output and its scales (D = 128)


F32, F16 = torch.float32, torch.float16
MERGED = (("BLOCK_N", 64), ("MERGE_DIAG", True))
TMA32 = (("BLOCK_N", 32), ("TMA", True))
CASES = {
    "N1-H2/2-D64-full": Case(2, 2, (1,), 64, density="full"),
    "N127-H4/1-D64": Case(4, 1, (127,), 64),
    "N128-H8/1-D128-fp16": Case(8, 1, (128,), 128, F16),
    "N129-B2-H4/4-D64": Case(4, 4, (129, 129), 64, seed=1),
    "N129-H4/2-D64-zero": Case(4, 2, (129,), 64, density="zero"),
    "N1000-H4/1-D64-strided-scale": Case(4, 1, (1000,), 64, strided=True, scale=0.3),
    "N1000-H2/1-D128-full-fp16": Case(2, 1, (1000,), 128, F16, density="full"),
    "N1000-H2/2-D64-fp16-bq64-bk128": Case(2, 2, (1000,), 64, F16, block_k=128),
    "N300-H2/1-D64-bq128-bk64": Case(2, 1, (300,), 64, block_q=128),
    "N600-H2/1-D64-bq256-bk64": Case(2, 1, (600,), 64, block_q=256, seed=2),
    "N100-H1/1-D16-empty-rows": Case(1, 1, (100,), 16, density="empty-rows"),
    "varlen-100,1,257-H4/2-D64": Case(4, 2, (100, 1, 257), 64, varlen=True, seed=3),
    "varlen-129,0,64-H8/1-D128-fp16": Case(8, 1, (129, 0, 64), 128, F16, varlen=True, seed=4),
    # the tuning space's other loops, program orders, key tiles and K/V loads on the shapes
    # where masked and unmasked tiles interleave (TMA descriptors read fp16/bf16 only)
    "merged-N127-H4/1-D64": Case(4, 1, (127,), 64, config=MERGED),
    "merged-N1000-H2/2-D64-fp16-bq64-bk128": Case(
        2, 2, (1000,), 64, F16, block_k=128, config=MERGED
    ),
    "merged-N600-H2/1-D64-bq256-bk64": Case(2, 1, (600,), 64, block_q=256, seed=2, config=MERGED),
    "merged-N100-H1/1-D16-empty-rows": Case(1, 1, (100,), 16, density="empty-rows", config=MERGED),
    "merged-varlen-100,1,257-H4/2-D64": Case(
        4, 2, (100, 1, 257), 64, varlen=True, seed=3, config=MERGED
    ),
    "tma-N1000-H8/1-D64-fp16-bk128": Case(8, 1, (1000,), 64, F16, block_k=128, config=TMA32),
    "tma-N129-B2-H4/2-D32-fp16-strided": Case(
        4, 2, (129, 129), 32, F16, strided=True, seed=5, config=TMA32
    ),
    "tma-merged-N600-H2/1-D64-fp16-bq256": Case(
        2, 1, (600,), 64, F16, block_q=256, seed=6, config=(*TMA32, ("MERGE_DIAG", True))
    ),
    "tma-varlen-129,0,64,300-H4/1-D64-fp16": Case(
        4, 1, (129, 0, 64, 300), 64, F16, varlen=True, seed=7, config=TMA32
    ),
    "tma-N100-H2/2-D16-fp16-empty-rows": Case(
        2, 2, (100,), 16, F16, density="empty-rows", config=(("TMA", True), ("BLOCK_N", 16))
    ),
    "order1-N1000-H8/2-D64-fp16-out": Case(
        8, 2, (1000,), 64, F16, seed=8, config=(*TMA32, ("ORDER", 1)), out_bnhd=True
    ),
    "order2-B2-N300-H4/2-D64-out": Case(
        4, 2, (300, 300), 64, seed=9, config=(("BLOCK_N", 32), ("ORDER", 2)), out_bnhd=True
    ),
    "order1-varlen-200,77-H4/4-D64-fp16": Case(
        4, 4, (200, 77), 64, F16, varlen=True, seed=10, config=(*TMA32, ("ORDER", 1))
    ),
    "bm32-N300-H4/2-D64-fp16-bq128-varlen": Case(
        4,
        2,
        (300, 1, 200),
        64,
        F16,
        block_q=128,
        varlen=True,
        seed=12,
        config=(*TMA32, ("BLOCK_M", 32), ("ORDER", 1)),
    ),
    "out-N129-H4/2-D64-fp16-strided": Case(
        4, 2, (129,), 64, F16, strided=True, seed=11, out_bnhd=True
    ),
    # the output quantised for a block-FP8 o projection (`out_scales`)
    "quant-B2-N129-H4/2-D128-fp16": Case(4, 2, (129, 129), 128, F16, seed=13, quant=True),
    "quant-varlen-100,1,257-H2/1-D128": Case(
        2, 1, (100, 1, 257), 128, varlen=True, seed=14, quant=True
    ),
    "quant-tma-merged-N300-H2/2-D128-fp16-empty-rows": Case(
        2,
        2,
        (100,),
        128,
        F16,
        density="empty-rows",
        config=(*TMA32, ("MERGE_DIAG", True)),
        quant=True,
    ),
}


def make_case(case: Case):
    """(q, k, v, per-row block masks, kv_count, kv_indices, cu_seqlens or None).

    The masks keep blocks above the diagonal too (the kernel must skip them) and the lists'
    padding is junk.
    """
    gen = torch.Generator().manual_seed(case.seed)
    rows, total = len(case.lengths), sum(case.lengths)
    b, n = (1, total) if case.varlen else (rows, case.lengths[0])
    if case.strided:  # [B, N, H, D] storage, as a model's projections give it
        q, k, v = (
            torch.randn(b, n, h, case.d, generator=gen) for h in (case.hq, case.hkv, case.hkv)
        )
        q, k, v = (x.to(case.dtype).transpose(1, 2) for x in (q, k, v))
    else:
        q, k, v = (
            torch.randn(b, h, n, case.d, generator=gen) for h in (case.hq, case.hkv, case.hkv)
        )
        q, k, v = (x.to(case.dtype) for x in (q, k, v))
    longest = max(case.lengths)
    mq, mk = math.ceil(longest / case.block_q), math.ceil(longest / case.block_k)
    if case.density == "zero":
        masks = torch.zeros(rows, case.hq, mq, mk, dtype=torch.bool)
    elif case.density == "full":
        masks = torch.ones(rows, case.hq, mq, mk, dtype=torch.bool)
    elif case.density == "empty-rows":  # query block 0 sees nothing; rows 64..99 see 64..row
        masks = torch.tensor([[False, True], [False, True]]).expand(rows, case.hq, 2, 2)
    else:
        masks = torch.rand(rows, case.hq, mq, mk, generator=gen) < 0.5
    count, indices = block_lists_from_mask(masks)
    junk = torch.randint(0, mk, indices.shape, generator=gen, dtype=torch.int32)
    indices = torch.where(torch.arange(mk) >= count[..., None], junk, indices)
    cu = None
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, masks, count, indices, cu


def run_kernel(case: Case):
    """(out, lse); with out_bnhd the output tensor is [B, N, H, D] memory seen as [B, H, N, D],
    poisoned first, and the returned out must be that very tensor."""
    q, k, v, _, count, indices, cu = make_case(case)
    lists = (count, indices, case.block_q, case.block_k)
    out = None
    if case.out_bnhd:
        b, h, n, d = q.shape
        out = torch.full((b, n, h, d), float("nan"), dtype=q.dtype).transpose(1, 2)
    if case.config:
        config = {"num_warps": 4, **dict(case.config)}
        res = bsa._launch(q, k, v, *lists, case.scale, True, cu, config, out=out)
    else:
        res = block_sparse_attention(
            q, k, v, *lists, scale=case.scale, return_lse=True, cu_seqlens=cu, out=out
        )
    if out is not None:
        assert res[0].data_ptr() == out.data_ptr() and res[0].stride() == out.stride()
    if not case.quant:
        return res
    b, h, n, d = q.shape
    q8 = torch.full((b, n, h, d), float("nan")).to(torch.float8_e4m3fn).transpose(1, 2)
    scales = torch.full((h, b * n), float("nan"))
    if case.config:
        bsa._launch(q, k, v, *lists, case.scale, False, cu, config, out=q8, out_scales=scales)
    else:
        block_sparse_attention(
            q, k, v, *lists, scale=case.scale, cu_seqlens=cu, out=q8, out_scales=scales
        )
    return (*res, q8, scales)


def dense_truth(case: Case, dtype: torch.dtype):
    """Dense SDPA in `dtype` per batch row / sequence on the expanded mask; (out, lse) packed.

    Rows that see no key are 0 / -inf. lse comes from float64 scores.
    """
    q, k, v, masks, *_ = make_case(case)
    scale = 1.0 / math.sqrt(case.d) if case.scale is None else case.scale
    outs, lses, start = [], [], 0
    for r, n in enumerate(case.lengths):
        bi, rows = (0, slice(start, start + n)) if case.varlen else (r, slice(None))
        qs, ks, vs = (x[bi : bi + 1, :, rows].to(dtype) for x in (q, k, v))
        token_mask = expand_block_mask(masks[r : r + 1], case.block_q, case.block_k, n)
        seen = token_mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=token_mask, scale=scale, enable_gqa=True
        )
        outs.append(torch.where(seen, out, torch.zeros_like(out)))
        k_rep = ks.double().repeat_interleave(case.hq // case.hkv, dim=1)  # test-side only
        scores = torch.einsum("bhtd,bhsd->bhts", qs.double(), k_rep) * scale
        lses.append(scores.masked_fill(~token_mask, float("-inf")).logsumexp(-1))
        start += n
    cat = 2 if case.varlen else 0
    return torch.cat(outs, cat), torch.cat(lses, cat)


def worker_main(out_path: str, case_ids: list[str]) -> None:
    """Run the kernel (interpreted) on each case; save {id: (out, lse) or error text}."""
    import traceback

    assert bsa._interpreted(), "worker must start with TRITON_INTERPRET=1"
    results = {}
    for cid in case_ids:
        try:
            results[cid] = run_kernel(CASES[cid])
        except Exception:  # reported by the test of that case
            results[cid] = traceback.format_exc()
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreted():
    """Kernel outputs of every CPU case, from two interpreter workers running in parallel."""
    cost = {cid: c.hq * sum(n * n for n in c.lengths) * c.d for cid, c in CASES.items()}
    groups: list[list[str]] = [[], []]
    for cid in sorted(cost, key=cost.get, reverse=True):  # greedy balance
        min(groups, key=lambda g: sum(cost[x] for x in g)).append(cid)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"worker{i}.pt") for i in range(len(groups))]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, path, *group],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for path, group in zip(paths, groups)
        ]
        for proc, path in zip(procs, paths):
            log, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                pytest.fail(f"interpreter worker failed:\n{log[-4000:]}")
            results.update(torch.load(path, weights_only=False))
    return results


@pytest.mark.parametrize("cid", list(CASES))
def test_kernel_matches_dense_interpreted(interpreted, cid):
    case = CASES[cid]
    result = interpreted[cid]
    assert not isinstance(result, str), result
    out, lse, *_ = result
    q = make_case(case)[0]
    assert out.shape == q.shape and out.dtype == case.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32

    truth, truth_lse = dense_truth(case, torch.float64)
    torch_out, _ = dense_truth(case, case.dtype)  # the same dtype through PyTorch
    err = (out.double() - truth).abs().max().item()
    torch_err = (torch_out.double() - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, (
        f"kernel err {err:.3e} vs torch {case.dtype} {torch_err:.3e}"
    )
    assert torch.equal(torch.isneginf(lse), torch.isneginf(truth_lse))
    seen = torch.isfinite(truth_lse)
    assert torch.equal(out[~seen].abs().sum(), torch.zeros((), dtype=out.dtype))
    atol = 1e-4 if case.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lse[seen].double(), truth_lse[seen], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("cid", [c for c in CASES if CASES[c].quant])
def test_quantised_output_is_the_output_quantised(interpreted, cid):
    """With `out_scales` the kernel writes the bytes and scales `fp8_act_quant` would write for
    its own output seen as the o projection's input [B * N, Hq * D]: one group per head."""
    from rbs_bench.kernels.fp8_gemm import act_quant_ref

    out, _, q8, scales = interpreted[cid]
    b, h, n, d = out.shape
    rows = out.transpose(1, 2).reshape(b * n, h * d)  # the o projection's input
    want_q, want_s = act_quant_ref(rows, d)
    assert torch.equal(q8.transpose(1, 2).reshape(b * n, h * d).view(torch.uint8),
                       want_q.view(torch.uint8))  # fmt: skip
    assert torch.equal(scales, want_s.t())


def test_quantised_output_rejects_what_it_cannot_write():
    """One line each: another head dim than 128, an output that is not e4m3, scales of another
    shape."""
    case = Case(2, 1, (64,), 64)
    q, k, v, _, count, indices, _ = make_case(case)
    lists = (count, indices, 64, 64)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="D = 128"):
        block_sparse_attention(q, k, v, *lists, out=torch.empty(q.shape, dtype=fp8),
                               out_scales=torch.empty(2, 64))  # fmt: skip
    q, k, v = (torch.randn(1, h, 64, 128) for h in (2, 1, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_sparse_attention(q, k, v, *lists, out=torch.empty_like(q),
                               out_scales=torch.empty(2, 64))  # fmt: skip
    with pytest.raises(ValueError, match="out_scales must be float32 \\[2, 64\\]"):
        block_sparse_attention(q, k, v, *lists, out=torch.empty(q.shape, dtype=fp8),
                               out_scales=torch.empty(64, 2))  # fmt: skip


def test_varlen_ref_matches_dense():
    case = CASES["varlen-100,1,257-H4/2-D64"]
    q, k, v, _, count, indices, cu = make_case(case)
    out, lse = block_sparse_attention_varlen_ref(q, k, v, count, indices, 64, 64, cu, None, True)
    truth, truth_lse = dense_truth(case, torch.float64)
    torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), truth_lse, atol=1e-5, rtol=1e-5)


def bad_inputs():
    q, k, v, _, count, indices, _ = make_case(Case(4, 2, (100,), 16))
    return dict(q=q, k=k, v=v, kv_count=count, kv_indices=indices, block_q=64, block_k=64)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "kv_count": a["kv_count"][..., :-1]}, "kv_count must be"),
        (lambda a: {**a, "block_q": 48, "kv_count": a["kv_count"][..., :-1]}, "kv_count must"),
        (lambda a: {**a, "k": a["k"].half(), "v": a["v"].half()}, "share one of"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 50, 90], dtype=torch.int32)}, "rise"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 100])}, "int32"),
    ],
)
def test_kernel_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        block_sparse_attention(**change(bad_inputs()))


def test_kernel_rejects_odd_blocks_and_dims():
    args = bad_inputs()
    count, indices = block_lists_from_mask(torch.ones(1, 4, 3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="powers of two"):
        block_sparse_attention(**{**args, "kv_count": count, "kv_indices": indices, "block_q": 48})
    q, k, v = (torch.randn(1, h, 100, 96) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(**{**args, "q": q, "k": k, "v": v})


def test_kernel_rejects_bad_out():
    args = bad_inputs()
    q = args["q"]
    with pytest.raises(ValueError, match="out must be"):
        block_sparse_attention(**args, out=torch.empty(q.shape[0], q.shape[1], 99, q.shape[3]))
    with pytest.raises(ValueError, match="out must be"):
        block_sparse_attention(**args, out=torch.empty_like(q, dtype=torch.float16))
    with pytest.raises(ValueError, match="must not overlap"):
        block_sparse_attention(**args, out=torch.empty(1, 1, 1, q.shape[3]).expand(q.shape))


@pytest.mark.skipif(bsa._interpreted(), reason="this process runs the interpreter")
def test_kernel_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        block_sparse_attention(**bad_inputs())


def test_missing_triton_is_one_line_error(monkeypatch):
    monkeypatch.setattr(bsa, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="needs triton"):
        block_sparse_attention(**bad_inputs())


# ------------------------------------------------------------------------------- GPU (bf16)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_selection(b, h, n, bq, bk, p, seed, device):
    gen = torch.Generator().manual_seed(seed)
    mq, mk = math.ceil(n / bq), math.ceil(n / bk)
    mask = torch.rand(b, h, mq, mk, generator=gen) < p
    count, indices = block_lists_from_mask(mask)
    junk = torch.randint(0, mk, indices.shape, generator=gen, dtype=torch.int32)
    indices = torch.where(torch.arange(mk) >= count[..., None], junk, indices)
    return mask.to(device), count.to(device), indices.to(device)


def dense_masked_gpu(q, k, v, token_mask, dtype):
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).to(dtype) for x in (k, v))  # test-side only
    out = F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=token_mask)
    return torch.where(token_mask.any(-1, keepdim=True), out, torch.zeros_like(out)).float()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(  # p 0.6 at Mk 256: lists longer than the kernel's first id chunk
    "n, d, bq, bk, p",
    [
        (4096, 64, 128, 128, 0.3),
        (4096, 128, 64, 64, 0.3),
        (16384, 128, 128, 128, 0.3),
        (16384, 64, 128, 64, 0.6),
    ],
)
def test_kernel_matches_dense_bf16_gpu(n, d, bq, bk, p):
    hq, hkv = 8, 1  # GQA group 8
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = (
        torch.randn(1, h, n, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv)
    )
    mask, count, indices = random_selection(1, hq, n, bq, bk, p, n, "cuda")
    token_mask = expand_block_mask(mask, bq, bk, n)
    truth = dense_masked_gpu(q, k, v, token_mask, torch.float32)
    out, lse = block_sparse_attention(q, k, v, count, indices, bq, bk, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.float() - truth).abs().max().item()
    torch_err = (dense_masked_gpu(q, k, v, token_mask, torch.bfloat16) - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel err {err:.3e} vs torch bf16 err {torch_err:.3e}"
    if n <= 4096:
        k_rep = k.float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k_rep) / math.sqrt(d)
        expected = scores.masked_fill(~token_mask, float("-inf")).logsumexp(-1)
        seen = torch.isfinite(expected)
        assert torch.equal(seen, torch.isfinite(lse))
        torch.testing.assert_close(lse[seen], expected[seen], atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="e4m3 needs capability 8.9 or newer",
)
def test_quantised_output_bf16_gpu():
    """bf16 at 16K tokens, each tuned configuration's choice, written into a model's [B, N, H, D]
    memory: the quantised output is `fp8_act_quant` of the kernel's bf16 output, bit for bit."""
    from rbs_bench.kernels.fp8_gemm import fp8_act_quant

    n, hq, hkv, d, block = 16384, 8, 2, 128, 128
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(1, h, n, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv)
    )
    _, count, indices = random_selection(1, hq, n, block, block, 0.2, 7, "cuda")
    lists = (count, indices, block, block)
    out = block_sparse_attention(q, k, v, *lists)
    q8 = torch.empty(1, n, hq, d, device="cuda", dtype=torch.float8_e4m3fn).transpose(1, 2)
    scales = torch.empty(hq, n, device="cuda")
    block_sparse_attention(q, k, v, *lists, out=q8, out_scales=scales)
    want_q, want_s = fp8_act_quant(out.transpose(1, 2).reshape(n, hq * d), d)
    assert torch.equal(scales, want_s)
    assert torch.equal(q8.transpose(1, 2).reshape(n, hq * d).view(torch.uint8),
                       want_q.view(torch.uint8))  # fmt: skip


def _as_config(entry) -> dict:
    bn, warps, stages, maxnreg, merge, tma, order, bm = entry
    return dict(
        BLOCK_N=bn, num_warps=warps, num_stages=stages, maxnreg=maxnreg, MERGE_DIAG=merge,
        TMA=tma, ORDER=order, BLOCK_M=bm,
    )  # fmt: skip


# Every configuration either tuning space may pick, and the Hopper neighbours the variants bench
# times; with RBS_KERNEL_ARCH=sm80 (or on a GPU before Hopper) the pointer-only ones.
SPACE = sorted(
    (
        set(bsa.HOPPER_SPACE)
        | set(bsa.SM80_SPACE)
        | {
            (32, 8, s, 128, m, True, o, 128)
            for s in (3, 4)
            for m in (False, True)
            for o in (0, 1, 2)
        }
        | {(64, 4, s, None, False, True, 0, 64) for s in (2, 3)}
    )
    if kernel_arch() >= 90
    else set(bsa.SM80_SPACE),
    key=str,
)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("entry", SPACE, ids=lambda e: "-".join(map(str, e)))
def test_every_config_matches_dense_bf16_gpu(entry):
    """Each configuration the tuner may pick, on [B, N, H, D] memory read and written through
    strides, at a length that ends mid-block (1936 = 15 blocks + 16 tokens; with 16 / 2 heads
    every integer argument has the divisibility of the benchmark's, so the kernels compiled
    here are the ones it runs)."""
    hq, hkv, n, d, block = 16, 2, 1936, 128, 128
    gen = torch.Generator().manual_seed(21)
    q, k, v = (
        torch.randn(1, n, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
        for h in (hq, hkv, hkv)
    )
    mask, count, indices = random_selection(1, hq, n, block, block, 0.3, 21, "cuda")
    token_mask = expand_block_mask(mask, block, block, n)
    truth = dense_masked_gpu(q, k, v, token_mask, torch.float32)
    out = torch.full((1, n, hq, d), float("nan"), device="cuda", dtype=q.dtype).transpose(1, 2)
    lists = (count, indices, block, block)
    bsa._launch(q, k, v, *lists, None, False, None, _as_config(entry), out=out)
    err = (out.float() - truth).abs().max().item()
    torch_err = (dense_masked_gpu(q, k, v, token_mask, torch.bfloat16) - truth).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel err {err:.3e} vs torch bf16 err {torch_err:.3e}"


@pytest.mark.gpu
@needs_gpu
def test_kernel_varlen_bf16_gpu():
    hq, hkv, d, block = 8, 2, 128, 128
    lengths = [3000, 1, 5000, 129]
    mq = math.ceil(max(lengths) / block)
    gen = torch.Generator().manual_seed(7)
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, h, total, d, generator=gen).to("cuda", torch.bfloat16)
        for h in (hq, hkv, hkv)
    )
    mask, count, indices = random_selection(
        len(lengths), hq, mq * block, block, block, 0.3, 7, "cuda"
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = block_sparse_attention(q, k, v, count, indices, block, block, cu_seqlens=cu.cuda())
    start = 0
    for s, n in enumerate(lengths):
        rows = slice(start, start + n)
        m = math.ceil(n / block)
        token_mask = expand_block_mask(mask[s : s + 1, :, :m, :m], block, block, n)
        qs, ks, vs = (x[:, :, rows] for x in (q, k, v))
        truth = dense_masked_gpu(qs, ks, vs, token_mask, torch.float32)
        torch_err = (dense_masked_gpu(qs, ks, vs, token_mask, torch.bfloat16) - truth).abs().max()
        err = (out[:, :, rows].float() - truth).abs().max()
        assert err <= 2 * torch_err + 1e-5, f"sequence {s}: err {err:.3e} vs torch {torch_err:.3e}"
        start += n


def test_prompts_of_nearby_lengths_share_one_tuning():
    """Video-MME prompts of 12,058-12,087 tokens (one per video class), RULER's 130,877 and
    130,883: one tuning each, not one per prompt; a power of two is its own bucket."""
    assert {bsa._len_bucket(n) for n in (12058, 12075, 12087)} == {16384}
    assert bsa._len_bucket(130877) == bsa._len_bucket(130883) == bsa._len_bucket(131072) == 131072
    assert bsa._len_bucket(131073) == 262144
    assert bsa._len_bucket(1) == bsa._len_bucket(1000) == 1024


@pytest.mark.gpu
@needs_gpu
def test_a_new_length_in_a_tuned_bucket_does_not_tune_again(monkeypatch):
    monkeypatch.setenv("RBS_BENCH_AUTOTUNE", "full")  # the tuner over the whole space
    hq, hkv, d, block = 4, 1, 128, 128
    space = bsa.tuning_space(torch.device("cuda"))
    sizes = []
    for n in (3000, 3500, 4000):  # one bucket (4096)
        gen = torch.Generator().manual_seed(n)
        q, k, v = (
            torch.randn(1, h, n, d, generator=gen).to("cuda", torch.bfloat16)
            for h in (hq, hkv, hkv)
        )
        _, count, indices = random_selection(1, hq, n, block, block, 0.3, n, "cuda")
        bsa._launch(q, k, v, count, indices, block, block, None, False, None, space=space)
        usable = tuple(c for c in space if bsa._tma_ok(k, v) or not c[5]) or bsa.POINTER_SPACE
        sizes.append(len(bsa._tuned_kernel(block, block, usable).cache))
    assert sizes[1:] == sizes[:1] * 2, f"tuning results after each length: {sizes}"


if __name__ == "__main__":  # interpreter worker: python this_file OUT_PATH CASE_ID...
    worker_main(sys.argv[1], sys.argv[2:])
