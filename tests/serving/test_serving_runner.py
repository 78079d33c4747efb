"""The vLLM module's parts that run without vLLM: import shim, plan of runs, prompts."""

from __future__ import annotations

import importlib.util

import pytest

from rbs_bench.config import UserError
from rbs_bench.serving import vllm as serving
from rbs_bench.serving.prefill import ENV_VAR, PrefillSpec


def test_import_needs_no_vllm_and_the_plugin_is_off_without_its_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert serving.register() is None  # returns before touching vLLM
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UserError, match="make test-vllm"):
            serving.SparsePrefillCpuBackend  # noqa: B018
    with pytest.raises(AttributeError):
        serving.NoSuchBackend  # noqa: B018


def test_plan_gives_each_method_its_own_fields_and_budgets():
    specs = serving.plan_specs(
        ["dense", "rbs"], {"block_size": 64, "impl": "torch"}, [0.5, 2.0], "auto", "cpu"
    )
    assert specs == [
        PrefillSpec("dense", {"block_size": 64}, None, "auto"),
        PrefillSpec("rbs", {"block_size": 64, "impl": "torch"}, 0.5, "auto"),
        PrefillSpec("rbs", {"block_size": 64, "impl": "torch"}, 2.0, "auto"),
    ]
    assert [serving.budget_name(s) for s in specs] == ["default", "knob0.5", "knob2"]


@pytest.mark.parametrize(
    "names, fields, message",
    [
        (["rbs"], {"alpha": 0.1}, "no method of rbs has the field"),
        (["nosuch"], {}, "unknown method 'nosuch'"),
        (["rbs"], {"block_size": -1}, "block_size must be a positive integer"),
    ],
)
def test_plan_rejects_bad_input_in_one_line(names, fields, message):
    with pytest.raises(UserError, match=message):
        serving.plan_specs(names, fields, [None], "auto", "cpu")


def test_fields_parse_as_json_values():
    assert serving._parse_fields(["block_size=64", "impl=torch", "alpha=0.2"]) == {
        "block_size": 64,
        "impl": "torch",
        "alpha": 0.2,
    }
    with pytest.raises(UserError, match="name=value"):
        serving._parse_fields(["block_size"])


def test_prompts_are_seeded_and_a_batch_extends_the_single_prompt():
    one = serving.make_prompts(512, 300, 1, seed=3)
    three = serving.make_prompts(512, 300, 3, seed=3)
    assert three[0] == one[0] and len({tuple(p) for p in three}) == 3
    assert all(len(p) == 300 and 0 <= min(p) and max(p) < 512 for p in three)
    text = serving.make_prompts(512, 10, 2, seed=0, text_ids=[1, 2, 3, 4])
    assert text[0] == [1, 2, 3, 4] * 2 + [1, 2]


def test_budget_from_a_calibration_file(tmp_path):
    from omegaconf import OmegaConf

    from rbs_bench import calibrations

    cfg = OmegaConf.create(
        {
            "calibration": {"dir": str(tmp_path)},
            "model": {"name": "tiny", "hf_id": None},
            "method": {"name": "rbs"},
        }
    )
    entry = {"target": 0.05, "knob": 1.75, "knob_name": "alpha_scale", "density_mean": 0.05}
    path = calibrations.store(cfg, entry | {"abs_error": 0.0})
    assert serving.calibrated_knob(str(tmp_path), "tiny", "rbs", 0.05) == 1.75
    with pytest.raises(UserError, match="python -m rbs_bench.calibrate"):
        serving.calibrated_knob(str(tmp_path), "tiny", "rbs", 0.02)
    path.write_text(path.read_text().replace("knob: 1.75", "knob: 2.5"))  # edited by hand
    with pytest.raises(UserError, match="does not match its digest"):
        serving.calibrated_knob(str(tmp_path), "tiny", "rbs", 0.05)
