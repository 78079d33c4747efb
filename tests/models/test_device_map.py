"""A model spread by accelerate (`model.device_map=auto`): the sparse prefill hook and the chunked
feed-forward blocks run through accelerate's device hooks, and the plan for the paper's dense
model on two 80 GB cards matches the memory estimate. CPU only: accelerate's hooks are exercised
with a layer offloaded to disk (its weights arrive only when it runs), and the two-GPU plan is
made on the meta device with two visible GPUs pretended."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from model_fakes import dispatch_layers
from omegaconf import OmegaConf

from rbs_bench import methods, models
from rbs_bench.models import memory, rehearsal, tiny
from rbs_bench.models.feedforward import chunk_feedforward
from rbs_bench.models.hf_attention import install, uninstall

GiB = 2**30


def test_sparse_hook_and_chunks_run_through_accelerate_dispatch(tmp_path):
    model = tiny.build_model(tiny.tiny_config(num_hidden_layers=2))
    ids = torch.randint(0, 256, (1, 1000), generator=torch.Generator().manual_seed(0))
    fields = dict(block_size=64, sink_blocks=1, window_blocks=1, last_q_blocks=0, impl="torch")
    selector = methods.build("rbs", **fields).with_knob(5.0)  # thresholds near 1: sparse
    rec = install(model, selector, "reference")
    with torch.inference_mode():
        want = model(input_ids=ids, logits_to_keep=1).logits
    alone = rec.summary()
    uninstall(model)
    assert 0 < alone["density_mean"] < 0.9

    spread = dispatch_layers(model, ["cpu", "disk"], tmp_path)
    assert spread.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    chunk_feedforward(spread, 256)  # on top of accelerate's own forward wrappers
    rec = install(spread, selector, "reference")
    with torch.inference_mode():
        got = spread(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rec.summary()["density_layers_heads"] == alone["density_layers_heads"]


def test_two_gpu_plan_for_qwen3_32b_splits_whole_layers_as_the_estimate_says():
    """Qwen3-32B in bf16 at 128K: too large for one 80 GB card, fits two by the estimate;
    accelerate's balanced plan (what device_map=auto does) puts whole decoder layers on each."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    from transformers import AutoModelForCausalLM

    config = rehearsal.architecture_config("qwen3_32b")
    one = memory.estimate(config, 131072, ffn_chunk_tokens=16384)
    assert one.total > 79 * GiB  # one card: no
    per_gpu = (one.weights + one.kv_cache) / 2 + one.activations + memory.CUDA_CONTEXT_GIB * GiB
    assert per_gpu < 79 * GiB  # two cards: yes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with (
        mock.patch("torch.cuda.device_count", return_value=2),
        mock.patch("torch.cuda.is_available", return_value=True),
    ):
        limits = {0: 79 * GiB, 1: 79 * GiB}
        balanced = get_balanced_memory(
            model, max_memory=limits, no_split_module_classes=model._no_split_modules
        )
        plan = infer_auto_device_map(
            model, max_memory=balanced, no_split_module_classes=model._no_split_modules
        )
    layers = {k: v for k, v in plan.items() if k.startswith("model.layers.")}
    assert len(layers) == config.num_hidden_layers  # no decoder layer is cut in two
    counts = Counter(layers.values())
    assert set(counts) == {0, 1} and abs(counts[0] - counts[1]) <= 8


def test_device_map_needs_a_gpu():
    cfg = OmegaConf.create(
        dict(
            name="x",
            hf_id="Qwen/Qwen3-32B",
            revision=None,
            max_context=131072,
            dtype="auto",
            chat_template=True,
            chat_template_kwargs={},
            trust_remote_code=False,
            config_overrides={},
            random_init=False,
            architecture=None,
            seed=0,
            ffn_chunk_tokens=None,
            device_map="auto",
        )
    )
    with pytest.raises(ValueError, match="device_map=auto spreads a model over GPUs"):
        models.load(cfg, "cpu")
