"""The `cbjax-bench` command: a Hydra app over BenchConfig (cbjax's workload and SLO groups plus `bench`)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cbjax.bench.config import BenchConfig
from cbjax.app.cli import CONFIG_PATH, preflight
from cbjax.app.config_merge import typed_config

ConfigStore.instance().store(name="bench_base_config", node=BenchConfig)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="bench")
def _app(cfg: DictConfig) -> None:
    from cbjax.bench.run import run_bench

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_bench(typed_config(cfg, BenchConfig), out_dir)
    except ValueError as err:
        print(f"cbjax-bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"\noutputs: {out_dir}")


def main() -> None:
    preflight("cbjax-bench", "bench", BenchConfig)
    _app()
