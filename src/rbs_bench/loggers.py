"""Optional mirrors of run records (logger=wandb). The JSONL records stay the source of truth."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rbs_bench.config import UserError


class NullLogger:
    def log_sample(self, rec: dict) -> None:
        pass

    def log_summary(self, exp_dir: Path) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    def __init__(self, cfg: DictConfig, run_dir: Path, name: str):
        try:
            import wandb
        except ImportError:
            raise UserError("logger=wandb needs wandb: pip install 'rbs-bench[wandb]'") from None
        self.wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=cfg.logger.mode,
            dir=str(run_dir),
            name=name,
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    def log_sample(self, rec: dict) -> None:
        self.run.log(
            {
                f"{rec['method']}/{rec['budget']}/{k}": rec[k]
                for k in ("score", "density", "ttft_s", "selector_s", "attention_s")
            }
        )

    def log_summary(self, exp_dir: Path) -> None:
        import pandas as pd

        summary = exp_dir / "summary.csv"
        if summary.exists():
            self.run.log(
                {
                    "summary": self.wandb.Table(dataframe=pd.read_csv(summary)),
                    "score_vs_density": self.wandb.Image(str(exp_dir / "score_vs_density.png")),
                }
            )

    def finish(self) -> None:
        self.run.finish()


def make_logger(cfg: DictConfig, run_dir: Path, name: str):
    if cfg.logger.name == "none":
        return NullLogger()
    if cfg.logger.name == "wandb":
        return WandbLogger(cfg, run_dir, name)
    raise UserError(f"unknown logger {cfg.logger.name!r}; valid: none, wandb")
