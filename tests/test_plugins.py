"""A selector and a benchmark from an installed distribution (tests/fixtures/ext_method: one
module each and a dist-info declaring `rbs_bench.methods` and `rbs_bench.benchmarks` entry points)
run through config, calibration, a ruler_budget cell, the tables and the observations without any
change to this repository."""

from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_module

from rbs_bench import benchmarks, calibrate, config, methods, observations
from rbs_bench.runner import run_cell
from rbs_bench.session import Session
from rbs_bench.tables import build

FIXTURE = Path(__file__).parent / "fixtures" / "ext_method"
VALUES = Path(__file__).parents[1] / "results" / "paper" / "paper_values.csv"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE))  # as if the distribution were installed
    methods.refresh()
    config.register_schemas()
    yield
    monkeypatch.undo()
    methods.refresh()


def _compose(*overrides):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    config.validate(cfg)
    return cfg


def test_entry_point_method_is_registered_with_its_metadata(plugin):
    assert "recent" in methods.available()
    assert methods.display("recent") == "Recent-window"
    assert methods.order_key("recent") > methods.order_key("rbs")  # no order: after the shipped
    assert "recent" in methods.compared() and "recent" in config.timing_methods()
    # no conf/method/recent.yaml: the config comes from the dataclass, forced blocks from forced.*
    cfg = _compose("method=recent", "forced.sink_blocks=3")
    assert cfg.method.name == "recent" and cfg.method.fraction == 0.25
    assert cfg.method.sink_blocks == 3 and cfg.method.block_size == 128


def test_a_plugin_may_not_take_a_shipped_name(plugin, monkeypatch, tmp_path):
    dist = tmp_path / "clash-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rbs_bench.methods]\nrbs = rbs_ext_recent:Recent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    methods.refresh()
    with pytest.raises(ValueError, match="'rbs'"):
        methods.registry()


def test_calibration_cell_tables_and_observations(plugin, tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    cfg = _compose(
        "+experiment=ruler_budget",
        "method=recent",
        "budget=d70",
        "benchmark.context_lengths=[1024]",
        "benchmark.num_samples=2",
        "benchmark.max_new_tokens=4",
        "calibration.num_prompts=1",
        "calibration.tolerance=0.03",
        "progress=false",
        "device=cpu",
        f"results_dir={tmp_path}",
    )
    session = Session()
    entry = calibrate.calibrate_cell(cfg, session)
    assert entry["abs_error"] <= 0.03
    assert (tmp_path / "calibration" / "tiny" / "recent.yaml").exists()

    cell = run_cell(cfg, "ruler_budget", session)
    recs = pd.read_json(cell, lines=True)  # the cell's records file
    assert list(recs["method"]) == ["recent", "recent"]
    assert recs["density"].sub(0.7).abs().max() < 0.1

    out = tmp_path / "tables"
    assert (
        build.main(["--results", str(tmp_path), "--out", str(out), "--paper-values", str(VALUES)])
        == 0
    )
    table = (out / "ruler_budget_tiny.md").read_text()
    assert "Recent-window" in table

    ocfg = _compose(
        "+experiment=observations",
        "observations.synthetic=true",
        "observations.context_length=1024",
        "observations.prompts=1",
        "observations.block_size=128",
        "observations.knob_points=3",
        "observations.methods=[recent]",
        "observations.generator.q_heads=2",
        "observations.generator.kv_heads=1",
        "observations.generator.head_dim=16",
        "device=cpu",
        f"results_dir={tmp_path}",
    )
    cov = pd.read_csv(observations.run(ocfg, "observations") / "coverage.csv")
    recent = cov[cov["method"] == "recent"]
    assert list(recent["knob"]) == pytest.approx([0.0, 0.5, 1.0])  # its info.sweep: linear
    assert recent["coverage"].is_monotonic_increasing


def test_benchmarks_satisfy_the_protocol(plugin):
    assert "echo" in benchmarks.available()  # the fixture's entry point
    for name in benchmarks.available():
        assert isinstance(benchmarks.get(name), benchmarks.Benchmark), name


class _Bytes:
    def encode(self, text):
        return text.encode()


def test_entry_point_benchmark_composes_and_generates(plugin):
    cfg = _compose("benchmark=echo", "benchmark.context_lengths=[200]")  # no benchmark/echo.yaml
    assert cfg.benchmark.name == "echo" and list(cfg.benchmark.tasks) == ["echo"]
    bench = benchmarks.get("echo")
    (s,) = bench.generate("echo", 200, 1, _Bytes())
    assert s.num_tokens + s.max_new_tokens <= 200 and s.references[0] in s.prompt
    assert bench.score_one("echo", f"it is {s.references[0]}", s.references) == 100.0


@pytest.mark.parametrize("name", ["longbench_v2", "infinitebench"])
def test_check_data_names_a_missing_source(name, tmp_path):
    bench = benchmarks.get(name)
    task = next(iter(bench.TASKS))
    with pytest.raises(ValueError, match="benchmark.data.dataset is not set"):
        bench.check_data(task, {})
    with pytest.raises(ValueError, match="cannot read"):
        bench.check_data(task, {"dataset": str(tmp_path / "absent.json")})
    with pytest.raises(ValueError, match="unknown"):
        bench.check_data("no_such_task", {"dataset": "owner/name"})


def test_benchmark_entry_points_are_read_once_per_sys_path(monkeypatch, tmp_path):
    calls = []
    real = benchmarks.entry_points

    def counted(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(benchmarks, "entry_points", counted)
    monkeypatch.syspath_prepend(str(tmp_path))  # a sys.path not read yet
    for _ in range(3):
        benchmarks.get("ruler")
    assert len(calls) == 1
    monkeypatch.syspath_prepend(str(FIXTURE))  # a distribution put on sys.path: read again
    assert "echo" in benchmarks.available() and len(calls) == 2
