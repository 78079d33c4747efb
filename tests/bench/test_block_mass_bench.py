"""The block-mass benchmark's CPU-side pieces: the computation in a chosen precision, and the check
with its tolerance taken from the low-precision computation's own error."""

import pytest
import torch
from rbs_bench.kernels.block_mass import block_mass_ref, kept_block_mass_ref

from rbs_bench.bench import block_mass as bench


def test_mass_in_fp64_and_fp32_is_the_reference():
    q, k = bench.inputs(300, 4, 2, 16, seed=1, dtype=torch.float32)
    want = block_mass_ref(q, k, 64)
    torch.testing.assert_close(bench.mass_in(q, k, 64, torch.float32, chunk=100), want)
    exact = bench.mass_in(q, k, 64, torch.float64, chunk=64)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact.float(), want, atol=1e-4, rtol=1e-5)


def test_low_precision_mass_errs_more_than_fp32():
    q, k = bench.inputs(257, 4, 1, 32, seed=2, dtype=torch.bfloat16)
    ref = block_mass_ref(q, k, 32)
    lowp = bench.mass_in(q, k, 32, torch.bfloat16)
    assert lowp.dtype == torch.float32
    err_lowp = (lowp - ref).abs().max()
    exact = bench.mass_in(q, k, 32, torch.float64)
    assert (ref.double() - exact).abs().max() < err_lowp / 10
    torch.testing.assert_close(lowp.sum(-1), ref.sum(-1), atol=0.5, rtol=0.02)


@pytest.mark.parametrize("n,block,hq,hkv", [(200, 64, 4, 2), (100, 24, 2, 1)])
def test_check_case_passes_the_reference_and_fails_a_wrong_kernel(n, block, hq, hkv):
    q, k = bench.inputs(n, hq, hkv, 16, seed=0, dtype=torch.float16)
    row = bench.check_case(q, k, block, kernel=block_mass_ref, kept_kernel=kept_block_mass_ref)
    assert row["check"] == "ok" and row["err_kernel"] == 0 and row["err_kept"] < 1e-5
    assert 0 < row["err_lowp"] and row["tol"] > row["err_lowp"]
    assert row["err_ref_fp64"] < 1e-4

    def off(q, k, block):  # one block pair's mass moved to its neighbour: rows still sum right
        mass = block_mass_ref(q, k, block)
        mass[..., 1, 0] += 0.5
        mass[..., 1, 1] -= 0.5
        return mass

    assert bench.check_case(q, k, block, off, kept_block_mass_ref)["check"] == "FAIL"

    def kept_off(q, k, count, index, block):
        return kept_block_mass_ref(q, k, count, index, block) * 1.01

    assert bench.check_case(q, k, block, block_mass_ref, kept_off)["check"] == "FAIL"


def test_check_rows_skip_done_cases(monkeypatch):
    monkeypatch.setattr(bench, "CASES", [(130, 64, 2, 1, 16, (0, 1))])
    monkeypatch.setattr(bench, "block_mass", block_mass_ref)
    monkeypatch.setattr(bench.check_case, "__defaults__", (block_mass_ref, kept_block_mass_ref, 0))
    done = {"check_n130_b64_h2x1_d16_bf16_s0"}
    rows = list(bench.check_rows(done, device="cpu"))
    assert [r["case"] for r in rows] == [
        "check_n130_b64_h2x1_d16_bf16_s1",
        "check_n130_b64_h2x1_d16_fp16_s0",
        "check_n130_b64_h2x1_d16_fp16_s1",
    ]
    assert all(r["check"] == "ok" for r in rows)
