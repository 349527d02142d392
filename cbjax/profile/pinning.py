"""Pinning a measurement to some of the machine's cores, before jax starts its threads.

On a small VM whose cores share memory bandwidth, the cores' joint bandwidth can switch between
levels from one run to the next, while one core alone streams at one rate; a profile and its
validation runs pinned to one core then describe one machine (docs/CALIBRATION.md). Pinning
here sets the affinity of every thread the process has and, through inheritance, of every
thread it starts later: XLA:CPU sizes its intra-op pool from the cores it may run on, so one
core means one XLA thread and no native helper threads.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pin(cores: Optional[int], key: str = "cores") -> Optional[dict[str, Any]]:
    """Pin this process to the first `cores` CPUs it may run on; returns the record a profile
    keeps ({"cores", "cpus"}), or None when `cores` is None (unpinned). Must run before jax
    starts its backend: afterwards its threads exist and keep their affinity (a ValueError
    then, as for a count out of range, naming `key`)."""
    if cores is None:
        return None
    allowed = allowed_cpus()
    if not 1 <= cores <= len(allowed):
        raise ValueError(f"{key}: must be in [1, {len(allowed)}] (the CPUs this process may use), got {cores}")
    if _jax_started():
        raise ValueError(f"{key}: pin before jax starts its backend (its threads keep the affinity they started with)")
    cpus = allowed[:cores]
    if hasattr(os, "sched_setaffinity"):
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # a thread that ended meanwhile
                pass
    return {"cores": cores, "cpus": cpus}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _jax_started() -> bool:
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(xla_bridge is not None and getattr(xla_bridge, "_backends", None))
