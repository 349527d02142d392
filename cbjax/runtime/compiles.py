"""Counts XLA compiles through jax.monitoring, to prove none happen after warmup.

jax records a backend-compile event for a program loaded from the persistent compilation
cache too, so `cache_hit_count` counts those loads and `fresh_compile_count` subtracts them.
"""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_count = 0
_hits = 0
_registered = False
_thread_hits: dict[int, int] = {}  # thread id -> persistent-cache loads in that thread


def _duration_listener(event: str, duration_s: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        _count += 1


def _event_listener(event: str, **kwargs) -> None:
    global _hits
    if event == _CACHE_HIT_EVENT:  # jax records it in the thread that asked for the program
        _hits += 1
        ident = threading.get_ident()
        _thread_hits[ident] = _thread_hits.get(ident, 0) + 1


def _register() -> None:
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_duration_listener)
        jax.monitoring.register_event_listener(_event_listener)
        _registered = True


def compile_count() -> int:
    """XLA compiles (or cache loads) in this process since the counter was first read."""
    _register()
    return _count


def cache_hit_count() -> int:
    """Programs loaded from the persistent compilation cache since the counter was first read."""
    _register()
    return _hits


def fresh_compile_count() -> int:
    """Programs really compiled: compiles minus persistent-cache loads."""
    return compile_count() - cache_hit_count()


def thread_cache_hits() -> int:
    """Persistent-cache loads in the calling thread (compiles in parallel threads stay apart)."""
    _register()
    return _thread_hits.get(threading.get_ident(), 0)
