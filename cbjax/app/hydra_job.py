"""The Hydra side of a `cbjax` job: sweep resume, tracking and the sweeper's objective.

Imported only by cbjax.app.cli and by Hydra (the root config names ResumeCallback), like the CLI.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from cbjax.config import RunConfig
from cbjax.config.help import help_page
from cbjax.report.files import unwritable
from cbjax.app.sweep import clear_skipped, comparable_config, count_skipped, run_job

log = logging.getLogger(__name__)


def run_id() -> str:
    """The part of a run's folder name that no other run has: this process's id (unique among
    the host's live processes) and a random tag (hosts sharing a filesystem), e.g. `4321-9f3a`."""
    return f"{os.getpid()}-{secrets.token_hex(2)}"


def register_resolvers() -> None:
    """`${cbjax.run_id:}` for configs/config.yaml's hydra.run.dir and hydra.sweep.dir. Cached
    like Hydra's `${now:}`: every reading of the config (and each sweep job's, which Hydra copies
    the cache into) sees one value per process. `${cbjax.help:COMMAND}`: a command's --help page
    (the root configs' hydra.help.template)."""
    OmegaConf.register_new_resolver("cbjax.run_id", run_id, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("cbjax.help", help_page, replace=True)


class FromLoggers(logging.Filter):
    """Passes the records of the loggers `names` and their children; with `invert`, every other
    record (configs/hydra/job_logging/cbjax.yaml: cbjax's to stdout, other libraries' to stderr)."""

    def __init__(self, names: list[str], invert: bool = False):
        super().__init__()
        self.prefixes = tuple(names)
        self.invert = invert

    def filter(self, record: logging.LogRecord) -> bool:
        ours = any(record.name == p or record.name.startswith(p + ".") for p in self.prefixes)
        return ours != self.invert


def run_hydra_job(
    cfg: RunConfig, out_dir: Path, hydra_cfg: DictConfig, run: Optional[Callable[..., dict[str, Any]]] = None
) -> Optional[float]:
    """Run (or, in a multirun, resume) one job and log it to the configured tracker.

    `run(cfg, out_dir)` serves and writes the outputs; default cbjax.app.run.run_experiment."""
    if run is None:
        from cbjax.app.run import run_experiment as run

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    track = None
    if cfg.logger.name != "none":
        from cbjax.app import tracking

        tracking.check_available(cfg.logger)
        root = Path(hydra_cfg.sweep.dir) if multirun else out_dir
        tracking.check_store(cfg.logger, root)
        name = (hydra_cfg.job.override_dirname if multirun else "") or out_dir.name
        track = lambda summaries: tracking.log_run(  # noqa: E731
            cfg.logger,
            out_dir=out_dir,
            root=root,
            run_name=name,
            config=comparable_config(cfg),
            summaries=summaries,
            arms=bool(cfg.experiment.arms),
        )
    return run_job(cfg, out_dir, run, resume=multirun, track=track)


class ResumeCallback(Callback):
    """Says how many jobs of a multirun were skipped as already complete (see cbjax.app.sweep).

    Runs on the launching machine: it clears the previous invocation's skip marks before any
    job starts and counts the new ones after every job has returned."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        clear_skipped(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        skipped, complete = count_skipped(sweep_dir)
        if config.get("overwrite"):
            log.info(f"sweep: overwrite=true, every job ran; {complete} complete jobs in {sweep_dir}")
        else:
            log.info(
                f"sweep: skipped {skipped} jobs already complete with the same config; "
                f"{complete} complete jobs in {sweep_dir} (overwrite=true reruns all)"
            )


class OutputDirCallback(Callback):
    """Fails in one line, before Hydra makes the run's folder (its own error is a traceback)
    and before any work, when the run or sweep folder cannot be created or written. `prog`:
    the command that says so (cbjax, cbjax-serve, cbjax-bench)."""

    def __init__(self, prog: str = "cbjax"):
        self.prog = prog

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._require_writable(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._require_writable(Path(config.hydra.sweep.dir))

    def _require_writable(self, directory: Path) -> None:
        problem = unwritable(directory)
        if problem is not None:
            print(f"{self.prog}: error: {problem}; choose another with hydra.run.dir (or hydra.sweep.dir)", file=sys.stderr)
            sys.exit(1)
