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
    one_byte = memory.estimate(config, 131072, weight_bytes_per_param=1, ffn_chunk_tokens=16384)
    assert one_byte.weights == e.weights / 2
    fp8 = memory.estimate(config, 131072, ffn_chunk_tokens=16384, fp8=True)
    # e4m3 attention and experts (29.9B) with a float32 scale per 128x128 block, the embeddings,
    # output head, norms and routers (0.64B) in bf16
    quantized = memory.fp8_parameter_count(config)
    assert quantized == 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 3 * 2048 * 768)
    rest = memory.parameter_count(config) - quantized
    assert fp8.weights == pytest.approx(quantized * (1 + 4 / 128**2) + 2 * rest)
    assert fp8.kv_cache == e.kv_cache and fp8.activations == e.activations
    assert memory.estimate_model("qwen3_30b_a3b_fp8", 131072).weights == fp8.weights
    assert memory.estimate_model("qwen3_30b_a3b_random", 131072).weights == e.weights
    # compiled layers: each top-k expert's gathered input (2048) and gate/up (2 x 768) in bf16 and
    # 128 float32 router logits per token, beside the residual stream's three copies
    lean = memory.estimate(config, 131072, ffn_chunk_tokens=None, compiled=True)
    per_token = 8 * 2 * (2048 + 2 * 768) + 128 * 4 + 3 * 2048 * 2
    assert lean.activations == 131072 * per_token < unchunked.activations
    # compiled with 32K chunks, the attention sublayer's working set is the larger: the residual
    # stream and its normed copy, queries and keys with RoPE's temporaries, the values
    chunked = memory.estimate(config, 131072, ffn_chunk_tokens=32768, compiled=True)
    assert chunked.activations == 131072 * 2 * (2 * 2048 + 4 * 4096 + 5 * 512)


def test_vl_model_counts_its_vision_tower_and_video_context():
    from transformers import AutoModelForImageTextToText

    config = memory.model_config("qwen3_vl_30b_a3b_thinking_fp8")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert memory.vision_parameter_count(config) == vision
    assert memory.parameter_count(config) == count
    # Video-MME: 32 frames of 720p through Qwen3-VL's processor, as a run builds its inputs
    from rbs_bench.models.checkpoint import VIDEO_PROCESSOR
    from rbs_bench.models.vision import VideoProcessor

    proc = VideoProcessor.for_counting(VIDEO_PROCESSOR)
    t, h, w = proc.grid(32, 720, 1280)
    assert memory.video_tokens() == t * h * w // 4 and t == 16
    assert memory.videomme_context() == memory.video_tokens() + memory.VIDEOMME_TEXT_TOKENS
    assert memory.default_contexts("qwen3_vl_30b_a3b_thinking_fp8") == [memory.videomme_context()]
    e = memory.estimate_model(
        "qwen3_vl_30b_a3b_thinking_fp8", memory.videomme_context(), compiled=False
    )
    text = memory.estimate(
        config.get_text_config(), memory.videomme_context(), ffn_chunk_tokens=16384
    )
    assert e.kv_cache == text.kv_cache and e.activations >= text.activations
    assert e.weights == pytest.approx(
        memory.fp8_parameter_count(config) * (1 + 4 / 128**2)
        + 2 * (count - memory.fp8_parameter_count(config))
    )
    layers = memory.model_config("qwen3_vl_30b_a3b_thinking_fp8", layers=4)
    assert layers.text_config.num_hidden_layers == 4 and layers.vision_config.depth == 27


def test_memory_table_says_what_fits(capsys):
    assert memory.main(["qwen3_30b_a3b_fp8", "--contexts", "131072"]) == 0
    fp8 = capsys.readouterr().out
    e = memory.estimate_model("qwen3_30b_a3b_fp8", 131072).gib()
    assert f"| qwen3_30b_a3b_fp8 | 131072 | 1 | {e['weights']:.1f} |" in fp8
    assert memory.main(["qwen3_vl_30b_a3b_thinking_fp8"]) == 0  # at its Video-MME context
    assert f"| qwen3_vl_30b_a3b_thinking_fp8 | {memory.videomme_context()} | 1 |" in (
        capsys.readouterr().out
    )
    assert memory.main(["qwen3_32b", "--contexts", "131072", "--gpu-gib", "79"]) == 0
    one = capsys.readouterr().out
    assert "| qwen3_32b | 131072 | 1 |" in one and "no (" in one
    assert memory.main(["qwen3_32b", "--contexts", "131072", "--gpus", "2"]) == 0
    assert "| yes |" in capsys.readouterr().out
    assert memory.main(["nosuch"]) == 2
    assert "unknown model.architecture 'nosuch'" in capsys.readouterr().err
