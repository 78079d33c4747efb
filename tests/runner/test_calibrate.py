"""Calibration finds the knob for a target density, stores it, and runs read it back."""

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from rbs_bench import budget, calibrate, calibrations, config, methods
from rbs_bench.config import UserError
from rbs_bench.runner import run_cell
from rbs_bench.session import Session, build_selector

config.register_schemas()


def _cfg(tmp_path, *extra):
    overrides = [
        "method=rbs",
        "method.block_size=32",  # 2K tokens -> 64 blocks, so the forced floor is low
        "budget=d10",
        "budget.target=0.45",
        "benchmark.context_lengths=[2048]",
        "benchmark.num_samples=2",
        "benchmark.max_new_tokens=4",
        "calibration.num_prompts=2",
        "calibration.tolerance=0.002",
        "progress=false",
        f"results_dir={tmp_path}",
        *extra,
    ]
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.slow
def test_calibrated_knob_reproduces_its_density_in_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path)
    with pytest.raises(UserError, match=r"python -m rbs_bench.calibrate .*method=rbs"):
        build_selector(cfg)  # nothing calibrated yet: the message names the command
    session = Session()
    entry = calibrate.calibrate_cell(cfg, session)
    assert entry["abs_error"] <= 0.002
    stored = yaml.safe_load((tmp_path / "calibration/tiny/rbs.yaml").read_text())
    assert stored["entries"][0]["knob"] == entry["knob"]
    sel = build_selector(cfg)
    assert sel.alpha_base == pytest.approx(0.22 * entry["knob"])
    # the run's prompts are the calibration prompts here: it measures the same density
    records = run_cell(cfg, "calib_test", session)
    dens = [yaml.safe_load(line)["density"] for line in records.read_text().splitlines()]
    assert abs(sum(dens) / len(dens) - 0.45) <= 0.002


@pytest.mark.slow
def test_unreachable_target_names_the_range(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, "budget.target=0.01")
    with pytest.raises(
        UserError, match=r"cannot reach density 0.0100.*spans densities 0\.\d+-[01]\.\d+"
    ):
        calibrate.calibrate_cell(cfg, Session())


def test_knob_grid_follows_the_knob_kind():
    from rbs_bench import methods

    geo = budget.knob_grid(methods.build("rbs"), 1e-2, 1e2, 5)
    assert geo == pytest.approx([1e-2, 1e-1, 1, 10, 100])
    lin = budget.knob_grid(methods.build("quest"), 0.0, 1.0, 5)
    assert lin == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_budget_with_knob_and_target_is_refused(tmp_path):
    with pytest.raises(UserError, match="sets both knob and target"):
        build_selector(_cfg(tmp_path, "budget.knob=0.5"))


# --- density curves, the search's pieces, stored calibrations ---------------------------------


def _qk(n: int, hq: int = 4, hkv: int = 2, d: int = 64, seed: int = 0):
    """q, k with structure (a recency bias, sinks, a few dispersed key blocks), so that the
    selection varies over the knob range."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * torch.logspace(-3, -1, d // 4)[None]
    rope = torch.cat([pos.cos(), pos.sin()], -1) * 2.0  # [n, d/2]
    q[..., : d // 2] += rope
    k[..., : d // 2] += rope
    k[..., :16, d // 2] += 6.0
    q[..., d // 2] += 1.0
    k[:, :, n // 3 : n // 3 + 40] *= 3.0  # a dispersed stretch of keys
    return q, k


@pytest.mark.parametrize(
    "name, n, block",
    [("rbs", 1000, 64), ("rbs", 1025, 32), ("full_l2", 1025, 32), ("centroid", 1000, 64)]
    + [("flashprefill", 1025, 32)],
)
def test_threshold_curve_is_the_selection_density_at_every_knob(name, n, block):
    from rbs_bench import methods

    q, k = _qk(n)
    sel = methods.build(name, block_size=block)
    values = budget.knob_grid(sel, 1e-3, budget.knob_range(sel)[1], 11)
    curve = sel.density_curve(q, k, None, values)
    direct = [sel.with_knob(v).select(q, k).density() for v in values]
    pairs = q.shape[1] * sel.with_knob(1.0).select(q, k).causal_pairs()
    assert len(set(direct)) > 1  # the knob moves the selection here
    # equal up to a block pair whose score sits at the threshold within rounding
    assert max(abs(a - b) for a, b in zip(curve, direct)) * pairs <= 1 + 1e-9


def test_rbs_scale_has_no_step_where_alpha_base_reaches_one():
    """Past s = 1/0.22 the base branch keeps its top block (alpha clamped at 1): the density is
    the same on both sides of that scale, where the literal pair (0.22 s > 1) would drop every
    row's top base block at once."""
    import dataclasses

    from rbs_bench import methods

    q, k = _qk(1000)
    sel = methods.build("rbs", block_size=64, sink_blocks=0, window_blocks=1, last_q_blocks=0)
    s_one = 1 / 0.22
    below, above = sel.with_knob(s_one * (1 - 1e-6)), sel.with_knob(s_one * (1 + 1e-6))
    assert above.alpha_base == 1.0 and above.alpha_rescue == pytest.approx(0.18 * s_one * 1.000001)
    assert above.alpha_scale == pytest.approx(s_one * 1.000001)
    literal = dataclasses.replace(above, alpha_base=0.22 * s_one * (1 + 1e-6))
    d_below, d_above = below.select(q, k).density(), above.select(q, k).density()
    assert d_above == d_below
    assert literal.select(q, k).density() < d_above  # the step the clamp removes, on this input
    curve = sel.density_curve(q, k, None, [s_one * (1 - 1e-6), s_one * (1 + 1e-6)])
    assert curve.tolist() == pytest.approx([d_below, d_above], abs=1e-12)
    # at the range's end each branch keeps exactly its top block: every row past the first
    # keeps the diagonal and at least one more block
    end = sel.with_knob(budget.knob_range(sel)[1]).select(q, k)
    assert (end.kv_count[..., 1:] >= 2).all()


def test_curves_of_other_methods_come_from_selections():
    from rbs_bench import methods

    q, k = _qk(512)
    quest = methods.build("quest", block_size=64)
    assert not hasattr(quest, "density_curve")
    want = [quest.with_knob(r).select(q, k).density() for r in (0.2, 0.5)]
    assert budget.density_curve(quest, q, k, None, [0.2, 0.5]).tolist() == want
    assert not budget.exact_curve_supported(methods.build("xattn"))
    assert budget.exact_curve_supported(methods.build("rbs"))


def test_invert_meets_the_target_on_the_knob_scale():
    values = [1.0, 10.0, 100.0]
    curve = [0.9, 0.5, 0.1]  # falls linearly in log10(knob)
    assert budget.invert(values, curve, 0.3, log=True) == pytest.approx(10**1.5)
    assert budget.invert([0.0, 0.5, 1.0], [0.2, 0.4, 1.0], 0.7, log=False) == pytest.approx(0.75)
    assert budget.invert(values, curve, 0.5, log=True) == 10.0  # a grid point on the target
    assert budget.invert(values, curve, 0.95, log=True) is None  # never reached


def test_next_short_grid_brackets_the_crossing():
    values = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    curve = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # meets 0.55 between 0.4 and 0.5
    assert budget._window(values, curve, 0.55, 0.0, 0.8) == (0.2, 0.7)
    assert budget._window(values, curve, 0.55, 0.3, 0.6) == (0.3, 0.6)  # inside the bracket
    assert budget._window(values, curve, 0.95, 0.0, 0.8) == (0.0, 0.8)  # no crossing


def test_knob_fields_are_what_the_knob_moves():
    from rbs_bench import methods

    assert budget.knob_fields(methods.build("rbs")) == {"alpha_base", "alpha_rescue"}
    assert budget.knob_fields(methods.build("centroid")) == {"alpha"}
    assert budget.knob_fields(methods.build("minference")) == {"ratio"}
    assert budget.knob_value(methods.build("rbs", alpha_base=0.44)) == pytest.approx(2.0)


def _entry(cfg, knob, **extra):
    base = build_selector(cfg, apply_budget=False)
    return {
        "target": cfg.budget.target,
        "knob": knob,
        "knob_name": base.knob,
        "density_mean": cfg.budget.target + 1e-5,
        "abs_error": 1e-5,
        "prompts": 2,
        "setting": calibrations.setting(cfg, base),
    } | extra


def test_calibrations_are_kept_per_setting(tmp_path):
    a, b = _cfg(tmp_path), _cfg(tmp_path, "method.block_size=64")
    calibrations.store(a, _entry(a, 1.5))
    calibrations.store(b, _entry(b, 2.5))
    calibrations.store(a, _entry(a, 1.75))  # replaces the entry of the same setting
    assert build_selector(a).alpha_base == pytest.approx(0.22 * 1.75)
    assert build_selector(b).alpha_base == pytest.approx(0.22 * 2.5)
    with pytest.raises(UserError, match=r"block_size=16.*create it with"):
        build_selector(_cfg(tmp_path, "method.block_size=16"))
    # a bare lookup by model, method and target (no benchmark) needs one entry at the target
    bare = OmegaConf.create(
        {
            "calibration": {"dir": str(tmp_path / "calibration")},
            "model": {"name": "tiny"},
            "method": {"name": "rbs"},
            "budget": {"name": "d10", "target": 0.45},
        }
    )
    with pytest.raises(UserError, match="holds 2 calibrations at density 0.45"):
        calibrations.load_knob(bare, methods.build("rbs"))


def test_existing_calibration_is_kept_without_loading_the_model(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    calibrations.store(cfg, _entry(cfg, 3.0))

    class NoModel(Session):
        def load(self, cfg):
            raise AssertionError("the model was loaded")

    assert calibrate.calibrate_cell(cfg, NoModel())["knob"] == 3.0
    assert "already calibrated" in capsys.readouterr().out
    # a looser stored entry (or one on fewer prompts) is redone
    calibrations.store(cfg, _entry(cfg, 3.0, abs_error=0.01))
    with pytest.raises(AssertionError, match="the model was loaded"):
        calibrate.calibrate_cell(cfg, NoModel())


def test_missing_calibration_names_the_command(tmp_path):
    with pytest.raises(UserError) as e:
        build_selector(_cfg(tmp_path))
    msg = str(e.value)
    assert (
        "python -m rbs_bench.calibrate model=tiny method=rbs budget=d10 budget.target=0.45" in msg
    )
    assert "ruler niah_single_1 at 2048 tokens" in msg


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rbs", "centroid", "xattn"])
def test_search_meets_the_tolerance_in_a_few_steps(tmp_path, monkeypatch, method):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(
        tmp_path,
        f"method={method}",
        "benchmark.num_samples=1",
        "calibration.tolerance=0.0001",
        "budget.target=0.5",
    )
    entry = calibrate.calibrate_cell(cfg, Session())
    assert entry["abs_error"] <= 1e-4 and entry["steps"] <= 8
    assert entry["forwards"] == entry["steps"] * entry["prompts"] == entry["steps"]
    assert entry["setting"]["method"]["block_size"] == 32


@pytest.mark.slow
def test_a_target_inside_a_density_step_records_the_densities_either_side(
    tmp_path, monkeypatch, capsys
):
    """A tolerance finer than one block pair: the search ends at the step that holds the target
    and records the closest density on each side with its knob."""
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    target = 0.4321
    cfg = _cfg(
        tmp_path,
        "benchmark.num_samples=1",
        "calibration.tolerance=1e-9",
        f"budget.target={target}",
    )
    entry = calibrate.calibrate_cell(cfg, Session())
    below, above = entry["neighbours"]["below"], entry["neighbours"]["above"]
    assert below["density_mean"] < target < above["density_mean"]
    assert below["knob"] > above["knob"]  # a larger scale keeps fewer blocks
    assert entry["density_mean"] in (below["density_mean"], above["density_mean"])
    gap = min(target - below["density_mean"], above["density_mean"] - target)
    assert entry["abs_error"] == pytest.approx(gap)
    err = capsys.readouterr().err
    assert "steps over the target between" in err and f"{below['density_mean']:.5f}" in err
    stored = yaml.safe_load((tmp_path / "calibration/tiny/rbs.yaml").read_text())
    assert stored["entries"][0]["neighbours"] == entry["neighbours"]


def test_calibration_shows_step_knob_and_density(monkeypatch, capsys):
    import numpy as np

    from rbs_bench import methods

    curve = lambda r: 0.2 + 0.6 * np.asarray(r, dtype=float)  # quest: density grows with ratio

    def fake_probe(loaded, prompts, base, knob, values, executor):
        return np.array([float(curve(knob))]), np.array([curve(values)])

    monkeypatch.setattr(calibrate, "probe", fake_probe)
    base = methods.build("quest")
    entry = calibrate.calibrate_target(None, [None], base, 0.5, 1e-4, "reference", progress=True)
    assert abs(entry["density_mean"] - 0.5) <= 1e-4
    err = capsys.readouterr().err
    assert "calibrate quest @ 0.5000" in err
    assert f"{entry['steps']}/{budget.MAX_STEPS}" in err
    assert "ratio=" in err and "density=" in err


def test_a_calibration_warms_up_once_per_model_and_length_before_its_clock(tmp_path, monkeypatch):
    """On CUDA the compiled layers' first prefill (graph compilation, autotuning) runs untimed
    before the first search of a prompt length, and not again for the next method."""
    from types import SimpleNamespace

    import torch

    from rbs_bench import session as session_mod

    warmed = []
    monkeypatch.setattr(session_mod, "warm_up", lambda loaded, sample: warmed.append(sample))

    class Tok:
        def __call__(self, text, **kw):
            return SimpleNamespace(input_ids=torch.zeros(1, len(text), dtype=torch.long))

    s = Session()
    s._model_key = "m"
    loaded = session_mod.Loaded(None, Tok(), torch.device("cuda"), {})
    short, long = SimpleNamespace(prompt="ab"), SimpleNamespace(prompt="abcd")
    for sample in (short, short, long, long):
        s.warm_once(loaded, sample)
    assert warmed == [short, long]
    s._model_key = "another model"
    s.warm_once(loaded, short)
    assert warmed == [short, long, short]
    cpu = session_mod.Loaded(None, Tok(), torch.device("cpu"), {})
    s.warm_once(cpu, SimpleNamespace(prompt="abcdef"))  # a CPU compiles nothing by default
    assert len(warmed) == 3
