"""The observations analysis: quintile bookkeeping on hand-built cases, coverage and the oracle,
the token-pattern mass, the probe inside a model, and a small run end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from rbs_bench.baselines.minference import MInference, pattern_mass
from rbs_bench.kernels.block_mass import block_mass_ref, causal_softmax_chunks

from rbs_bench import config, observations, synthetic
from rbs_bench.config import ObservationsCfg

config.register_schemas()


def settings(**kw):
    return observations.settings_from(OmegaConf.structured(ObservationsCfg(**kw)))


# ------------------------------------------------------------------ quintile bookkeeping by hand

# One head, six key blocks. Radius ranks: b1 < b3 < b2 < b5 < b0 < b4, quintile = 5 rank // 6.
RADIUS = torch.tensor([[5.0, 1.0, 3.0, 2.0, 6.0, 4.0]])
QUINT = [3, 0, 1, 0, 4, 2]
# True mass of each candidate j < i; the largest of row i is block i - 1 (k_i = 1 at 5%).
MASS = torch.tensor(
    [
        [1.0, 0, 0, 0, 0, 0],
        [1.0, 1, 0, 0, 0, 0],
        [0.2, 0.9, 1, 0, 0, 0],
        [0.1, 0.3, 2.0, 1, 0, 0],
        [0.5, 0.1, 0.2, 3.0, 1, 0],
        [0.1, 0.2, 0.3, 0.4, 5.0, 1],
    ]
)[None]
# A scorer: row 2 prefers block 0 (its true top, block 1, is ranked outside); row 3 ties every
# candidate (ties count in the block's favour: inside); row 5 prefers block 0 (block 4 outside).
SCORES = torch.tensor(
    [
        [0.0, 0, 0, 0, 0, 0],
        [0.0, 0, 0, 0, 0, 0],
        [1.0, 0, 0, 0, 0, 0],
        [0.0, 0, 0, 0, 0, 0],
        [0.0, 0, 0, 5, 0, 0],
        [9.0, 0, 0, 0, 1, 0],
    ]
)[None]


def test_radius_quintiles_by_rank():
    assert observations.radius_quintiles(RADIUS).tolist() == [QUINT]
    ties = observations.radius_quintiles(torch.ones(1, 5))
    assert ties.tolist() == [[0, 1, 2, 3, 4]]  # equal radii: the lower id ranks first
    seven = observations.radius_quintiles(torch.arange(7.0)[None])
    assert seven.tolist() == [[0, 0, 1, 2, 2, 3, 4]]


def test_top_counts():
    assert observations.top_counts(6, 0.05).tolist() == [0, 1, 1, 1, 1, 1]
    assert observations.top_counts(6, 0.5).tolist() == [0, 1, 1, 2, 2, 3]
    assert observations.top_counts(41, 0.05)[40] == 2  # 0.05 * 40 = 2 exactly, not 3


def test_quintile_bookkeeping_hand_built():
    quint = observations.radius_quintiles(RADIUS)
    top = observations.true_top(MASS, 0.05)
    assert [row.nonzero().flatten().tolist() for row in top[0]] == [[], [0], [1], [2], [3], [4]]
    outside = observations.ranked_outside(SCORES, 0.05)
    # true top blocks per quintile: Q1 {b1, b3}, Q2 {b2}, Q3 none, Q4 {b0}, Q5 {b4}
    assert observations.quintile_counts(top, quint).tolist() == [2, 1, 0, 1, 1]
    assert observations.quintile_counts(top & outside, quint).tolist() == [1, 0, 0, 0, 1]
    cand = observations.candidate_mask(6).expand_as(top)
    # candidate pairs: block j is a candidate of the 5 - j rows after it
    assert observations.quintile_counts(cand, quint).tolist() == [6, 3, 0, 5, 1]


def hand_record(layer: int) -> dict:
    grid = observations.ORACLE_GRID
    return {
        "layers": [layer],
        "curves": {"centroid": {"knob": [0.1], "density": [0.5], "coverage": [0.8]}},
        "oracle": np.interp(grid, [0, 1], [0, 1]).tolist(),
        "top": [[2, 1, 0, 1, 1]],
        "candidates": [[6, 3, 0, 5, 1]],
        "under": {s: [[1, 0, 0, 0, 1]] for s in observations.SCORERS},
        "radius_sum": [[3.0, 3, 4, 5, 6]],
        "beta_sum": [[0.0, 0, 0, 0.5, 1]],
        "blocks": [[2, 1, 1, 1, 1]],
    }


def test_aggregate_pools_counts_and_keeps_layers():
    cov, under, share = observations.aggregate([hand_record(0), hand_record(1)])
    u = under[(under["layer"] == "all") & (under["scorer"] == "centroid")]
    assert u["top_blocks"].tolist() == [4, 2, 0, 2, 2]
    assert u["underestimated"].tolist() == [2, 0, 0, 0, 2]
    assert u["share"].iloc[[0, 1, 3, 4]].tolist() == [0.5, 0.0, 0.0, 1.0]
    assert np.isnan(u["share"].iloc[2])  # no true top block in Q3: undefined, not 0
    s = share[share["layer"] == "all"]
    assert s["share"].tolist() == pytest.approx([0.4, 0.2, 0.0, 0.2, 0.2])
    assert s["candidate_share"].tolist() == pytest.approx([6 / 15, 3 / 15, 0, 5 / 15, 1 / 15])
    assert s["radius_mean"].tolist() == pytest.approx([1.5, 3, 4, 5, 6])
    assert set(share["layer"]) == {"all", "0", "1"}
    assert cov[cov["method"] == "centroid"][["density", "coverage"]].values.tolist() == [[0.5, 0.8]]


# ---------------------------------------------------------------------- coverage and the oracle


def test_oracle_keeps_pairs_by_mass():
    mass = torch.tensor([[2.0, 0.0], [1.0, 1.0]])  # 4 tokens, blocks of 2: 3 causal pairs
    grid = np.array([0, 1 / 3, 2 / 3, 1])
    assert observations.oracle_curve([mass], [4], grid) == pytest.approx([0, 0.5, 0.75, 1.0])


def test_pooled_oracle_merges_segments_by_slope():
    grid = np.linspace(0, 1, 5)
    a, b = grid.copy(), np.array([0, 0.45, 0.9, 0.95, 1.0])
    assert observations.pool_curves([a, b], grid) == pytest.approx([0, 0.45, 0.7, 0.95, 1.0])
    assert observations.pool_curves([b, b], grid) == pytest.approx(b)


def test_pattern_mass_matches_token_mask():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 200, 16, generator=g) * 2, torch.randn(1, 2, 200, 16, generator=g)
    base = MInference(vertical_size=40, slash_size=60, last_q=16, sink_tokens=3, local_diagonals=5)
    pats = [base.with_knob(r).select(q, k) for r in (0.1, 0.5, 5.0)]
    probs = torch.cat([p for _, _, p in causal_softmax_chunks(q, k, chunk=64)], 2)
    for pat, got in zip(pats, pattern_mass(q, k, None, pats, chunk=48)):
        torch.testing.assert_close(got, (probs * pat.token_mask()).sum((-1, -2)))


def test_analyse_coverage_below_the_oracle():
    data = synthetic.generate(1, 2, 1, 1536, 32, seed=1)
    st = settings(block_size=64, knob_points=4, methods=["dense", "centroid", "rbs", "quest"])
    q, k = observations.head_view(data.q, data.k, None)
    res = observations.analyse(q, k, None, st)
    assert res.coverage["dense"][1:] == [[1.0], [pytest.approx(1.0)]]
    grid = observations.ORACLE_GRID
    oracle = observations.oracle_curve(res.masses, [res.rows] * len(res.masses), grid)
    for name in ("centroid", "rbs", "quest"):
        _, dens, cov = res.coverage[name]
        assert all(c <= np.interp(d, grid, oracle) + 1e-6 for d, c in zip(dens, cov)), name
    assert all((res.under[s] <= res.top).all() for s in observations.SCORERS)
    assert res.blocks.sum() == 2 * 24  # two heads x 24 key blocks


# ------------------------------------------------------------------------- the probe in a model


def test_probe_analyses_chosen_layers_and_keeps_the_layer_dense():
    from transformers import Qwen3ForCausalLM

    from rbs_bench.models.hf_attention import attention_modules, install, uninstall
    from rbs_bench.models.tiny import tiny_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(num_hidden_layers=3, hidden_size=64)).eval()
    ids = torch.randint(0, 256, (1, 256))
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits
    st = settings(block_size=64, knob_points=2, methods=["centroid"], layers=[1, 2], heads=[0, 3])
    probe = observations.ObservationProbe(st, [m.layer_idx for m in attention_modules(model)])
    install(model, probe, "reference")
    try:
        probe.begin_prompt()
        with torch.inference_mode():
            got = model(input_ids=ids, use_cache=False).logits
    finally:
        uninstall(model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert sorted(probe.results) == [1, 2]
    res = probe.results[1]
    assert len(res.masses) == 2 and res.masses[0].shape == (4, 4)
    torch.testing.assert_close(res.masses[0].sum(-1), torch.full((4,), 64.0))


# ------------------------------------------------------------------------------- end to end


def compose_cfg(tmp_path, *overrides):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=observations",
                f"results_dir={tmp_path}",
                "device=cpu",
                *overrides,
            ],
        )
    config.validate(cfg)
    return cfg


def test_synthetic_run_writes_panels_and_resumes(tmp_path):
    cfg = compose_cfg(
        tmp_path,
        "observations.synthetic=true",
        "observations.context_length=1536",  # 12 needle blocks of 128
        "observations.prompts=2",
        "observations.block_size=128",
        "observations.knob_points=2",
        "observations.methods=[centroid,rbs,quest]",
        "observations.generator.q_heads=2",
        "observations.generator.kv_heads=1",
        "observations.generator.head_dim=16",
    )
    out = observations.run(cfg, "observations")
    assert out == tmp_path / "runs" / "observations" / "synthetic"
    for name in ("coverage.csv", "rank_underestimation.csv", "top_share.csv", "observations.png"):
        assert (out / name).stat().st_size > 0
    cov = pd.read_csv(out / "coverage.csv")
    assert set(cov["method"]) == {"centroid", "rbs", "quest", "oracle"}
    assert cov["coverage"].between(0, 1 + 1e-6).all()
    share = pd.read_csv(out / "top_share.csv", dtype={"layer": str})
    assert share["share"].sum() == pytest.approx(1.0)
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 2
    observations.run(cfg, "observations")  # every prompt recorded: nothing is recomputed
    assert (out / "records.jsonl").read_text().splitlines() == lines
    assert json.loads((out / "observations.json").read_text())["prompts"] == 2
    assert observations.main([str(out)]) == 0


def test_bad_settings_fail_with_one_line(tmp_path):
    with pytest.raises(config.UserError, match="observations.methods: unknown method 'nosuch'"):
        settings(methods=["nosuch"])
    cfg = compose_cfg(tmp_path, "observations.synthetic=true", "+observations.structure.x=1")
    with pytest.raises(config.UserError, match="observations.structure"):
        observations.run(cfg, "observations")
    assert not list(tmp_path.rglob("cell.json"))  # nothing claimed: a corrected run starts clean


def test_block_mass_reference_used_on_cpu():
    q, k = torch.randn(1, 2, 130, 16), torch.randn(1, 1, 130, 16)
    torch.testing.assert_close(
        observations.true_block_mass(q, k, 32, None), block_mass_ref(q, k, 32)
    )
