"""Rehearsal models (shipped architectures, seeded random weights), chunked feed-forward blocks,
and the memory estimate."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rbs_bench import models
from rbs_bench.models import memory, rehearsal, tiny
from rbs_bench.models.feedforward import chunk_feedforward, decoder_feedforwards

SMALL_MOE = dict(  # Qwen3-30B-A3B with its widths shrunk for a CPU
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=512,
)


def random_cfg(**kw):
    fields = dict(
        name="qwen3_30b_a3b_random",
        hf_id=None,
        revision=None,
        max_context=262144,
        dtype="float32",
        chat_template=False,
        chat_template_kwargs={},
        trust_remote_code=False,
        config_overrides=SMALL_MOE,
        random_init=True,
        architecture="qwen3_30b_a3b",
        seed=0,
        ffn_chunk_tokens=16384,
        device_map=None,
    )
    return OmegaConf.create(fields | kw)


@pytest.mark.parametrize(
    "name, params, layers", [("qwen3_30b_a3b", 30.53e9, 48), ("qwen3_32b", 32.76e9, 64)]
)
def test_shipped_architectures_have_the_real_size(name, params, layers):
    from transformers import AutoModelForCausalLM

    config = rehearsal.architecture_config(name)
    assert config.num_hidden_layers == layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == memory.parameter_count(config)  # the estimate's weights term is exact
    assert count == pytest.approx(params, rel=1e-3)


def test_random_model_is_seeded_and_reads_bytes():
    model, tok = models.load(random_cfg(), "cpu")
    again, _ = models.load(random_cfg(), "cpu")
    other, _ = models.load(random_cfg(seed=1), "cpu")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(model.model.layers) == 2 and model.config.num_experts == 4
    weights = dict(model.named_parameters())
    for name, p in again.named_parameters():
        torch.testing.assert_close(p, weights[name], rtol=0, atol=0)
    assert any(not torch.equal(p, weights[n]) for n, p in other.named_parameters())
    assert tok.decode(tok("needle 42").input_ids) == "needle 42"  # the byte-level tokenizer
    assert tok.model_max_length == 262144
    with torch.inference_mode():
        out = model(input_ids=tok("a haystack", return_tensors="pt").input_ids, logits_to_keep=1)
    assert out.logits.shape == (1, 1, 512) and torch.isfinite(out.logits).all()


def test_random_model_identity_names_its_weights_and_drops_how_fields():
    ident = models.identity(random_cfg())
    assert ident["weights"] == "random:qwen3_30b_a3b:seed0"
    assert "ffn_chunk_tokens" not in ident and "device_map" not in ident
    assert models.identity(random_cfg(seed=3))["weights"] == "random:qwen3_30b_a3b:seed3"
    # a checkpoint's identity keeps no random-init fields (committed records stay valid)
    real = models.identity(random_cfg(random_init=False, hf_id="Qwen/Qwen3-32B"))
    assert not {"random_init", "architecture", "seed", "weights"} & set(real)


def test_bad_random_settings_are_one_line():
    with pytest.raises(ValueError, match="architecture, one of: qwen3_30b_a3b, qwen3_32b"):
        models.load(random_cfg(architecture=None), "cpu")
    with pytest.raises(ValueError, match="unknown model.architecture 'gpt5'"):
        models.load(random_cfg(architecture="gpt5"), "cpu")
    with pytest.raises(ValueError, match="sets both random_init and hf_id"):
        models.load(random_cfg(hf_id="Qwen/Qwen3-32B"), "cpu")
    with pytest.raises(ValueError, match="exceeds what"):
        models.load(random_cfg(max_context=10**7), "cpu")


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_chunked_feedforward_computes_the_same_logits(arch):
    if arch == "dense":
        model = tiny.build_model(tiny.tiny_config(num_hidden_layers=2))
    else:
        model, _ = models.load(random_cfg(ffn_chunk_tokens=None), "cpu")
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        assert chunk_feedforward(model, 64) == 2
        got = model(input_ids=ids).logits  # 600 tokens in 10 chunks, across the batch rows
        chunk_feedforward(model, None)
        back = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back, want, rtol=0, atol=0)
    assert all("forward" not in block.__dict__ for block in decoder_feedforwards(model))


def test_chunk_size_must_be_positive():
    model = tiny.build_model(tiny.tiny_config(num_hidden_layers=1))
    with pytest.raises(ValueError, match="ffn_chunk_tokens=0"):
        chunk_feedforward(model, 0)


def test_memory_estimate_counts_the_cache_and_chunks_the_feedforward():
    config = rehearsal.architecture_config("qwen3_30b_a3b")
    e = memory.estimate(config, 131072, batch=1, ffn_chunk_tokens=16384)
    # 48 layers x 131072 tokens x 4 KV heads x 128 x (K and V) x 2 bytes
    assert e.kv_cache == 48 * 131072 * 4 * 128 * 2 * 2
    unchunked = memory.estimate(config, 131072, batch=1, ffn_chunk_tokens=None)
    assert unchunked.activations > 2 * e.activations  # the MoE's intermediates of all tokens
    four = memory.estimate(config, 131072, batch=4, ffn_chunk_tokens=16384)
    assert four.kv_cache == 4 * e.kv_cache and four.weights == e.weights
    fp8 = memory.estimate(config, 131072, weight_bytes=1, ffn_chunk_tokens=16384)
    assert fp8.weights == e.weights / 2


def test_memory_table_says_what_fits(capsys):
    assert memory.main(["qwen3_32b", "--contexts", "131072", "--gpu-gib", "79"]) == 0
    one = capsys.readouterr().out
    assert "| qwen3_32b | 131072 | 1 |" in one and "no (" in one
    assert memory.main(["qwen3_32b", "--contexts", "131072", "--gpus", "2"]) == 0
    assert "| yes |" in capsys.readouterr().out
    assert memory.main(["nosuch"]) == 2
    assert "unknown model.architecture 'nosuch'" in capsys.readouterr().err
