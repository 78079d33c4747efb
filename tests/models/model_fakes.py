"""Small random HF models and fake selectors for the model-integration tests (a helper module;
`tests/models` is on sys.path under pytest's default import mode)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rbs_bench.methods.selection import BlockSelection, causal_block_mask

BLOCK = 64
N_TOKENS = 300  # 5 blocks of 64, the last one partial


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM, cfg


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return Qwen3MoeForCausalLM, cfg


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM, cfg


BUILDERS = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "llama": _llama}


def make_model(arch: str = "qwen3", attn: str = "sdpa", **overrides):
    """A random fp32 model in eval mode (seed 0), with the given attention implementation."""
    cls, cfg = BUILDERS[arch]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg)
    return model.float().eval()


def random_ids(n: int = N_TOKENS, batch: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


@dataclass
class KeepAll:
    """Non-dense selector that keeps every causal block: must reproduce dense attention."""

    block_size: int = BLOCK
    name: str = "keep_all"
    is_dense: bool = False
    calls: list = field(default_factory=list)

    def select(self, q, k, scale=None) -> BlockSelection:
        self.calls.append(tuple(q.shape))
        b, h, n, _ = q.shape
        return BlockSelection.full(b, h, n, self.block_size, q.device)


@dataclass
class SinkAndDiagonal:
    """Keeps key block 0 and the diagonal, plus every block of query heads >= `full_from`."""

    block_size: int = BLOCK
    full_from: int = 2
    name: str = "sink_diag"
    is_dense: bool = False

    def select(self, q, k, scale=None) -> BlockSelection:
        b, h, n, _ = q.shape
        causal = causal_block_mask(n, self.block_size, self.block_size, q.device)
        m = causal.shape[0]
        keep = torch.eye(m, dtype=torch.bool, device=q.device)
        keep[:, 0] = True
        keep = keep.expand(b, h, m, m).clone()
        keep[:, self.full_from :] = causal
        return BlockSelection.from_mask(keep, self.block_size, self.block_size, n)


@dataclass
class FakeDense:
    block_size: int = BLOCK
    name: str = "fake_dense"
    is_dense: bool = True

    def select(self, q, k, scale=None) -> BlockSelection:  # never called by the hook
        raise AssertionError("a dense selector must not be asked to select")


def dispatch_layers(model, layer_devices: list[str], offload_dir):
    """The model spread by accelerate with decoder layer i on `layer_devices[i]` ("cpu", or
    "disk": its weights stay on the meta device until the layer runs and its hooks bring them)
    and everything else on the CPU."""
    from accelerate import dispatch_model

    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        **{f"model.layers.{i}": device for i, device in enumerate(layer_devices)},
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    return dispatch_model(model, device_map=device_map, offload_dir=str(offload_dir))
