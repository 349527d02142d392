"""The `cbjax` command: a Hydra app over the typed RunConfig (the only module that imports Hydra)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cbjax.config import RunConfig

CONFIG_DIR = Path(os.environ.get("CBJAX_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))

ConfigStore.instance().store(name="base_config", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Resolve a composed Hydra config into the checked dataclasses."""
    return OmegaConf.to_object(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _app(cfg: DictConfig) -> Optional[float]:
    from cbjax.hydra_job import run_hydra_job

    try:
        run_cfg = to_run_config(cfg)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        objective = run_hydra_job(run_cfg, out_dir, HydraConfig.get())
    except ValueError as err:
        print(f"cbjax: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"\noutputs: {out_dir}")
    return objective  # a sweeper's objective (optimized_metric); None otherwise


def main() -> None:
    if not (CONFIG_DIR / "config.yaml").is_file():
        sys.exit(f"cbjax: error: no configs at {CONFIG_DIR}; set CBJAX_CONFIG_DIR to the repository's configs/")
    _app()
