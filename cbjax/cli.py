"""The `cbjax` command: a Hydra app over the typed RunConfig (the only module that imports Hydra)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cbjax.config import RunConfig
from cbjax.config_merge import to_run_config

CONFIG_DIR = Path(os.environ.get("CBJAX_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))

ConfigStore.instance().store(name="base_config", node=RunConfig)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _app(cfg: DictConfig) -> None:
    from cbjax.run import run_experiment

    try:
        run_cfg = to_run_config(cfg)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        run_experiment(run_cfg, out_dir)
    except ValueError as err:
        print(f"cbjax: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"\noutputs: {out_dir}")


def main() -> None:
    # A plug-in policy (scheduler.policy_class) is found in the working directory, as with `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not (CONFIG_DIR / "config.yaml").is_file():
        sys.exit(f"cbjax: error: no configs at {CONFIG_DIR}; set CBJAX_CONFIG_DIR to the repository's configs/")
    _app()
