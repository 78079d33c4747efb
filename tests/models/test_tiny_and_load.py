"""The embedded tiny model and `rbs_bench.models.load` (no hub access anywhere)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rbs_bench import models
from rbs_bench.models import tiny

TEXT = "Hello wörld,\n\tsparse   prefill! 漢字 🙂 <|im_start|>"


def tiny_cfg(**overrides):
    fields = dict(
        name="tiny_random",  # the random-weight builder; the shipped model: tests/tinylm
        hf_id=None,
        revision=None,
        max_context=4096,
        dtype="auto",
        chat_template=True,
        chat_template_kwargs={},
        trust_remote_code=False,
        config_overrides={},
    )
    return SimpleNamespace(**{**fields, **overrides})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_materialize_is_deterministic_and_keeps_rng(tmp_path):
    state = torch.get_rng_state()
    a = tiny.materialize(tmp_path / "a")
    b = tiny.materialize(tmp_path / "b")
    assert torch.equal(torch.get_rng_state(), state)
    assert a.name == b.name and a.name.startswith("tiny-qwen3-")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny.materialize(tmp_path / "a") == a  # present: not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "a").iterdir()] == [a.name]  # no temp dir left behind


def test_materialize_default_dir_from_env(cache):
    assert tiny.materialize().parent == cache


def test_tiny_loads_with_from_pretrained_and_tokenizer_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.materialize(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(tok) <= model.config.vocab_size
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 258
    # same weights as the in-memory builder
    built = tiny.build_model().state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, built[name]), name


def test_load_tiny(cache):
    model, tok = models.load(tiny_cfg())
    assert model.config._attn_implementation == models.ATTN_IMPL and not model.training
    assert model.dtype == torch.float32
    cfg = tiny_cfg()
    prompt = models.wrap_prompt(tok, cfg, "What is RBS?")
    assert prompt == "<|im_start|>user\nWhat is RBS?<|im_end|>\n<|im_start|>assistant\n"
    assert models.wrap_prompt(tok, tiny_cfg(chat_template=False), "raw") == "raw"
    ids = models.encoder(tok).encode(prompt)
    assert ids[0] == 257 and tok.decode(ids) == prompt  # no special token added in front
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), model.config.vocab_size)

    rec = models.install(model, SimpleNamespace(is_dense=True, block_size=64, name="dense"))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=torch.tensor([ids])).logits, out)
    assert rec.summary()["num_layers"] == tiny.TINY_CONFIG["num_hidden_layers"]


def test_load_bfloat16(cache):
    model, _ = models.load(tiny_cfg(dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_load_errors_are_one_line(cache, monkeypatch):
    with pytest.raises(ValueError, match="max_context=100000 exceeds"):
        models.load(tiny_cfg(max_context=100_000))
    with pytest.raises(ValueError, match="model.dtype"):
        models.load(tiny_cfg(dtype="fp8"))
    with pytest.raises(ValueError, match="not a directory"):
        models.load(tiny_cfg(hf_id="/nonexistent/model/dir"))

    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError, match="'Qwen/Qwen3-8B'.*model.path=/local/path") as e:
        models.load(tiny_cfg(hf_id="Qwen/Qwen3-8B"))
    assert "\n" not in str(e.value)


def test_missing_chat_template_is_reported(cache):
    _, tok = models.load(tiny_cfg())
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template=false"):
        models.wrap_prompt(tok, tiny_cfg(), "x")


def test_import_is_cheap():
    code = (
        "import sys, rbs_bench.models; print('transformers' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_config_overrides_reach_the_model_config(cache):
    from omegaconf import OmegaConf

    overrides = OmegaConf.create(
        {
            "max_position_embeddings": 65536,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        }
    )
    model, _ = models.load(tiny_cfg(max_context=65536, config_overrides=overrides))
    assert model.config.max_position_embeddings == 65536
    assert model.config.rope_parameters["rope_theta"] == 5e5
    with pytest.raises(ValueError, match="exceeds what tiny_random allows"):
        models.load(tiny_cfg(max_context=65537, config_overrides=overrides))


def test_the_shipped_weights_digest_keeps_other_weights_out_of_records(tmp_path, monkeypatch):
    """Run records and calibrations of model=tiny carry its weights' digest, so results made with
    retrained weights under the same name are refused instead of resumed or looked up."""
    import hashlib

    from omegaconf import OmegaConf

    from rbs_bench.config import UserError
    from rbs_bench.records import check_fingerprint

    trained = OmegaConf.create(vars(tiny_cfg(name="tiny")))
    data = (tiny.trained_dir() / "model.safetensors").read_bytes()
    assert models.weights_digest(trained) == hashlib.sha256(data).hexdigest()[:16]
    assert models.identity(trained)["weights"] == models.weights_digest(trained)
    for other in (tiny_cfg(), tiny_cfg(name="tiny_vl"), tiny_cfg(name="x", hf_id="Qwen/Qwen3-8B")):
        assert models.weights_digest(other) is None
        assert "weights" not in models.identity(OmegaConf.create(vars(other)))

    check_fingerprint(tmp_path / "cell.json", {"model": models.identity(trained)})
    monkeypatch.setattr(models, "_file_digest", lambda path: "0" * 16)  # retrained weights
    with pytest.raises(UserError, match="made with model="):
        check_fingerprint(tmp_path / "cell.json", {"model": models.identity(trained)})
