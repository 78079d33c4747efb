"""Optional mirrors of run records (logger=wandb). The JSONL records stay the source of truth.

`logger=wandb` logs, into one Weights & Biases run per process (one per grid cell under -m):
the composed config; per sample, its score, density and timings as they are recorded; at the end,
the samples this run recorded as a table (`records`), every summary CSV of the experiment as a
table (`summary`, `summary_by_task`, ...) and every figure beside them as an image. The run lands
in `<experiment dir>/wandb/` (ignored by git). Compute nodes without internet keep the default
`logger.mode=offline` (or set WANDB_MODE=offline, which wins over logger.mode) and upload later
with `wandb sync <that dir>/offline-run-*`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rbs_bench.errors import UserError

MODES = ("online", "offline", "disabled")
SAMPLE_SCALARS = ("score", "density", "ttft_s", "selector_s", "attention_s")


class NullLogger:
    def log_sample(self, rec: dict) -> None:
        pass

    def log_summary(self, exp_dir: Path) -> None:
        pass

    def finish(self) -> None:
        pass


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def records_table_rows(records: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, rows) of run records for a table: nested fields become JSON text."""
    columns = sorted({k for rec in records for k in rec})
    rows = [
        [
            json.dumps(rec[c], sort_keys=True)
            if isinstance(rec.get(c), (dict, list))
            else rec.get(c)
            for c in columns
        ]
        for rec in records
    ]
    return columns, rows


class WandbLogger(NullLogger):
    def __init__(self, cfg: DictConfig, run_dir: Path, name: str):
        try:
            import wandb
        except ImportError:
            raise UserError("logger=wandb needs wandb: pip install 'rbs-bench[wandb]'") from None
        mode = os.environ.get("WANDB_MODE") or cfg.logger.mode
        if mode not in MODES:
            raise UserError(
                f"wandb mode {mode!r} (logger.mode, or WANDB_MODE if set) is not one of "
                f"{', '.join(MODES)}"
            )
        self.wandb = wandb
        self.records: list[dict] = []
        group = f"{name}/{cfg.model.name}"
        cell = f"{group}/{cfg.method.name}/{cfg.budget.name}"
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=mode,
            dir=str(run_dir),
            group=group,
            name=cell if _is_multirun() else group,
            config=OmegaConf.to_container(cfg, resolve=True) | {"experiment": name},
        )

    def log_sample(self, rec: dict) -> None:
        prefix = f"{rec['method']}/{rec['budget']}"
        self.run.log({f"{prefix}/{k}": rec[k] for k in SAMPLE_SCALARS if k in rec})
        self.records.append(rec)

    def log_summary(self, exp_dir: Path) -> None:
        import pandas as pd

        exp_dir = Path(exp_dir)
        media = {}
        if self.records:
            columns, rows = records_table_rows(self.records)
            media["records"] = self.wandb.Table(columns=columns, data=rows)
        for csv in sorted(exp_dir.glob("summary*.csv")):
            media[csv.stem] = self.wandb.Table(dataframe=pd.read_csv(csv))
        for png in sorted(exp_dir.glob("*.png")):
            media[png.stem] = self.wandb.Image(str(png))
        if media:
            self.run.log(media)

    def finish(self) -> None:
        self.run.finish()


def make_logger(cfg: DictConfig, run_dir: Path, name: str):
    if cfg.logger.name == "none":
        return NullLogger()
    if cfg.logger.name == "wandb":
        return WandbLogger(cfg, run_dir, name)
    raise UserError(f"unknown logger {cfg.logger.name!r}; valid: none, wandb")
