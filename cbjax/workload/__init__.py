"""Workloads: the requests a run replays, drawn from seeded distributions or read from a trace."""

from __future__ import annotations

from typing import Any, Optional

from cbjax.config import WorkloadConfig
from cbjax.core.request import Request
from cbjax.workload.synthetic import build_synthetic
from cbjax.workload.sessions import build_sessions
from cbjax.workload.shared_prefix import build_shared_prefix
from cbjax.workload.trace import load_trace

__all__ = ["build_workload", "build_synthetic", "build_shared_prefix", "build_sessions", "load_trace"]


def build_workload(cfg: WorkloadConfig, seed: int, tokenizer: Optional[Any] = None) -> list[Request]:
    """The requests of `cfg`, sorted by arrival time; ties keep their generation or file order.
    A session's later turns (`pause_s` set) arrive when the turn before them ends: they come
    last, in session order. `tokenizer` (`encode(text) -> ids`) counts the tokens of a
    ShareGPT file's messages."""
    if cfg.name == "synthetic":
        requests = build_synthetic(cfg, seed)
    elif cfg.name == "trace":
        requests = load_trace(cfg, seed, tokenizer)
    elif cfg.name == "shared_prefix":
        requests = build_shared_prefix(cfg, seed)
    elif cfg.name == "sessions":
        requests = build_sessions(cfg, seed)
    else:
        raise ValueError(
            f"workload.name: unknown value {cfg.name!r}; choose synthetic, trace, shared_prefix or sessions"
        )
    reject_late_arrivals(requests, cfg.max_arrival_s)
    return sorted(requests, key=lambda r: r.arrival_s)


def reject_late_arrivals(requests: list[Request], max_arrival_s: float) -> None:
    """Mark requests arriving after `max_arrival_s` for rejection, in place. Their arrival
    becomes 0 so that the run meets them at once instead of waiting (the reason keeps it). A
    session's later turn is not checked: it arrives as the turn before it ends. A trace's
    request names its file and line first, as every other reason for its lines does."""
    for req in requests:
        if req.arrival_s > max_arrival_s and req.pause_s is None:
            late = f"arrival_s {req.arrival_s:g} is beyond workload.max_arrival_s={max_arrival_s:g}"
            if req.input_error:
                req.input_error = f"{req.input_error}; {late}"
            else:
                req.input_error = f"{req.source}: {late}" if req.source else late
            req.arrival_s = 0.0
