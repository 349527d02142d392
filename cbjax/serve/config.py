"""The `server` group of `cbjax-serve`, and ServeConfig: a RunConfig with it (no Hydra here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from cbjax.config import RunConfig
from cbjax.config.checks import _require


@dataclass
class ServerConfig:
    """Where the OpenAI-compatible server listens and how it treats its clients."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Requests waiting for a slot (accepted, not yet running) beyond which a new one answers
    # 429 with Retry-After. None: no bound.
    max_queue: Optional[int] = None
    # Clients must send `Authorization: Bearer <api_key>`. None: no key asked.
    api_key: Optional[str] = None
    # The name /v1/models lists and requests may give as `model`. None: model.name.
    served_model_name: Optional[str] = None
    # After SIGTERM: how long in-flight requests may run on before the rest are aborted.
    drain_s: float = 30.0
    # Seconds a 429 asks the client to wait (Retry-After).
    retry_after_s: int = 1
    log_level: str = "warning"  # uvicorn's access and error logs
    # A request body larger than this answers 413 before it is read whole (its Content-Length,
    # or a running count of a chunked upload). 8 MiB holds a 128k-token prompt as token ids or
    # as escaped text, with room to spare.
    max_body_bytes: int = 8 * 1024 * 1024
    # true: the real engine (executor=jax only) runs in a process of its own, so its steps and
    # the HTTP side's writes do not take turns on one GIL (cbjax.serve.remote); the two processes
    # then need a core each, and a step's tokens cross a pipe. false: the engine runs on a
    # thread of the server's process. The simulator always runs on a thread (paced, it waits
    # on requests still being read), so ServeConfig refuses true with executor=sim.
    # docs/serving.md has the measured trade-off.
    engine_process: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.host), "server.host", "must be non-empty", self.host)
        _require(0 <= self.port <= 65535, "server.port", "must be in [0, 65535] (0: any free port)", self.port)
        if self.max_queue is not None:
            # 0 would turn every request away, a slot free or not
            _require(self.max_queue >= 1, "server.max_queue", "must be >= 1 (null: no bound)", self.max_queue)
        if self.api_key is not None:
            _require(bool(self.api_key), "server.api_key", "must be non-empty (null: no key)", self.api_key)
        _require(self.drain_s >= 0 and math.isfinite(self.drain_s), "server.drain_s", "must be >= 0", self.drain_s)
        _require(self.retry_after_s >= 0, "server.retry_after_s", "must be >= 0", self.retry_after_s)
        _require(self.max_body_bytes >= 1, "server.max_body_bytes", "must be >= 1", self.max_body_bytes)
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        _require(self.log_level in levels, "server.log_level", f"must be one of {', '.join(levels)}", self.log_level)


@dataclass
class ServeConfig(RunConfig):
    """Everything `cbjax` reads, plus the server. The workload group is not served from:
    requests come over HTTP (it stays so that one config file fits both commands)."""

    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            not self.experiment.arms,
            "experiment.arms",
            "are not served: a server runs one config",
            sorted(self.experiment.arms),
        )
        _require(not self.distributed.enabled, "distributed.num_processes", "must be 1 for cbjax-serve", self.distributed.num_processes)
        # one replica: the cluster's router and pools are `cbjax`'s (simulated or engine clusters)
        for key, alone in (("replicas", 1), ("prefill_replicas", 0), ("decode_replicas", 0)):
            value = getattr(self.cluster, key)
            if value != alone:
                raise ValueError(
                    f"cluster.{key}={value}: cbjax-serve runs one replica; run a cluster with `cbjax`, "
                    "or serve each replica with a cbjax-serve of its own behind your router"
                )
        if self.server.engine_process and self.executor.name != "jax":
            raise ValueError(
                f"server.engine_process=true needs executor=jax, got executor={self.executor.name} "
                "(the simulator runs on a thread of the server)"
            )
