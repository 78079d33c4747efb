"""Rehearsal checkpoints (rbs_bench.models.checkpoint): the hub's layout written shard by shard,
and loaded through exactly the path a hub id takes (`model.path`, HF_HUB_OFFLINE=1).

Where the CPU stops: transformers' FP8 quantizer needs a GPU for FP8 matmuls. On a machine without
one it loads a pre-quantised checkpoint dequantised (weight x its block's scale, in the model's
dtype: `FineGrainedFP8HfQuantizer.validate_environment` sets `dequantize`, in 5.17 and 5.24
alike), so the CPU tests load the FP8 models that way and check every weight against the
checkpoint's tensors dequantised here, run a forward and the sparse hook. The GPU path (FP8Linear
and FP8Experts modules holding the e4m3 weights and their scales) is loaded too, with the GPU
check of the quantizer switched off, to check that every tensor lands bit for bit in the module
the GPU runs; its forward needs the FP8 GEMM kernels and a GPU, so it is not run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from rbs_bench import methods, models
from rbs_bench.models import checkpoint, hf_attention, rehearsal

# Tiny dims: every linear layer a whole number of 128x128 blocks (hidden 256, 2 query heads and 1
# KV head of 128, experts of 128), 2 layers, 8 experts top-2; the real 151,936-entry vocabulary,
# so that the special tokens keep their real ids.
TINY_TEXT = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
)
TINY_MOE = TINY_TEXT | dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
TINY_VL = {
    "text_config": TINY_MOE,
    "vision_config": dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=256,
        num_position_embeddings=256,
        deepstack_visual_indexes=[0],
    ),
}
TINY = {
    "qwen3_30b_a3b_fp8": TINY_MOE,
    "qwen3_32b": TINY_TEXT,
    "qwen3_vl_30b_a3b_thinking_fp8": TINY_VL,
}
SHARD = 60 * 2**20  # several shards even at these sizes


def write_tiny(name: str, out: Path, **kw) -> Path:
    return rehearsal.write_checkpoint(
        name, out, layers=2, overrides=TINY[name], shard_bytes=SHARD, progress=False, **kw
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One tiny checkpoint of each model, written once for the module."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_tiny(name, root / name) for name in TINY}


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, in the environment and in huggingface_hub's constants (read at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def model_cfg(name: str, where, **kw):
    """The shipped conf/model/<name>.yaml with model.path set (as model=<name> model.path=...)."""
    conf = Path(__file__).parents[2] / "conf" / "model" / f"{name}.yaml"
    from rbs_bench.config import ModelCfg

    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(conf))
    return OmegaConf.merge(cfg, {"path": str(where), "dtype": "float32", **kw})


class Checkpoint:
    """The tensors of a written checkpoint, read through its index."""

    def __init__(self, path: Path):
        self.path = path
        self.index = json.loads((path / checkpoint.INDEX).read_text())["weight_map"]

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path / self.index[name]), "pt") as f:
            return f.get_tensor(name)

    def weight(self, name: str) -> torch.Tensor:
        """The float32 weight a loader must produce: dequantised where it is FP8."""
        w = self[name]
        if f"{name}_scale_inv" in self.index:
            return checkpoint.dequantize(w, self[f"{name}_scale_inv"])
        return w.float()


# --- block quantisation --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 1), (1, 300)])
def test_quantize_round_trips_within_e4m3_rounding(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    w[: min(shape[0], 128), : min(shape[1], 128)] *= 50  # blocks of very different ranges
    q, s = checkpoint.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.bfloat16 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = checkpoint.dequantize(q, s)
    scale = s.float().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal step 2^-9 of the scale;
    # the bf16 scale can round down, so the largest value may be clamped to 448 (within 2^-8)
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) + w.abs() * 2**-8
    assert ((back - w).abs() <= bound).all()
    assert (q.float().abs().amax() <= checkpoint.FP8_MAX).item()


def test_zero_block_quantizes_to_zero():
    q, s = checkpoint.quantize(torch.zeros(128, 256))
    assert (q.float() == 0).all() and (s > 0).all()
    assert (checkpoint.dequantize(q, s) == 0).all()


# --- layout --------------------------------------------------------------------------------------


def test_fp8_moe_layout_is_the_hubs(written):
    path = written["qwen3_30b_a3b_fp8"]
    ckpt = Checkpoint(path)
    names = set(ckpt.index)
    for j in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stem = f"model.layers.1.mlp.experts.{j}.{proj}.weight"
            assert {stem, stem + "_scale_inv"} <= names
    assert not any("gate_up_proj" in n for n in names)  # transformers' fused name: not on disk
    assert ckpt["model.layers.0.mlp.experts.5.up_proj.weight"].shape == (128, 256)
    assert ckpt["model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"].shape == (2, 1)
    assert ckpt["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert ckpt["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.bfloat16
    for bf16 in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"):
        assert ckpt[bf16].dtype == torch.bfloat16 and bf16 + "_scale_inv" not in names
    assert ckpt["model.norm.weight"].eq(1).all()
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(ckpt.index.values()) == set(shards)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": [
            "lm_head",
            *[
                f"model.layers.{i}.{m}"
                for i in range(2)
                for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")
            ],
        ],
    }
    # the hub's spelling, not transformers 5's
    assert config["rope_theta"] == 1e7 and config["rope_scaling"] is None
    assert "rope_parameters" not in config and config["torch_dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["architectures"]) == (2, ["Qwen3MoeForCausalLM"])
    about = json.loads((path / checkpoint.MARKER).read_text())
    assert (about["model"], about["seed"], about["device"]) == ("qwen3_30b_a3b_fp8", 0, "cpu")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [
        151645,
        151643,
    ]


def plan(name: str):
    return checkpoint.plan(name, rehearsal.checkpoint_fields(name))


def test_full_size_plans_match_the_real_models():
    """Without writing anything: the full models' tensors, sizes and shard counts."""
    config_json, config, cut = plan("qwen3_30b_a3b_fp8")
    specs = [t for shard in cut for t in shard]
    experts = [t for t in specs if ".mlp.experts." in t.name]
    assert len(experts) == 48 * 128 * 3 and all(t.fp8 for t in experts)
    params = sum(torch.Size(t.shape).numel() for t in specs)
    assert params == pytest.approx(30.53e9, rel=1e-3)  # the real model's parameter count
    assert sum(t.nbytes for t in specs) / 2**30 == pytest.approx(29.0, abs=0.3)  # FP8 + bf16
    assert len(config_json["quantization_config"]["modules_to_not_convert"]) == 1 + 3 * 48
    _, _, cut32 = plan("qwen3_32b")
    specs32 = [t for shard in cut32 for t in shard]
    assert not any(t.fp8 for t in specs32)
    assert sum(t.nbytes for t in specs32) / 2**30 == pytest.approx(61.0, abs=0.1)
    assert all(sum(t.nbytes for t in s) <= checkpoint.DEFAULT_SHARD_BYTES for s in cut32)
    vl_json, vl, cutvl = plan("qwen3_vl_30b_a3b_thinking_fp8")
    specsvl = [t for shard in cutvl for t in shard]
    assert not any(t.fp8 for t in specsvl if t.name.startswith("model.visual."))
    assert all(t.fp8 for t in specsvl if ".mlp.experts." in t.name)
    skip = vl_json["quantization_config"]["modules_to_not_convert"]
    assert len(skip) == 27 * 4 + 2 + 3 * 2 + 48 + 2
    assert vl_json["vision_config"]["model_type"] == "qwen3_vl_moe"  # as the hub spells it
    assert vl_json["text_config"]["rope_scaling"]["mrope_section"] == [24, 20, 20]


# --- loading through model.path ------------------------------------------------------------------


def test_fp8_moe_loads_dequantized_through_model_path(written, offline):
    path = written["qwen3_30b_a3b_fp8"]
    model, tok = models.load(model_cfg("qwen3_30b_a3b_fp8", path))
    ckpt = Checkpoint(path)
    layers = model.model.layers
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            got = getattr(layers[i].self_attn, proj).weight
            assert torch.equal(got, ckpt.weight(f"model.layers.{i}.self_attn.{proj}.weight"))
        experts = layers[i].mlp.experts
        for j in (0, 7):
            stem = f"model.layers.{i}.mlp.experts.{j}"
            gate_up = torch.cat(
                [ckpt.weight(f"{stem}.gate_proj.weight"), ckpt.weight(f"{stem}.up_proj.weight")]
            )
            assert torch.equal(experts.gate_up_proj[j], gate_up)
            assert torch.equal(experts.down_proj[j], ckpt.weight(f"{stem}.down_proj.weight"))
        assert torch.equal(
            layers[i].mlp.gate.weight, ckpt.weight(f"model.layers.{i}.mlp.gate.weight")
        )
    assert torch.equal(model.lm_head.weight, ckpt.weight("lm_head.weight"))
    ids = tok("<|im_start|>user\na haystack<|im_end|>", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 151644 and ids[0, -1].item() == 151645  # Qwen's ids
    run_forward_and_hook(model, ids)


def test_dense_bf16_loads_through_model_path_with_yarn(written, offline):
    path = written["qwen3_32b"]
    model, tok = models.load(model_cfg("qwen3_32b", path))
    ckpt = Checkpoint(path)
    assert ckpt["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.up_proj.weight_scale_inv" not in ckpt.index
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    for name, p in model.named_parameters():
        assert torch.equal(p, ckpt.weight(name)), name  # every tensor under its own name
    assert model.config.rope_parameters["rope_type"] == "yarn"  # conf/model/qwen3_32b.yaml's
    assert models.context_limit(model.config) == 131072
    text = models.wrap_prompt(tok, model_cfg("qwen3_32b", path), "hi")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    run_forward_and_hook(model, tok(text, return_tensors="pt").input_ids)


def test_vl_fp8_loads_per_expert_layout_through_model_path(written, offline):
    path = written["qwen3_vl_30b_a3b_thinking_fp8"]
    cfg = model_cfg("qwen3_vl_30b_a3b_thinking_fp8", path)
    model, tok = models.load(cfg)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    ckpt = Checkpoint(path)
    lm = model.model.language_model
    stem = "model.language_model.layers.1.mlp.experts.6"
    gate_up = torch.cat(
        [ckpt.weight(f"{stem}.gate_proj.weight"), ckpt.weight(f"{stem}.up_proj.weight")]
    )
    assert torch.equal(lm.layers[1].mlp.experts.gate_up_proj[6], gate_up)
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(lm.layers[0].self_attn.q_proj.weight, ckpt.weight(q))
    assert q + "_scale_inv" in ckpt.index
    qkv = "model.visual.blocks.1.attn.qkv.weight"  # the vision tower stays bf16
    assert qkv + "_scale_inv" not in ckpt.index
    assert torch.equal(model.model.visual.blocks[1].attn.qkv.weight, ckpt.weight(qkv))
    proc = models.load_video_processor(cfg, model, tok)
    assert (proc.video_token, proc.video_token_id) == ("<|video_pad|>", 151656)
    assert proc.max_pixels == checkpoint.VIDEO_PROCESSOR["size"]["longest_edge"]
    text = models.wrap_prompt(tok, cfg, "Which colour?", video=True, processor=proc)
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    attn = hf_attention.attention_modules(model)
    assert len(attn) == 2  # the language model's layers only
    run_forward_and_hook(model, tok("No video here.", return_tensors="pt").input_ids)


def run_forward_and_hook(model, ids) -> None:
    """A finite forward, then the sparse hook in place: a selector runs in every layer."""
    ids = torch.cat([ids, torch.randint(0, 256, (1, 600), generator=torch.Generator())], 1)
    with torch.inference_mode():
        dense = model(input_ids=ids, logits_to_keep=1).logits
    assert torch.isfinite(dense).all()
    layers = len(hf_attention.attention_modules(model))
    recorder = hf_attention.install(
        model, methods.build("rbs", block_size=32, alpha_base=0.9, alpha_rescue=0.9)
    )
    try:
        with torch.inference_mode():
            sparse = model(input_ids=ids, logits_to_keep=1).logits
    finally:
        hf_attention.uninstall(model)
    summary = recorder.summary()
    assert summary["num_layers"] == layers and summary["density_mean"] < 1.0
    assert torch.isfinite(sparse).all()


def test_gpu_modules_hold_the_fp8_tensors_bit_for_bit(written, monkeypatch):
    """The modules transformers' FP8 path runs on a GPU (FP8Linear, FP8Experts) receive the
    checkpoint's e4m3 weights and scales unchanged; their forward needs a GPU (not run here)."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)
    path = written["qwen3_30b_a3b_fp8"]
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ckpt = Checkpoint(path)
    attn, experts = model.model.layers[1].self_attn.q_proj, model.model.layers[1].mlp.experts
    assert (type(attn).__name__, type(experts).__name__) == ("FP8Linear", "FP8Experts")
    stem = "model.layers.1.self_attn.q_proj.weight"

    def bits(t):
        return t.contiguous().view(torch.uint8)

    assert torch.equal(bits(attn.weight), bits(ckpt[stem]))
    assert torch.equal(attn.weight_scale_inv.float(), ckpt[stem + "_scale_inv"].float())
    e = "model.layers.1.mlp.experts.4"
    gate_up = torch.cat([ckpt[f"{e}.gate_proj.weight"], ckpt[f"{e}.up_proj.weight"]])
    assert torch.equal(bits(experts.gate_up_proj[4]), bits(gate_up))
    scales = torch.cat(
        [ckpt[f"{e}.gate_proj.weight_scale_inv"], ckpt[f"{e}.up_proj.weight_scale_inv"]]
    )
    assert torch.equal(experts.gate_up_proj_scale_inv[4].float(), scales.float())
    assert type(model.lm_head).__name__ == "Linear"  # modules_to_not_convert stay bf16
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16


# --- writing: resumable, atomic, checked -----------------------------------------------------


def test_killed_write_leaves_nothing_that_loads_and_resumes(tmp_path, monkeypatch, offline):
    out = tmp_path / "moe"
    real = checkpoint.shard_tensors
    calls = []

    def dies_on_second(shard, seed, device):
        calls.append(shard[0].name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed mid-write
        return real(shard, seed, device)

    monkeypatch.setattr(checkpoint, "shard_tensors", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        write_tiny("qwen3_30b_a3b_fp8", out)
    assert not out.exists()
    partial = tmp_path / "moe.partial"
    assert [p.name for p in partial.glob("*.safetensors")] == [checkpoint.shard_name(0, 3)]
    with pytest.raises(ValueError, match=r"moe.partial is an unfinished write\); rerun the same"):
        models.load(model_cfg("qwen3_30b_a3b_fp8", out))
    with pytest.raises(ValueError, match=r"unfinished write with other settings"):
        write_tiny("qwen3_30b_a3b_fp8", out, seed=5)
    monkeypatch.setattr(checkpoint, "shard_tensors", real)
    calls.clear()
    write_tiny("qwen3_30b_a3b_fp8", out)  # resumes: the finished shard is kept
    assert not partial.exists() and (out / "config.json").is_file()
    fresh = write_tiny("qwen3_30b_a3b_fp8", tmp_path / "fresh")
    for shard in sorted(out.glob("*.safetensors")):
        assert shard.read_bytes() == (fresh / shard.name).read_bytes()  # seeded per tensor
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    write_tiny("qwen3_30b_a3b_fp8", out)  # finished, same settings: left as it is
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ValueError, match=r"exists and is not this rehearsal checkpoint"):
        write_tiny("qwen3_32b", out)


def test_seed_changes_the_weights(tmp_path):
    a = Checkpoint(write_tiny("qwen3_32b", tmp_path / "a"))
    b = Checkpoint(write_tiny("qwen3_32b", tmp_path / "b", seed=1))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(a[name], b[name])
    assert a[name].float().std().item() == pytest.approx(0.02, rel=0.05)  # initializer_range


def test_weights_digest_follows_the_content_not_the_copy(tmp_path):
    """The same seed written twice (new files, new times) and a copy that keeps no times: one
    digest, so a node's local copy resumes cells made elsewhere; another seed or one edited
    tensor in the middle of a shard: another digest."""
    a = write_tiny("qwen3_32b", tmp_path / "a")
    again = write_tiny("qwen3_32b", tmp_path / "again")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in a.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())  # new modification times
    other = write_tiny("qwen3_32b", tmp_path / "other", seed=1)
    digest = models.local_digest(a)
    assert models.local_digest(again) == models.local_digest(copy) == digest
    assert models.local_digest(other) != digest
    shard = max(copy.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with safe_open(str(shard), "pt") as f:
        names = sorted(f.keys())
    meta = json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    start += meta[names[len(names) // 2]]["data_offsets"][0]
    data = bytearray(shard.read_bytes())
    data[start] ^= 0xFF  # one byte of one tensor, same names, shapes and size
    shard.write_bytes(bytes(data))
    assert models.local_digest(copy) != digest


def test_bad_model_path_is_one_line(tmp_path, offline):
    cfg = model_cfg("qwen3_30b_a3b_fp8", tmp_path / "nope")
    with pytest.raises(
        ValueError,
        match=r"model.path=.*nope is not a directory; .* write one: "
        r"python -m rbs_bench.models.rehearsal write --model qwen3_30b_a3b_fp8",
    ):
        models.load(cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"model.path=.*empty holds no config.json"):
        models.load(model_cfg("qwen3_30b_a3b_fp8", tmp_path / "empty"))
    random = model_cfg("qwen3_30b_a3b_random", tmp_path)
    with pytest.raises(ValueError, match=r"sets both random_init and path="):
        models.load(random)


def test_hf_id_as_a_local_directory_still_loads(written, offline):
    path = written["qwen3_32b"]
    cfg = model_cfg("qwen3_32b", path, path=None, hf_id=str(path))
    model, _ = models.load(cfg)
    assert model.config.num_hidden_layers == 2


def test_command_line_write_and_its_errors(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "rbs_bench.models.rehearsal", "write", *args],
            capture_output=True,
            text=True,
        )

    bad = run("--model", "qwen3_30b_a3b_fp8", "--out", str(tmp_path / "x"), "--device", "cuda")
    if not torch.cuda.is_available():
        assert bad.returncode == 2
        assert bad.stderr.strip() == (
            "rbs-bench: error: --device cuda but no CUDA device is visible; use --device cpu"
        )
    unknown = run("--model", "gpt5", "--out", str(tmp_path / "y"))
    assert unknown.returncode == 2 and "invalid choice: 'gpt5'" in unknown.stderr
