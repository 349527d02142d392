"""The host KV tier on the engine: host memory holding device pages' K/V, written and read by
each plan's `HostCopies` through the swap machinery (`cbjax.runtime.swap`).

A step's copies run before it, in the order the plan's contract gives: swap-outs, the tier's
stores (one batched gather), then swap-ins, loads and prefetches (one batched scatter each).

Where the platform offers JAX's `pinned_host` memory (a GPU's page-locked memory, which its
copy engines read and write directly), each host page lives there as its own pair of arrays,
moved by the one-page gather and scatter programs; elsewhere (the CPU) pages are numpy arrays
and each step's copies are batched.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np

from cbjax.core.plan import Schedule
from cbjax.runtime.kv_cache import NULL_PAGE, KVCache
from cbjax.runtime.swap import _GATHER, _SCATTER, HostSwap


def pinned_host_offered() -> bool:
    """Whether the default device offers `pinned_host` memory and is not the CPU (whose own
    memory is host memory already)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return False
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except (AttributeError, NotImplementedError):
        return False


class HostPages:
    """The host tier's pages: host page number -> (k, v), each [num_layers, num_kv_heads,
    page_size, head_dim] (numpy) or [..., 1, page_size, head_dim] (`pinned`: JAX arrays in
    `pinned_host` memory). A host page's memory is reused when a later store writes it."""

    def __init__(self, swap: HostSwap, pinned: Optional[bool] = None):
        self.swap = swap
        self.pinned = pinned_host_offered() if pinned is None else pinned
        self._pages: dict[int, tuple] = {}
        self.num_stored = 0
        self.num_loaded = 0
        # seconds of the latest step's loads and prefetches (the device waited for: measured)
        self.load_s = 0.0
        self.prefetch_s = 0.0
        # when a list (the profiler's `cbjax.profile.copies`): per step with stores or loads,
        # (pages stored, pages loaded, seconds of its copies)
        self.timings: Optional[list[tuple[int, int, float]]] = None

    def times(self) -> tuple[float, float]:
        return self.load_s, self.prefetch_s

    def warmup(self, cache: KVCache) -> KVCache:
        """Compile the pinned path's one-page round trip (the swap programs are compiled
        already). Writes only the null page."""
        if self.pinned:
            k, v = self._gather_pinned(cache, NULL_PAGE)
            cache = self._scatter_pinned(cache, NULL_PAGE, k, v)
            jax.block_until_ready(cache)
        return cache

    def run(self, cache: KVCache, plan: Schedule) -> KVCache:
        """`plan`'s swaps and host-tier copies, in the contract's order; returns the cache."""
        swap, copies = self.swap, plan.host_copies
        swap.drop(plan.swap_drop)
        if plan.swap_out:
            swap.swap_out(cache, plan.swap_out)
        if copies is None:
            self.load_s = self.prefetch_s = 0.0
            return swap.swap_in(cache, plan.swap_in)
        t_store = time.perf_counter()
        stored = self._gather(cache, [p for p, _ in copies.store]) if copies.store else []
        for (_, host), kv in zip(copies.store, stored):  # in order: a later store to a host page wins
            self._pages[host] = kv
        self.num_stored += len(stored)
        loads = [(p, self._pages[h]) for _, hosts, pages in copies.load for h, p in zip(hosts, pages)]
        prefetches = [(p, self._pages[h]) for _, hosts, pages in copies.prefetch for h, p in zip(hosts, pages)]
        cache = swap.swap_in(cache, plan.swap_in)
        t0 = time.perf_counter()
        cache = self._scatter(cache, loads)
        t1 = time.perf_counter()
        cache = self._scatter(cache, prefetches)
        self.load_s, self.prefetch_s = t1 - t0, time.perf_counter() - t1
        self.num_loaded += len(loads) + len(prefetches)
        if self.timings is not None and (stored or loads):
            self.timings.append((len(stored), len(loads), (t0 - t_store) + self.load_s))
        return cache

    def _gather(self, cache: KVCache, pages: list[int]) -> list[tuple]:
        """Each page's host copy."""
        if self.pinned:
            return [self._gather_pinned(cache, p) for p in pages]
        k, v = self.swap.gather(cache, pages)
        return [(np.ascontiguousarray(k[:, :, i]), np.ascontiguousarray(v[:, :, i])) for i in range(len(pages))]

    def _scatter(self, cache: KVCache, entries: list[tuple[int, tuple]]) -> KVCache:
        """Write each (device page, host copy) into the cache, and wait for it (timed)."""
        if not entries:
            return cache
        if self.pinned:
            for page, (k, v) in entries:
                cache = self._scatter_pinned(cache, page, k, v)
        else:
            k = np.stack([kv[0] for _, kv in entries], axis=2)
            v = np.stack([kv[1] for _, kv in entries], axis=2)
            cache = self.swap.scatter(cache, [p for p, _ in entries], k, v)
        return jax.block_until_ready(cache)

    @staticmethod
    def _gather_pinned(cache: KVCache, page: int) -> tuple[jax.Array, jax.Array]:
        k, v = _GATHER(cache, np.full(1, page, np.int32))
        return jax.device_put(k, k.sharding.with_memory_kind("pinned_host")), jax.device_put(
            v, v.sharding.with_memory_kind("pinned_host")
        )

    @staticmethod
    def _scatter_pinned(cache: KVCache, page: int, k: jax.Array, v: jax.Array) -> KVCache:
        k = jax.device_put(k, k.sharding.with_memory_kind("device"))
        v = jax.device_put(v, v.sharding.with_memory_kind("device"))
        return _SCATTER(cache, np.full(1, page, np.int32), k, v)
