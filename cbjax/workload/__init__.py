"""Workloads: the requests a run replays, drawn from seeded distributions or read from a trace."""

from __future__ import annotations

from cbjax.config import WorkloadConfig
from cbjax.request import Request
from cbjax.workload.synthetic import build_synthetic
from cbjax.workload.trace import load_trace

__all__ = ["build_workload", "build_synthetic", "load_trace"]


def build_workload(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """The requests of `cfg`, sorted by arrival time; ties keep their generation or file order."""
    if cfg.name == "synthetic":
        requests = build_synthetic(cfg, seed)
    elif cfg.name == "trace":
        requests = load_trace(cfg, seed)
    else:
        raise ValueError(f"workload.name: unknown value {cfg.name!r}; choose synthetic or trace")
    return sorted(requests, key=lambda r: r.arrival_s)
