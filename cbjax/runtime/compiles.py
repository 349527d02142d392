"""Counts XLA backend compiles through jax.monitoring, to prove none happen after warmup."""

from __future__ import annotations

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0
_registered = False


def _listener(event: str, duration_s: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        _count += 1


def compile_count() -> int:
    """XLA compiles in this process since the counter was first read."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True
    return _count
