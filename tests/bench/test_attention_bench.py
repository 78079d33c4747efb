"""The attention benchmark's CPU-side pieces: calibration to a density, FLOP count, plot, the
output-error references and the goal rows."""

import pandas as pd
import pytest
import torch
from rbs_bench.kernels.block_sparse_attn import block_sparse_attention_ref

from rbs_bench import synthetic
from rbs_bench.bench import attention
from rbs_bench.methods.selection import BlockSelection


def test_causal_flops_counts_the_triangle():
    assert attention.causal_flops(2, 1, 1) == 4 * 3
    assert attention.causal_flops(1024, 32, 128) == pytest.approx(4 * 32 * 128 * 1024 * 1025 / 2)


@pytest.mark.parametrize("name", ["rbs", "centroid"])
def test_calibrate_hits_a_reachable_target(name):
    data = synthetic.generate(seq_len=8192, seed=1)  # 64 blocks: forced ones are ~20%
    sel, density = attention.calibrate(name, data.q, data.k, target=0.4, tol=0.01)
    assert abs(density - 0.4) <= 0.01
    assert sel.select(data.q, data.k).density() == pytest.approx(density)


def test_calibrate_returns_the_closest_when_unreachable():
    data = synthetic.generate(seq_len=2048, seed=1)  # 16 blocks: forced blocks alone exceed 5%
    sel, density = attention.calibrate("rbs", data.q, data.k, target=0.05)
    forced_only = sel.with_knob(1e3).select(data.q, data.k).density()
    assert density == pytest.approx(forced_only, abs=1e-3)


def test_plot_from_rows(tmp_path):
    rows = []
    for n in (16384, 32768):
        rows.append(
            {
                "gpu": "X",
                "n": n,
                "method": "sdpa_fa2",
                "target": 1.0,
                "density": 1.0,
                "executor": "sdpa_fa2",
                "selector_ms": 0.0,
                "total_ms": 10.0,
            }
        )
        rows.append(
            {
                "gpu": "X",
                "n": n,
                "method": "rbs",
                "target": 0.05,
                "density": 0.05,
                "executor": "flex",
                "selector_ms": 0.1,
                "total_ms": 1.0,
                "speedup_vs_sdpa_fa2": 10.0,
            }
        )
    attention.plot(pd.DataFrame(rows), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_main_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: False)
    assert attention.main(["--lengths", "1024"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_csv_path_keeps_the_default_family_name(tmp_path):
    assert attention.csv_path(tmp_path, "attention", "synthetic", "gpu").name == "attention_gpu.csv"
    named = attention.csv_path(tmp_path, "methods_128k", "needles", "gpu").name
    assert named == "methods_128k_needles_gpu.csv"


def test_sample_blocks_are_seeded_distinct_and_in_range():
    a = attention.sample_blocks(1000, 128, 5, seed=1)
    assert a == attention.sample_blocks(1000, 128, 5, seed=1) and a == sorted(set(a))
    assert len(a) == 5 and all(0 <= i < 8 for i in a)
    assert attention.sample_blocks(300, 128, 24, seed=0) == [0, 1, 2]  # fewer blocks than asked


def _causal_truth(q, k, v):
    g = q.shape[1] // k.shape[1]
    kr, vr = (x.double().repeat_interleave(g, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q.double(), kr, vr, is_causal=True)


def test_dense_reference_rows_match_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 300, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    rows = attention._rows([0, 2], 128, 300, "cpu")
    assert rows.tolist() == list(range(128)) + list(range(256, 300))
    got = attention.dense_reference_rows(q, k, v, rows, chunk=50)
    truth = _causal_truth(q, k, v)[:, :, rows]
    g = q.shape[1] // k.shape[1]
    kr, vr = (x.repeat_interleave(g, 1) for x in (k, v))
    fp32 = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    torch_err = (fp32[:, :, rows].double() - truth).abs().max()  # PyTorch's own fp32 error
    assert (got.double() - truth).abs().max() <= 2 * torch_err


def test_sparse_references_cover_only_the_kept_blocks():
    torch.manual_seed(1)
    n, block = 512, 128
    q, k, v = (torch.randn(1, h, n, 32) for h in (4, 2, 2))
    mask = torch.rand(1, 4, 4, 4) < 0.5
    sel = BlockSelection.from_mask(mask | torch.eye(4, dtype=torch.bool), block, block, n)
    blocks = [1, 3]
    rows = attention._rows(blocks, block, n, "cpu")
    ref = attention.sparse_reference_rows(q, k, v, sel, blocks, rows)
    full = block_sparse_attention_ref(q, k, v, sel.kv_count, sel.kv_indices, block, block)
    torch.testing.assert_close(ref, full[:, :, rows])
    masked = attention.masked_sdpa_rows(q, k, v, sel, blocks)  # the same problem through SDPA
    torch.testing.assert_close(masked, ref, atol=1e-5, rtol=1e-5)
    dense = attention.DenseErrors(blocks, rows, {"err_dense_fa2": 0.0})  # shared as given
    out, shared = attention.sparse_references(q, k, v, sel, dense)
    torch.testing.assert_close(out, ref)
    assert shared["err_blocks"] == 2 and shared["err_dense_fa2"] == 0.0
    assert shared["err_masked_sdpa"] < 1e-5


def test_error_stats_are_max_abs_and_worst_row_relative():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])  # row norms 5, 0, 1
    out = ref + torch.tensor([[0.5, 0.0], [0.0, 0.25], [0.0, 0.2]])
    abs_err, rel = attention.error_stats(out, ref)
    assert abs_err == 0.5
    assert rel == pytest.approx(0.25)  # 0.5 / 5, the empty row's 0.25, 0.2 / 1


def test_goal_rows_name_what_is_met_and_missed():
    base = {"inputs": "synthetic", "method": "rbs", "target": 0.05, "executor": "triton"}
    rows = [
        {**base, "n": 131072, "density": 0.05, "selector_ms": 1.5, "attention_ms": 15.0,
         "total_ms": 16.5, "eff_tflops": 470.0, "pct_cudnn": 0.87, "selector_share": 0.09,
         "speedup_vs_sdpa_fa2": 26.0, "speedup_vs_sdpa_cudnn": 14.0},
        {**base, "n": 32768, "density": 0.06, "selector_ms": 0.5, "attention_ms": 1.8,
         "total_ms": 2.3, "eff_tflops": 300.0, "pct_cudnn": 0.48, "selector_share": 0.2,
         "speedup_vs_sdpa_fa2": 11.0, "speedup_vs_sdpa_cudnn": 6.0},
        {**base, "executor": "flex", "n": 131072, "density": 0.05, "selector_ms": 1.5,
         "attention_ms": 30.0, "total_ms": 31.5, "eff_tflops": 230.0, "pct_cudnn": 0.4,
         "selector_share": 0.05, "speedup_vs_sdpa_fa2": 13.0, "speedup_vs_sdpa_cudnn": 8.0},
    ]  # fmt: skip
    goals = attention.goal_rows(pd.DataFrame(rows)).set_index("n")
    assert list(goals.index) == [32768, 131072]  # the triton rows, by length
    long = goals.loc[131072]
    assert "sdpa_fa2=26/25" in long["met"] and "pct_cudnn=0.87/0.85" in long["met"]
    assert "selector_ms=1.5/2" in long["met"] and "selector_share=0.09/0.12" in long["met"]
    assert long["missed"] == "sdpa_cudnn=14/15"
    short = goals.loc[32768]  # below 64K only the TFLOP/s share is a goal
    assert short["missed"] == "pct_cudnn=0.48/0.75" and short["met"] == ""
