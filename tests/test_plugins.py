"""A selector and a benchmark from an installed distribution (tests/fixtures/ext_method: one
module each and a dist-info declaring `rbs_bench.methods` and `rbs_bench.benchmarks` entry points)
run through config, calibration, a ruler_budget cell, the tables and the observations without any
change to this repository. tests/fixtures/ext_broken holds plugins broken in one way each (and a
good one, `meandot`): each is skipped with one line, and everything else keeps working."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_module

from rbs_bench import benchmarks, calibrate, config, figures, methods, observations, plugins, report
from rbs_bench.methods.conformance import check_selector
from rbs_bench.records import RecordStore
from rbs_bench.runner import run_cell
from rbs_bench.session import Session
from rbs_bench.tables import build

FIXTURE = Path(__file__).parent / "fixtures" / "ext_method"
BROKEN = Path(__file__).parent / "fixtures" / "ext_broken"
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


def test_a_plugin_may_not_take_a_shipped_name(plugin, monkeypatch, tmp_path, capsys):
    dist = tmp_path / "clash-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rbs_bench.methods]\nrbs = rbs_ext_recent:Recent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    methods.refresh()
    assert methods.method_class("rbs").__module__ == "rbs_bench.methods.rbs"  # the shipped one
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "'rbs'" in ln]
    assert "distribution clash 0.1" in line and "rename the entry point" in line


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
    real = plugins.entry_points

    def counted(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(plugins, "entry_points", counted)
    monkeypatch.syspath_prepend(str(tmp_path))  # a sys.path not read yet
    for _ in range(3):
        benchmarks.get("ruler")
    assert len(calls) == 1
    monkeypatch.syspath_prepend(str(FIXTURE))  # a distribution put on sys.path: read again
    assert "echo" in benchmarks.available() and len(calls) == 2


# --- plugins broken in one way each -----------------------------------------------------------

# entry point -> what its one line must say (what is wrong or what to fix)
BROKEN_METHODS = {
    "nodirection": "knob_direction = 1",
    "norange": "knob_range = (lo, hi)",
    "noname": "name = ",
    "widerange": "narrow knob_range",
    "perkvhead": "one row per KV head",
    "noimport": "cannot import rbs_broken_missing",
}
BROKEN_BENCHMARKS = {"noversion": "lacks VERSION", "brokenbench": "cannot import"}


@pytest.fixture
def broken(monkeypatch):
    """Both fixture distributions installed: ext_method's good plugins and ext_broken's."""
    monkeypatch.syspath_prepend(str(FIXTURE))
    monkeypatch.syspath_prepend(str(BROKEN))
    methods.refresh()
    yield
    monkeypatch.undo()
    methods.refresh()
    config.register_schemas()


def _one_line_each(err: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("rbs-bench: warning: skipped")]
    expected = {("method", n, w) for n, w in BROKEN_METHODS.items()}
    expected |= {("benchmark", n, w) for n, w in BROKEN_BENCHMARKS.items()}
    assert len(lines) == len(expected), lines
    for kind, name, what in expected:
        (line,) = [ln for ln in lines if f"{kind} plugin {name!r}" in ln]
        assert f"entry point {name} = " in line and "distribution rbs-broken 0.1" in line
        assert what in line, line


def test_each_broken_plugin_is_one_line_and_skipped(broken, capsys):
    names = methods.available()
    assert "meandot" in names and "recent" in names and "rbs" in names
    assert not set(BROKEN_METHODS) & set(names)
    assert "echo" in benchmarks.available()
    assert not set(BROKEN_BENCHMARKS) & set(benchmarks.available())
    _one_line_each(capsys.readouterr().err)
    assert {p.name for p in plugins.problems()} == set(BROKEN_METHODS) | set(BROKEN_BENCHMARKS)
    config.register_schemas()  # composing configs still works
    cfg = _compose("method=meandot", "benchmark=echo")
    assert cfg.method.ratio == 0.1 and cfg.benchmark.name == "echo"


def test_shipped_selectors_and_benchmarks_pass_the_plugin_checks():
    for name, cls in methods.registry().items():
        check_selector(name, cls)
    for name in benchmarks.available():
        benchmarks.check_benchmark(name, benchmarks.get(name))


def _cli(tmp_path, *args):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(BROKEN), str(FIXTURE), os.environ.get("PYTHONPATH", "")]),
        RBS_BENCH_CACHE=str(tmp_path / "cache"),
    )
    cmd = [sys.executable, "-m", "rbs_bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def test_rbs_still_runs_beside_broken_plugins_and_help_lists_the_good_ones(tmp_path):
    res = _cli(
        tmp_path,
        "method=rbs",
        "model=tiny_random",
        "benchmark.context_lengths=[1024]",
        "benchmark.num_samples=1",
        "benchmark.max_new_tokens=2",
        "progress=false",
        "device=cpu",
        f"results_dir={tmp_path}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    _one_line_each(res.stderr)  # once each, though the registry serves several steps
    assert "Traceback" not in res.stderr
    assert f"recorded under {tmp_path}/runs/adhoc/tiny_random/" in res.stdout
    assert (tmp_path / "runs/adhoc/tiny_random/rbs/default/records.jsonl").exists()
    helped = _cli(tmp_path, "--help")
    assert helped.returncode == 0
    assert "(plugins: meandot, recent)" in helped.stdout and "(plugins: echo)" in helped.stdout
    assert "skipped method plugin perkvhead" in helped.stdout


def _records(root: Path, method: str, budget: str, density: float, scores: list[float]):
    store = RecordStore(root / "runs/ruler_budget/tiny" / method / budget / "records.jsonl")
    for i, score in enumerate(scores):
        store.append(
            dict(experiment="ruler_budget", model="tiny", method=method, budget=budget)
            | dict(budget_target=None if budget == "default" else 0.25, task="niah_multikey_3")
            | dict(context_length=4096, index=i, score=score, density=density, ttft_s=0.5)
            | dict(meta={})
        )


def _drawn_lines(monkeypatch) -> list:
    """Every line of every figure saved from now on: (label, colour, marker, width)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    drawn, real = [], Figure.savefig

    def spy(fig, *a, **kw):
        for ax in fig.axes:
            for ln in ax.get_lines():
                drawn.append((ln.get_label(), to_hex(ln.get_color()), ln.get_marker(), ln.get_lw()))
        return real(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    return drawn


def _check_styles(drawn: list, order: list[str]) -> None:
    lines = {label: rest for label, *rest in drawn if label in order}
    assert lines["Mean-dot top-k"][:2] == ["#bcbd22", "p"]  # its declared style
    assert lines["RBS-Attention"][0] == "#d62728"  # the same colour with the plugin there
    assert lines["RBS-Attention"][2] > lines["Mean-dot top-k"][2]  # the headline is stronger
    drawn.clear()


def test_a_good_plugin_shows_in_summaries_tables_and_plots(broken, tmp_path, monkeypatch):
    drawn = _drawn_lines(monkeypatch)
    _records(tmp_path, "dense", "default", 1.0, [100, 100, 100])
    for method in ("rbs", "meandot", "flashprefill", "oracle"):
        _records(tmp_path, method, "d25", 0.25, [100, 0, 100])
    exp = tmp_path / "runs/ruler_budget/tiny"
    report.write_summary(exp)
    order = ["Dense", "FlashPrefill", "Mean-dot top-k", "RBS-Attention", "Oracle"]  # info.order
    md = (exp / "summary.md").read_text().split("## By task")[0]
    rows = [ln.split(" | ")[0].strip("| ") for ln in md.splitlines() if ln.startswith("| ")][1:]
    assert rows == order
    csv = pd.read_csv(exp / "summary.csv")
    assert list(csv["display"]) == order and list(csv["method"])[2] == "meandot"
    _check_styles(drawn, order)  # score_vs_density.png

    out = tmp_path / "tables"
    args = ["--results", str(tmp_path), "--out", str(out), "--paper-values", str(VALUES)]
    assert build.main(args) == 0
    table = (out / "ruler_budget_tiny.md").read_text()
    header = next(ln for ln in table.splitlines() if ln.startswith("| Target"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == order[1:]

    figures.build_figures(tmp_path, tmp_path / "figures")
    assert (tmp_path / "figures/ruler_budget_tiny.png").exists()
    _check_styles(drawn, order)  # ruler_budget_tiny.png


def test_a_colour_comes_from_the_style_or_the_name_never_the_position():
    from rbs_bench.methods.info import PALETTE, MethodInfo, colour

    assert colour("anything", MethodInfo(display="x", style=("#123456", "o"))) == "#123456"
    plain = MethodInfo(display="x")
    assert colour("meandot", plain) in PALETTE  # a hash of the name (sha1, not Python's hash)
    assert colour("meandot", plain) == colour("meandot", MethodInfo(display="y", order=99))
