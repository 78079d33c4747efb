"""Records that carry their own proof: a rerun compares every record's settings with its own,
cell.json is only a cache of that check, calibration entries must hold their target's density,
and a method field that a budget would overwrite stops the run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from rbs_bench import calibrate, calibrations, config
from rbs_bench.config import UserError
from rbs_bench.records import read_records, seal
from rbs_bench.runner import run_cell
from rbs_bench.session import Session, build_selector

config.register_schemas()

EXPERIMENT = "ruler_budget"
CELL = f"runs/{EXPERIMENT}/tiny/dense/d50"
TINY = [
    f"+experiment={EXPERIMENT}",
    "method=dense",
    "budget=d50",  # dense keeps every block at any budget; the records still carry the target
    "benchmark.tasks=[niah_single_1]",
    "benchmark.context_lengths=[1024]",
    "benchmark.num_samples=1",
    "benchmark.max_new_tokens=2",
    "progress=false",
]


def _cfg(results, *extra, base=TINY):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=[*base, f"results_dir={results}", *extra])


class NoModel(Session):
    def load(self, cfg):
        raise AssertionError("the model was loaded")


@pytest.fixture(scope="module")
def session():
    return Session()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, session):
    """A results dir whose dense/d50 cell holds one real record."""
    root = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RBS_BENCH_CACHE", str(root / "cache"))
        run_cell(_cfg(root), EXPERIMENT, session)
        assert len(read_records(root / CELL / "records.jsonl")) == 1
        yield root


@pytest.fixture
def results(recorded, tmp_path):
    shutil.copytree(recorded / "runs", tmp_path / "runs")
    return tmp_path


def test_a_changed_target_is_caught_from_the_records_without_cell_json(results):
    (results / CELL / "cell.json").unlink()
    with pytest.raises(UserError) as e:
        run_cell(_cfg(results, "budget.target=0.4"), EXPERIMENT, NoModel())
    msg = str(e.value)
    assert "records.jsonl holds 1 records, 1 made with other settings" in msg
    assert "budget.target=0.5, but this run has budget.target=0.4" in msg
    assert "results_dir=..." in msg and "\n" not in msg
    assert read_records(results / CELL / "records.jsonl")[0]["budget_target"] == 0.5


def test_a_bf16_run_never_joins_a_float32_cell(results):
    """The records name the model's dtype (its identity): a bf16 rerun of a float32 cell stops
    before the model loads, and both files stay as they were."""
    (results / CELL / "cell.json").unlink()
    with pytest.raises(UserError) as e:
        run_cell(_cfg(results, "model.dtype=bfloat16"), EXPERIMENT, NoModel())
    assert "model.dtype='float32', but this run has model.dtype='bfloat16'" in str(e.value)
    assert len(read_records(results / CELL / "records.jsonl")) == 1


def test_every_record_is_compared_not_only_cell_json(results):
    """cell.json agrees with the run; the record made with another field does not."""
    path = results / CELL / "records.jsonl"
    rec = read_records(path)[0]
    rec["method_fields"]["block_size"] = 64
    path.write_text(json.dumps(seal(rec)) + "\n")  # as if recorded so
    with pytest.raises(UserError, match=r"method.block_size=64, but this run has .*=128"):
        run_cell(_cfg(results), EXPERIMENT, NoModel())


def test_cell_json_holds_what_older_records_lack(results):
    path = results / CELL / "records.jsonl"
    rec = read_records(path)[0]
    for key in ("max_new_tokens", "benchmark_seed", "model_identity", "checksum"):
        del rec[key]  # a record from before they were recorded
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(UserError, match=r"cell.json .*benchmark.max_new_tokens=2, but .*=3"):
        run_cell(_cfg(results, "benchmark.max_new_tokens=3"), EXPERIMENT, NoModel())


def test_cell_json_is_rebuilt_from_checked_records(results, session, capsys):
    cached = results / CELL / "cell.json"
    before = cached.read_text()
    cached.unlink()
    run_cell(_cfg(results), EXPERIMENT, session)
    assert "all 1 samples already recorded" in capsys.readouterr().out
    assert cached.read_text() == before


def test_a_failed_run_leaves_nothing_that_blocks_the_corrected_run(tmp_path, session):
    with pytest.raises(UserError):
        run_cell(_cfg(tmp_path, "model.hf_id=/nonexistent/model"), EXPERIMENT, Session())
    cell = tmp_path / CELL
    assert not (cell / "cell.json").exists() and not (cell / "records.jsonl").exists()
    # a cell.json left by an older version's failed run, with no record beside it, is ignored
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "cell.json").write_text(json.dumps({"model.hf_id": "/nonexistent/model"}))
    run_cell(_cfg(tmp_path), EXPERIMENT, session)
    assert len(read_records(cell / "records.jsonl")) == 1
    assert json.loads((cell / "cell.json").read_text())["model.hf_id"] is None


def test_a_json_line_that_is_not_a_record_names_file_and_line(results):
    path = results / CELL / "records.jsonl"
    with open(path, "a") as f:
        f.write('{"x": 1}\n')
    with pytest.raises(UserError) as e:
        run_cell(_cfg(results), EXPERIMENT, NoModel())
    msg = str(e.value)
    assert f"{path}:2 is JSON but not a run record (no task, context_length, index)" in msg
    assert f"sed -i '2d' {path}" in msg
    with pytest.raises(UserError, match=r"records.jsonl:2 is JSON but not a run record"):
        read_records(path)


# ------------------------------------------------------------------------------------------------
# Budgets and calibrations (no model: the checks run before it loads).

RBS = [
    "method=rbs",
    "method.block_size=32",
    "budget=d50",
    "benchmark.context_lengths=[2048]",
    "benchmark.num_samples=2",
    "calibration.num_prompts=2",
    "calibration.tolerance=0.002",
    "progress=false",
]


def _store(cfg, knob, density, abs_error, **extra):
    base = build_selector(cfg, apply_budget=False)
    entry = {
        "target": cfg.budget.target,
        "knob": knob,
        "knob_name": base.knob,
        "density_mean": density,
        "abs_error": abs_error,
        "prompts": 2,
        "tolerance": 0.002,
        "setting": calibrations.setting(cfg, base),
    }
    return calibrations.store(cfg, entry | extra)


def test_a_method_field_the_budget_would_overwrite_stops_the_run(tmp_path):
    cfg = _cfg(tmp_path, base=RBS)
    _store(cfg, 2.0, 0.5, 0.0)
    assert build_selector(cfg).alpha_base == pytest.approx(0.44)
    with pytest.raises(UserError) as e:
        build_selector(_cfg(tmp_path, "method.alpha_base=0.3", base=RBS))
    assert str(e.value) == (
        "method.alpha_base=0.3 would be replaced by budget 'd50': the alpha_scale calibrated to "
        "density 0.5 sets method.alpha_base, method.alpha_rescue; drop method.alpha_base=0.3 to "
        "run at the budget, or run at the fields as given with budget=default"
    )
    with pytest.raises(UserError, match=r"its knob alpha_scale=2 sets"):
        build_selector(
            _cfg(tmp_path, "method.alpha_rescue=0.1", "budget=default", "budget.knob=2", base=RBS)
        )
    # without a budget that sets the knob the field is what runs
    assert build_selector(_cfg(tmp_path, "method.alpha_base=0.3", "budget=default", base=RBS))
    assert build_selector(
        _cfg(tmp_path, "method.alpha_base=0.3", "budget=default", base=RBS)
    ).alpha_base == pytest.approx(0.3)


def test_a_calibration_entry_holding_another_density_is_refused(tmp_path):
    cfg = _cfg(tmp_path, base=RBS)
    path = _store(cfg, 3.1, 0.25, 8e-5)  # d25's knob and density, filed under d50
    with pytest.raises(UserError) as e:
        build_selector(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{path}: the calibration of rbs at density 0.5 (")
    assert "records density 0.2500, 0.2500 from its target (tolerance 0.002" in msg
    assert (
        "recalibrate it with: python -m rbs_bench.calibrate model=tiny method=rbs budget=d50" in msg
    )
    # calibrate does not keep it as "already calibrated": it runs the search again
    with pytest.raises(AssertionError, match="the model was loaded"):
        calibrate.calibrate_cell(cfg, NoModel())


def test_the_closest_reachable_density_is_used_when_it_says_so(tmp_path):
    """A target inside a density step: the search's closest, recorded with its error."""
    cfg = _cfg(tmp_path, base=RBS)
    _store(cfg, 2.0, 0.503, 0.003)
    assert build_selector(cfg).alpha_base == pytest.approx(0.44)
    _store(cfg, 2.0, 0.503, 1e-5)  # the recorded error does not match the density
    with pytest.raises(UserError, match="belongs to another density"):
        build_selector(cfg)


@pytest.mark.slow
def test_the_mismatch_is_one_line_on_the_command_line(results):
    (results / CELL / "cell.json").unlink()
    cmd = [sys.executable, "-m", "rbs_bench", *TINY, f"results_dir={results}"]
    env = dict(os.environ, RBS_BENCH_CACHE=str(results / "cache"))
    res = subprocess.run(
        [*cmd, "budget.target=0.4"], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("rbs-bench: error: ") and "budget.target=0.5" in line
    assert len(read_records(results / CELL / "records.jsonl")) == 1


def test_the_recall_pass_is_timed_apart_from_the_prefill(tmp_path, session, monkeypatch):
    """recall=true runs a dense pass per layer inside the prefill forward; its seconds go to
    recall_s, not to ttft_s (here each pass sleeps 1 s, far above the prefill itself, even on a
    loaded 2-core machine, where the prefill took 3.6 s against 0.25 s x 6 passes)."""
    import time

    from rbs_bench.methods import mass

    real = mass.attention_recall

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(mass, "attention_recall", slow)
    path = run_cell(
        _cfg(tmp_path, "method=rbs", "budget=default", "recall=true"), EXPERIMENT, session
    )
    (rec,) = read_records(path)
    slept = 1.0 * len(rec["recall_layers"])
    assert rec["recall_s"] >= slept
    assert rec["ttft_s"] < slept and rec["generate_s"] < slept
    assert 0 < rec["recall"] <= 1
