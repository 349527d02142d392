"""The `cbjax-serve` command: a Hydra app over ServeConfig (every `cbjax` group plus `server`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cbjax.app.cli import CONFIG_PATH, preflight, quiet_broken_pipe
from cbjax.app.config_merge import typed_config
from cbjax.serve.config import ServeConfig
from cbjax.serve.process import LISTENING

ConfigStore.instance().store(name="serve_base_config", node=ServeConfig)
# serve.yaml's default executor.pace: the simulator is paced to the wall clock, the engine is not
OmegaConf.register_new_resolver("cbjax_serve_pace", lambda name: "realtime" if name == "sim" else "none", replace=True)

log = logging.getLogger("cbjax")
# `cbjax` groups that run several configurations: what each is, for the refusal
RUN_ONLY_GROUPS = {"experiment": "an experiment (arms compared) is", "hparams_search": "a search (a sweep) is"}


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="serve")
def _app(cfg: DictConfig) -> None:
    from cbjax.serve.server import Server

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        server = Server(typed_config(cfg, ServeConfig), out_dir)
        sock = server.bind(listen=False)  # a port in use fails now, not after the warmup
        server.warmup()
        server.listen(sock)
    except (ValueError, OSError) as err:
        print(f"cbjax-serve: error: {err}", file=sys.stderr)
        sys.exit(2)
    host, port = sock.getsockname()[:2]
    # One line on stderr once the socket listens: scripts wait for it (and read the port when
    # server.port=0 picked a free one).
    print(LISTENING.format(url=f"http://{host}:{port}") + f" (model {server.state.model_name!r}); "
          f"outputs in {out_dir}", file=sys.stderr, flush=True)  # fmt: skip
    summary = server.run(sock)
    if summary is None:
        print(f"cbjax-serve: error: {server.engine.health().reason}; no summary written", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"cbjax-serve: stopped; {summary['num_requests']} requests, outputs in {out_dir}", file=sys.stderr, flush=True)


def refused_override(args: list[str]) -> Optional[str]:
    """Why a command-line override selects something a server cannot run (None: it does not).
    Checked before Hydra composes, whose own message would be about its defaults list."""
    for arg in args:
        group, eq, option = arg.lstrip("+~").partition("=")
        if eq and option != "null" and group in RUN_ONLY_GROUPS:
            return f"{group}={option}: a server runs one configuration; {RUN_ONLY_GROUPS[group]} for `cbjax`"
    return None


@quiet_broken_pipe
def main() -> None:
    why = refused_override(sys.argv[1:])
    if why is not None:
        print(f"cbjax-serve: error: {why}", file=sys.stderr)
        sys.exit(2)
    preflight("cbjax-serve", "serve", ServeConfig)
    _app()
