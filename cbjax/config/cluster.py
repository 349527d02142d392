"""The cluster group: replicas behind a router, and prefill/decode disaggregation (cbjax.cluster)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from cbjax.config.checks import _class_path, _one_of, _require

BACKENDS = ("processes", "inline", "ray")


@dataclass
class ClusterConfig:
    """N replicas, each today's scheduler, cache and executor, behind a router.

    `replicas: 1` with no prefill/decode pools is a single replica: the run does not go through
    the cluster at all. Setting both `prefill_replicas` and `decode_replicas` disaggregates:
    a request is prefilled in the prefill pool, its KV pages move over the KV link to a
    decode replica, and it decodes there; `replicas` then must stay 1 or equal their sum.
    """

    replicas: int = 1
    # A built-in router (`cbjax.cluster.router.ROUTER_CLASSES`) or a user's "package.module:ClassName" (a cbjax.cluster.Router
    # subclass importable from the working directory or PYTHONPATH), built with router_args.
    router: str = "round_robin"
    router_args: dict[str, Any] = field(default_factory=dict)
    # Where an engine cluster's (executor=jax) executors run. processes: each replica's in a
    # child process of its own, on its own devices. inline: all in this process (one debugger
    # and profiler see every replica). ray: one Ray actor per replica, on any host of a Ray
    # cluster. The simulated cluster runs in this process under processes and inline.
    backend: str = "processes"
    # processes: pin replica i's process to a CPU of its own, the i-th of those the driver may
    # use (round robin), before its jax starts: each replica then runs on one core, as a
    # profile pinned to one core (`python -m cbjax.profile cores=1`) describes it.
    pin_replicas: bool = False
    # Prefill/decode disaggregation: both 0 (colocated) or both >= 1.
    prefill_replicas: int = 0
    decode_replicas: int = 0
    # The KV link between the pools: gigabits per second, and a fixed latency per transfer.
    kv_link_gbps: float = 100.0
    kv_link_latency_s: float = 0.0
    # Each pool's accelerator (a configs/hardware name, or a path to such a YAML file) and its
    # tensor-parallel size; null: the run's hardware and its hardware.num_devices.
    prefill_hardware: Optional[str] = None
    decode_hardware: Optional[str] = None
    prefill_tensor: Optional[int] = None
    decode_tensor: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.replicas >= 1, "cluster.replicas", "must be >= 1", self.replicas)
        if ":" in self.router:  # a built-in router's name is checked against the registry
            _class_path("cluster.router", self.router, 'must be a built-in router or look like "package.module:ClassName"')
        _one_of("cluster.backend", self.backend, BACKENDS)
        _require(
            not self.pin_replicas or self.backend == "processes",
            "cluster.pin_replicas",
            f"applies only with cluster.backend=processes (a process per replica to pin), not {self.backend}",
            self.pin_replicas,
        )
        for key in ("prefill_replicas", "decode_replicas"):
            _require(getattr(self, key) >= 0, f"cluster.{key}", "must be >= 0", getattr(self, key))
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError(
                "cluster.prefill_replicas and cluster.decode_replicas: set both (>= 1) to disaggregate, "
                f"or neither; got {self.prefill_replicas} and {self.decode_replicas}"
            )
        if self.disaggregated:
            total = self.prefill_replicas + self.decode_replicas
            _require(
                self.replicas in (1, total),
                "cluster.replicas",
                f"must be 1 or prefill_replicas + decode_replicas ({total}) when disaggregated",
                self.replicas,
            )
        else:
            for key in ("prefill_hardware", "decode_hardware", "prefill_tensor", "decode_tensor"):
                _require(
                    getattr(self, key) is None,
                    f"cluster.{key}",
                    "applies only with cluster.prefill_replicas and cluster.decode_replicas set",
                    getattr(self, key),
                )
        _require(
            self.kv_link_gbps > 0 and math.isfinite(self.kv_link_gbps), "cluster.kv_link_gbps", "must be > 0",
            self.kv_link_gbps,
        )  # fmt: skip
        _require(
            self.kv_link_latency_s >= 0 and math.isfinite(self.kv_link_latency_s), "cluster.kv_link_latency_s",
            "must be >= 0", self.kv_link_latency_s,
        )  # fmt: skip
        for key in ("prefill_tensor", "decode_tensor"):
            value = getattr(self, key)
            if value is not None:
                _require(value >= 1, f"cluster.{key}", "must be >= 1", value)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0 and self.decode_replicas > 0

    @property
    def enabled(self) -> bool:
        """Whether a run goes through the cluster: more than one replica, or P/D pools."""
        return self.replicas > 1 or self.disaggregated
