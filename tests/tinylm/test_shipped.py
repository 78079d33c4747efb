"""The shipped tiny LM: `model=tiny` loads it, its files fit the package, and it retrieves."""

import hashlib
import json

import pytest
import torch
from hydra import compose, initialize_config_module

from rbs_bench import config, models, tinylm
from rbs_bench.models import tiny

config.register_schemas()
WEIGHTS = tinylm.weights_dir()


def _model_cfg(name):
    with initialize_config_module(config_module=config.CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=[f"model={name}"]).model


def test_model_tiny_loads_the_shipped_weights():
    from safetensors.torch import load_file

    cfg = _model_cfg("tiny")
    assert cfg.name == "tiny" and cfg.hf_id is None and not cfg.chat_template
    assert tiny.trained_dir() == WEIGHTS
    model, tok = models.load(cfg)
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim) == (6, 256, 64)
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 2)
    assert c._attn_implementation == models.ATTN_IMPL and model.dtype == torch.float32
    shipped = load_file(WEIGHTS / "model.safetensors")
    state = model.state_dict()
    for name, tensor in shipped.items():
        assert torch.equal(state[name], tensor.float()), name
    assert tok.eos_token_id == 256 and tok.decode(tok.encode("ab 12")) == "ab 12"


def test_tiny_random_stays_the_small_random_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RBS_BENCH_CACHE", str(tmp_path))
    model, _ = models.load(_model_cfg("tiny_random"))
    assert model.config.num_hidden_layers == tiny.TINY_CONFIG["num_hidden_layers"]
    built = tiny.build_model().state_dict()
    assert all(torch.equal(p, built[n]) for n, p in model.state_dict().items())


def test_shipped_files_fit_the_package():
    from safetensors import safe_open

    weights = WEIGHTS / "model.safetensors"
    assert weights.stat().st_size <= 15 * 2**20  # and so the whole model <= 30 MB
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # the tokenizer is the byte-level one the package builds
    built = tiny.build_tokenizer()
    shipped = json.loads((WEIGHTS / "tokenizer.json").read_text())
    assert (
        shipped["model"]["vocab"] == json.loads(built.backend_tokenizer.to_str())["model"]["vocab"]
    )
    # the model card describes these weights and shows its loss curve
    card = (WEIGHTS / "README.md").read_text()
    assert hashlib.sha256(weights.read_bytes()).hexdigest() in card
    assert "loss_curve.png" in card and (WEIGHTS / "loss_curve.png").is_file()


@pytest.mark.slow
def test_shipped_model_retrieves_a_ruler_needle_among_distractors():
    from rbs_bench.benchmarks import ruler
    from rbs_bench.models.generate import greedy_generate

    model, tok = models.load(_model_cfg("tiny"))
    (sample,) = ruler.generate("niah_multikey_2", 1024, 1, models.encoder(tok), seed=7)
    ids = tok(sample.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    new, _, _, decode = greedy_generate(model, ids, 12, {tok.eos_token_id})
    pred = tok.decode(new, skip_special_tokens=True)
    assert decode == "eager"  # CUDA graphs are for CUDA
    assert ruler.score_one("niah_multikey_2", pred, sample.references) == 100.0, pred
