"""The `cbjax-bench` command: a Hydra app over BenchConfig (cbjax's workload and SLO groups plus `bench`)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cbjax.bench.config import BenchConfig
from cbjax.app.cli import CONFIG_PATH, preflight, quiet_broken_pipe
from cbjax.app.config_merge import typed_config
from cbjax.core.stop import StopFlag

ConfigStore.instance().store(name="bench_base_config", node=BenchConfig)
STOP = StopFlag()  # set by SIGINT/SIGTERM while the app runs


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="bench")
def _app(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        from cbjax.bench.run import run_bench
    except ModuleNotFoundError as err:
        if err.name != "aiohttp":
            raise
        print("cbjax-bench: error: its HTTP client, aiohttp, is not installed: pip install 'cbjax[bench]'", file=sys.stderr)
        sys.exit(2)
    try:
        run_bench(typed_config(cfg, BenchConfig), out_dir, stop=STOP)
    except ValueError as err:
        print(f"cbjax-bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    if STOP.is_set():
        print(f"cbjax-bench: interrupted by {STOP.name}; the requests sent are saved in {out_dir}", file=sys.stderr)
        sys.exit(130)
    print(f"\noutputs: {out_dir}")


@quiet_broken_pipe
def main() -> None:
    preflight("cbjax-bench", "bench", BenchConfig)
    try:
        with STOP.catching():  # a signal while the files are written waits for them
            _app()
    except KeyboardInterrupt:  # a signal before the handlers were installed
        print("cbjax-bench: interrupted before the load started", file=sys.stderr)
        sys.exit(130)
