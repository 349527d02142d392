"""Refuse a KV pool that cannot fit before allocating it: one line with both sizes, not RESOURCE_EXHAUSTED."""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype) -> int:
    """Bytes of the whole pool, K and V (`cbjax.runtime.kv_cache.init_cache`'s arrays)."""
    return 2 * num_layers * num_kv_heads * num_pages * page_size * head_dim * np.dtype(dtype).itemsize


def host_available_bytes() -> Optional[int]:
    """Memory the host can still give without swapping: /proc/meminfo's MemAvailable, else the
    free physical pages (os.sysconf); None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def device_available_bytes(device) -> Optional[int]:
    """An accelerator's free memory from its allocator's stats; None where it keeps none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without stats raise rather than return None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_kv_cache_fits(
    num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype, *, num_shards: int = 1
) -> None:
    """Raise ValueError naming `cache.num_pages` when the pool is larger than the memory available.

    The pool is split over `num_shards` devices by kv head (tensor parallelism). On CPU every
    local device is host memory, so the check is this process's share against MemAvailable; on
    an accelerator it is one device's shard against that device's free memory. Where the
    available memory is unknown the check passes and the allocation decides."""
    total = kv_cache_bytes(num_layers, num_kv_heads, head_dim, num_pages, page_size, dtype)
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        need, available, where = total // jax.process_count(), host_available_bytes(), "host memory"
    else:
        need, available, where = total // max(num_shards, 1), device_available_bytes(device), f"{device.platform} memory"
    if available is None or need <= available:
        return
    per_page = max(need // num_pages, 1)
    raise ValueError(
        f"cache.num_pages={num_pages}: the KV pool needs {_size(need)} but {_size(available)} of {where} is "
        f"available ({num_layers} layers x {num_kv_heads} kv heads x {page_size} tokens x {head_dim} dims, "
        f"{np.dtype(dtype).name}, K and V); at most {available // per_page} pages fit"
    )


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
