"""The `cbjax` command: a Hydra app over the typed RunConfig (the only module that imports Hydra)."""

from __future__ import annotations

import functools
import importlib.resources
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from omegaconf import DictConfig

from cbjax.config import RunConfig
from cbjax.app.config_merge import group_type, scalar_for_group, to_run_config
from cbjax.app.hydra_job import register_resolvers, run_hydra_job
from cbjax.app.tracking import TrackingError
from cbjax.core.stop import StopFlag

# configs/ sits at the repository's top level and ships in the package as `cbjax.configs`.
# A source checkout (PYTHONPATH or editable) reads its own configs/; an installed wheel reads
# the package's. CBJAX_CONFIG_DIR overrides both.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = Path(os.environ.get("CBJAX_CONFIG_DIR", SOURCE_ROOT / "configs"))
IN_SOURCE_TREE = "CBJAX_CONFIG_DIR" in os.environ or (
    (SOURCE_ROOT / "pyproject.toml").is_file() and (CONFIG_DIR / "config.yaml").is_file()
)
CONFIG_PATH = str(CONFIG_DIR) if IN_SOURCE_TREE else "pkg://cbjax.configs"

ConfigStore.instance().store(name="base_config", node=RunConfig)
register_resolvers()  # before Hydra reads hydra.run.dir

log = logging.getLogger("cbjax")
STOP = StopFlag()  # set by SIGINT/SIGTERM while the app runs


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _app(cfg: DictConfig) -> Optional[float]:
    from cbjax.app.run import run_experiment
    from cbjax.cluster.remote import ReplicaFailed

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_cfg = to_run_config(cfg)
        if run_cfg.distributed.enabled:
            from hydra.types import RunMode

            from cbjax.app.multihost import start

            if start(run_cfg, multirun=HydraConfig.get().mode == RunMode.MULTIRUN):  # ran process 0's steps
                return None
        run = functools.partial(run_experiment, stop=STOP)
        objective = run_hydra_job(run_cfg, out_dir, HydraConfig.get(), run=run)
    except ValueError as err:
        _to_stderr(f"cbjax: error: {err}")
        sys.exit(2)
    except OSError as err:  # the outputs could not be written (OutputError names the file); the summary was shown
        _to_stderr(f"cbjax: error: {err}")
        sys.exit(1)
    except ReplicaFailed as err:  # an engine cluster's replica failed; a run it ended wrote every request's row
        _to_stderr(f"cbjax: error: {err}")
        sys.exit(1)
    except TrackingError as err:  # the run's outputs are written; the tracker refused them
        _to_stderr(f"cbjax: error: {err}")
        sys.exit(1)
    if STOP.is_set():
        _to_stderr(f"cbjax: interrupted by {STOP.name}; what finished is saved in {out_dir}")
        sys.exit(130)
    log.info(f"\noutputs: {out_dir}")
    return objective  # a sweeper's objective (optimized_metric); None otherwise


def _to_stderr(line: str) -> None:
    """One line on stderr, and in cli.log too (the console handler writes to stdout)."""
    print(line, file=sys.stderr)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def check_group_overrides(argv: list[str], schema: type, prog: str) -> None:
    """Exit with one line, status 2, when a command-line override sets a group of settings of
    `schema` to one value (`workload.prompt_len=5000`), saying how to write it; Hydra itself
    reports only a type error. Selecting a config file (`workload=trace`) is not such a case."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    except Exception:  # a syntax error: Hydra reports it with its own message
        return
    for override in overrides:
        key = override.key_or_group
        if override.is_delete() or override.package is not None or _is_config_group(key):
            continue
        group = group_type(key, schema)
        value = override.value()
        values = value.list if isinstance(value, ChoiceSweep) else [] if override.is_sweep_override() else [value]
        bad = [v for v in values if v is not None and not isinstance(v, Mapping)]
        if group is not None and bad:
            print(f"{prog}: error: {scalar_for_group(key, group, bad[0])}", file=sys.stderr)
            sys.exit(2)


def _is_config_group(key: str) -> bool:
    """Whether `key` names a folder of config files (workload, cluster, hydra/launcher)."""
    root = CONFIG_DIR if IN_SOURCE_TREE else importlib.resources.files("cbjax.configs")
    return "/" in key or key.startswith("hydra") or root.joinpath(*key.split(".")).is_dir()


def preflight(prog: str, config_name: str, schema: type) -> None:
    """What a command checks before Hydra composes its config: the config file is there, and
    no override sets a group of settings to one value (`check_group_overrides`). The working
    directory goes on sys.path, so a plug-in class there is found, as with `python -m`."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if IN_SOURCE_TREE and not (CONFIG_DIR / f"{config_name}.yaml").is_file():
        sys.exit(f"{prog}: error: no {config_name}.yaml at {CONFIG_DIR}; set CBJAX_CONFIG_DIR to the repository's configs/")
    check_group_overrides(sys.argv[1:], schema, prog)


def quiet_broken_pipe(main: Callable[[], None]) -> Callable[[], None]:
    """`main`, ending quietly (status 1) when the reader of its stdout leaves early
    (`cbjax --help | head`) rather than with a BrokenPipeError traceback."""

    @functools.wraps(main)
    def wrapped() -> None:
        try:
            main()
            sys.stdout.flush()  # here, where the error can still be caught
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again
            sys.exit(1)

    return wrapped


@quiet_broken_pipe
def main() -> None:
    preflight("cbjax", "config", RunConfig)
    try:
        with STOP.catching():
            _app()
    except KeyboardInterrupt:  # a signal before the handlers were installed
        print("cbjax: interrupted before the run started", file=sys.stderr)
        sys.exit(130)
