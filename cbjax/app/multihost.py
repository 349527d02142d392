"""A multi-host run's start-up (the run layer): join the process group, then process 0 serves
and the others follow its steps (`cbjax.runtime.distributed.PlanLink`)."""

from __future__ import annotations

import dataclasses
import logging

from cbjax.config import RunConfig
from cbjax.app.run import build_executor
from cbjax.runtime.distributed import check_same_config, initialize

log = logging.getLogger("cbjax")


def start(cfg: RunConfig, *, multirun: bool = False) -> bool:
    """Join the process group; a process other than 0 then follows process 0's steps to the
    end and returns True (it writes nothing), process 0 returns False and serves."""
    if multirun:  # a job process 0 skips as complete would leave the others waiting
        raise ValueError("distributed.num_processes: a multi-host run serves one config, not a multirun (-m)")
    initialize(cfg.distributed)
    check_same_config(cfg)  # before any process builds its executor on settings the others lack
    if cfg.distributed.process_id == 0:
        return False
    follow(cfg)
    return True


def follow(cfg: RunConfig) -> None:
    """A process other than 0: build the executor, warm up, then run the steps process 0 sends."""
    initialize(cfg.distributed)
    executor = build_executor(dataclasses.replace(cfg, progress=False))
    executor.warmup()
    num_steps = executor.follow()
    compiles = executor.metrics()["compiles_after_warmup"]
    log.info(f"distributed: process {cfg.distributed.process_id} ran {num_steps} steps, {compiles} compiles after warmup")
