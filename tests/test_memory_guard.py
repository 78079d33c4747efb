"""A prefill holds no more than one layer's activations beyond the model's own KV cache.

At 128K tokens the full logits of Qwen3's 151936-token vocabulary take 40 GB in bf16, and every
layer's queries 48 GB for a 48-layer model: either alone stops the paper's setting on one GPU.
Here the same waste is made measurable on a CPU: a deep, narrow model with a large vocabulary at
2048 tokens, where the full logits (1 GiB) and all layers' Q/K (160 MiB, twice with a
concatenation) dwarf what one layer needs. The runner's prefill (with its KV cache), a
calibration step and the TTFT benchmark's calibration must each stay under a bound that those
would exceed. Allocations are read from torch's CPU memory profiler (`bench.ttft.cpu_peak_bytes`):
only what the call itself allocates counts, not the weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rbs_bench import calibrate, methods, session
from rbs_bench.bench import ttft_calibrate, ttft_measure, ttft_model, ttft_setup
from rbs_bench.config import TimingCfg
from rbs_bench.models import generate, tiny

MiB = 2**20
N = 2048
SHAPE = dict(
    vocab_size=131072,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)
LAYER_QK = N * (SHAPE["num_attention_heads"] + SHAPE["num_key_value_heads"]) * 64 * 4  # 10 MiB
KV_CACHE = SHAPE["num_hidden_layers"] * 2 * N * SHAPE["num_key_value_heads"] * 64 * 4  # 64 MiB
# One layer's working set, generously: its Q/K/V, the reference executor's gathered keys, values
# and scores of a query block, the selector's block scores. What the bounds keep out: the full
# logits, N x vocab x 4 bytes = 1 GiB, and every layer's Q/K, 16 x 10 MiB, twice with a
# concatenation (the measured peaks with them: over 1 GiB, 1 GiB and 320 MiB).
LAYER = 128 * MiB


@pytest.fixture(scope="module")
def model():
    return tiny.build_model(tiny.tiny_config(**SHAPE))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_runner_prefill_keeps_the_last_logits_only(model, ids):
    _, peak = ttft_measure.cpu_peak_bytes(lambda: generate.greedy_generate(model, ids, 2, set()))
    assert peak < KV_CACHE + LAYER, f"{peak / MiB:.0f} MiB"


@pytest.mark.slow
def test_a_calibration_step_keeps_the_last_logits_only(model, ids):
    loaded = session.Loaded(model, None, torch.device("cpu"), {})
    base = methods.build("rbs", impl="torch")
    values = np.geomspace(0.1, 5.0, 33).tolist()
    (dens, curves), peak = ttft_measure.cpu_peak_bytes(
        lambda: calibrate.probe(loaded, [ids], base, 1.0, values, "reference")
    )
    assert 0 < dens[0] < 1 and curves.shape == (1, len(values))
    assert peak < LAYER, f"{peak / MiB:.0f} MiB"


@pytest.mark.slow
def test_ttft_calibration_scores_one_layer_at_a_time(tmp_path):
    layers = SHAPE["num_hidden_layers"]
    cfg = TimingCfg(layers=layers, contexts=[N], methods=["rbs", "xattn"], target=0.6)
    s = ttft_setup.resolve(cfg, device="cpu", out=tmp_path, progress=False)
    lm = ttft_model.build_model(
        s, overrides={k: v for k, v in SHAPE.items() if k != "num_hidden_layers"}
    )
    prompt = ttft_model.prompts(s, N, 256)[:1]
    got, peak = ttft_measure.cpu_peak_bytes(
        # no workspace measure: it profiles memory itself, and profilers do not nest
        lambda: ttft_calibrate.calibrate_methods(s, lm, prompt, ["rbs", "xattn"], set())
    )
    assert set(got) == {"rbs", "xattn"}
    assert peak < LAYER, f"{peak / MiB:.0f} MiB"
