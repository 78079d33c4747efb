"""Config tree: every experiment composes, and bad input fails with one line."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from rbs_bench import config, methods

config.register_schemas()


def _compose(overrides):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("experiment", config.group_options("experiment"))
def test_every_experiment_composes(experiment):
    cfg = _compose([f"+experiment={experiment}"])
    config.validate(cfg)
    for value in str(cfg.hydra.sweeper.params.get("method", "")).split(","):
        if value:
            assert value in methods.available()


@pytest.mark.parametrize("method", config.group_options("method"))
def test_method_yaml_matches_registry(method):
    cfg = _compose([f"method={method}"])
    built = methods.build(cfg.method.name, **{k: v for k, v in cfg.method.items() if k != "name"})
    assert built.name == method
    # the YAML holds the registry's defaults, so `method=<name>` means the paper's setting
    assert built == methods.build(method)


def test_forced_blocks_set_every_method_and_yield_to_method_fields():
    from rbs_bench.session import build_selector

    def built(*overrides):
        return build_selector(_compose(list(overrides)), apply_budget=False)

    shrunk = ["forced.sink_blocks=1", "forced.window_blocks=1", "forced.last_q_blocks=0"]
    for name in ("rbs", "centroid", "flashprefill", "full_l2", "quest"):
        sel = built(f"method={name}", *shrunk)
        assert (sel.sink_blocks, sel.window_blocks, sel.last_q_blocks) == (1, 1, 0)
    assert built("method=flexprefill", "forced.min_budget=128").min_budget == 128
    assert built("method=rbs", "forced.sink_blocks=1", "method.sink_blocks=3").sink_blocks == 3
    # ruler_budget's CPU default shrinks them; the paper's come back with forced.*=<paper value>
    cfg = _compose(["+experiment=ruler_budget", "method=rbs"])
    assert build_selector(cfg, apply_budget=False).last_q_blocks == 0
    assert built("method=xattn", *shrunk) == methods.build("xattn")  # no forced fields


@pytest.mark.parametrize("model", config.group_options("model"))
def test_models_compose(model):
    cfg = _compose([f"model={model}"])
    assert cfg.model.max_context >= 4096


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rbs_bench", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args,expect",
    [
        (["method=nosuch"], f"unknown method 'nosuch'; valid: {', '.join(methods.available())}"),
        (
            ["method=rbs", "method.alpah=0.3"],
            "'method.alpah' is not a field of method; valid fields:",
        ),
        (["+method.alpah=0.3"], "'method.alpah' is not a field of method"),
        (["resutls_dir=x"], "'resutls_dir' is not a field of the run config"),
        (["method=rbs", "method.alpha_base=abc"], "method.alpha_base: Value 'abc'"),
        (
            ["+experiment=nosuch"],
            f"unknown experiment 'nosuch'; valid: {', '.join(config.group_options('experiment'))}",
        ),
    ],
)
def test_bad_overrides_fail_with_one_line(args, expect):
    res = _cli(*args)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert expect in lines[0]


def test_run_time_errors_are_one_line(tmp_path):
    res = _cli("benchmark.context_lengths=[65536]", f"results_dir={tmp_path}")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "rbs-bench: error: context length 65536 exceeds model.max_context=32768 of tiny; "
        "lower benchmark.context_lengths"
    )
    res = _cli("method=rbs", "method.alpha_base=-1", f"results_dir={tmp_path}")
    assert res.returncode == 2
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .endswith("alpha_base must be a finite number >= 0, got -1.0")
    )


def test_every_registered_method_has_a_config():
    assert config.group_options("method") == methods.available()


def test_help_lists_the_yaml_options_without_schema_nodes():
    res = _cli("--help")
    assert res.returncode == 0, res.stderr
    assert "_schema" not in res.stdout
    assert f"method: {', '.join(methods.available())}\n" in res.stdout
    assert "experiment: " in res.stdout and "ruler_budget" in res.stdout
