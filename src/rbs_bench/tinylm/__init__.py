"""The embedded tiny retrieval LM: its training mixture, trainer, evaluation and shipped weights.

- `data`: the synthetic long-context mixture (key-value and passkey retrieval, multi-needle
  retrieval, variable-assignment chains, word counting) in its own phrasing; RULER stays held out.
- `train`: `python -m rbs_bench.tinylm.train`, seeded, resumable, with a loss/accuracy log.
- `evaluate`: dense RULER accuracy of a trained model through the benchmark runner.
- `weights/`: the shipped model (`model=tiny`), tokenizer and model card.

Importing this package is cheap: torch and transformers are imported by the submodules only.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def weights_dir() -> Path:
    """Directory of the shipped model: config, safetensors weights, tokenizer and model card."""
    return Path(str(files("rbs_bench.tinylm").joinpath("weights")))
