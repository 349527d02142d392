"""Workloads: the requests a run replays, drawn from seeded distributions or read from a trace."""

from __future__ import annotations

from cbjax.config import WorkloadConfig
from cbjax.core.request import Request
from cbjax.workload.synthetic import build_synthetic
from cbjax.workload.shared_prefix import build_shared_prefix
from cbjax.workload.trace import load_trace

__all__ = ["build_workload", "build_synthetic", "build_shared_prefix", "load_trace"]


def build_workload(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """The requests of `cfg`, sorted by arrival time; ties keep their generation or file order."""
    if cfg.name == "synthetic":
        requests = build_synthetic(cfg, seed)
    elif cfg.name == "trace":
        requests = load_trace(cfg, seed)
    elif cfg.name == "shared_prefix":
        requests = build_shared_prefix(cfg, seed)
    else:
        raise ValueError(f"workload.name: unknown value {cfg.name!r}; choose synthetic, trace or shared_prefix")
    reject_late_arrivals(requests, cfg.max_arrival_s)
    return sorted(requests, key=lambda r: r.arrival_s)


def reject_late_arrivals(requests: list[Request], max_arrival_s: float) -> None:
    """Mark requests arriving after `max_arrival_s` for rejection, in place. Their arrival
    becomes 0 so that the run meets them at once instead of waiting (the reason keeps it)."""
    for req in requests:
        if req.arrival_s > max_arrival_s:
            late = f"arrival_s {req.arrival_s:g} is beyond workload.max_arrival_s={max_arrival_s:g}"
            req.input_error = f"{req.input_error}; {late}" if req.input_error else late
            req.arrival_s = 0.0
