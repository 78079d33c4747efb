"""The embedded tiny models: a byte-level tokenizer, the shipped trained model and a random one.

`model=tiny` (the default) is the trained retrieval LM shipped in `rbs_bench/tinylm/weights`
(`trained_dir()`; how it was trained: `rbs_bench.tinylm` and the model card there). Its
tokenizer is `build_tokenizer()`.

`model=tiny_random` is a smaller random-weight Qwen3 with the same tokenizer, for fast tests of
the harness: built deterministically from `TINY_CONFIG` and a fixed seed, saved once into a cache
directory (`materialize()`). Both load through the same `from_pretrained` path as every hub model,
so nothing downstream special-cases them. The random model's predictions are noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# Bump when the builder changes what it writes (weights, tokenizer, template); it is in the hash.
BUILDER_VERSION = 1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258

# Qwen3Config kwargs. Head dim 64 and GQA 2:1 keep the attention shapes realistic; the vocabulary
# covers the 256 bytes plus the special tokens.
TINY_CONFIG: dict = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": 256,
    "pad_token_id": 256,
}

# ChatML, as the Qwen family uses; `enable_thinking` is accepted and ignored.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_config(**overrides):
    """A `Qwen3Config` of the tiny model, with any field overridden (for unit tests)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY_CONFIG, **overrides})


def config_hash() -> str:
    """Short hash of the config and builder version: names the cache directory."""
    blob = json.dumps(
        {"config": TINY_CONFIG, "builder": BUILDER_VERSION, "chat": CHAT_TEMPLATE}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    env = os.environ.get("RBS_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rbs_bench" / "models"


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte 0..255, in byte order (GPT-2's scheme)."""
    # Bytes that are printable Latin-1 stand for themselves; the rest are shifted past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    keep = set(printable)
    symbols, shift = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


def build_tokenizer(special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE):
    """Byte-level BPE with no merges: every byte is a token, so any text round-trips.

    The special tokens follow the bytes (ids 256, 257, ...); the first is end-of-text and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=special_tokens[0],
        pad_token=special_tokens[0],
        additional_special_tokens=list(special_tokens[1:]),
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = chat_template
    return fast


def build_model(config=None):
    """Random-init tiny Qwen3 (seed 0), without touching the caller's RNG state."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = config if config is not None else tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    return model.eval()


def trained_dir() -> Path:
    """Directory of the shipped trained model (config, safetensors weights, tokenizer): the
    package data `tinylm/weights/` (rbs_bench.tinylm trains it)."""
    path = Path(__file__).resolve().parents[1] / "tinylm" / "weights"
    if not (path / "model.safetensors").is_file():
        raise ValueError(
            f"the shipped tiny model is missing ({path / 'model.safetensors'}); reinstall "
            f"rbs-bench, or use model=tiny_random for the random-weight model"
        )
    return path


def materialize(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the saved tiny model + tokenizer, building it there first if it is missing.

    The directory is `<cache_dir>/tiny-qwen3-<hash>`; it is written to a temporary sibling and
    renamed into place, so a crash or a concurrent writer never leaves a half-written model.
    """

    def write(tmp: Path) -> None:
        build_model().save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)

    return save_once(cache_dir, f"tiny-qwen3-{config_hash()}", write)


def _umask() -> int:
    """This process's umask, read without changing it (Linux reports it in /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore it at once
    os.umask(mask)
    return mask


def _umask_modes(folder: Path) -> None:
    """Give a folder written here and everything in it the modes `open` and `mkdir` would give
    under the umask (0o666 / 0o777 less it), whatever the writers chose."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def save_once(cache_dir: str | os.PathLike | None, name: str, write) -> Path:
    """`<cache_dir>/<name>`, made by `write(tmp_dir)` and renamed into place if it is missing."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write(tmp)
        _umask_modes(tmp)  # mkdtemp and safetensors make them owner-only; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
