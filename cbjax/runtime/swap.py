"""Swap preemption on the device: copy KV pages of every layer to host memory and back.

The jit boundary is `_gather_pages` (device -> host side, then one `jax.device_get`) and
`_scatter_pages` (host -> device, the cache donated). Page lists are padded with the null page
to one of a few fixed widths, each compiled at warmup, so swapping compiles nothing later.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from cbjax.runtime.kv_cache import NULL_PAGE, KVCache


def _gather_pages(cache: KVCache, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    # pages: i32[width]; returns k, v: [num_layers, num_kv_heads, width, page_size, head_dim]
    return cache.k[:, :, pages], cache.v[:, :, pages]


def _scatter_pages(cache: KVCache, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    # pages: i32[width]; k, v: [num_layers, num_kv_heads, width, page_size, head_dim].
    # Padding entries all write the null page, which is never read.
    return KVCache(k=cache.k.at[:, :, pages].set(k), v=cache.v.at[:, :, pages].set(v))


_GATHER = jax.jit(_gather_pages)
_SCATTER = jax.jit(_scatter_pages, donate_argnums=(0,))


class HostSwap:
    """Host copies of swapped-out requests' pages, keyed by request id.

    A swap call moves up to `widths[-1]` pages; longer page lists take several calls, shorter
    ones are padded to the smallest width that holds them.
    """

    def __init__(self, widths: list[int]):
        self.widths = sorted(widths)
        # request_id -> (k, v), each [num_layers, num_kv_heads, num_pages, page_size, head_dim]
        self._host: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.num_out_pages = 0
        self.num_in_pages = 0

    def warmup(self, cache: KVCache) -> KVCache:
        """Compile the gather and scatter at every width. Writes only the null page."""
        for width in self.widths:
            idx = np.full(width, NULL_PAGE, np.int32)
            k, v = jax.device_get(_GATHER(cache, idx))
            cache = _SCATTER(cache, idx, k, v)
        jax.block_until_ready(cache)
        return cache

    def _calls(self, pages: list[int]):
        """(padded i32[width] page ids, number of real pages) per call."""
        most = self.widths[-1]
        for lo in range(0, len(pages), most):
            chunk = pages[lo : lo + most]
            width = next(w for w in self.widths if w >= len(chunk))
            idx = np.full(width, NULL_PAGE, np.int32)
            idx[: len(chunk)] = chunk
            yield idx, len(chunk)

    def gather(self, cache: KVCache, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of `pages`' K and V, each [num_layers, num_kv_heads, len(pages),
        page_size, head_dim], whole whatever the cache's sharding: all gathers, then one
        device_get."""
        pages = list(pages)
        calls = [(_GATHER(cache, idx), n) for idx, n in self._calls(pages)]
        host = jax.device_get([kv for kv, _ in calls])
        k = np.concatenate([hk[:, :, :n] for (hk, _), (_, n) in zip(host, calls)], axis=2)
        v = np.concatenate([hv[:, :, :n] for (_, hv), (_, n) in zip(host, calls)], axis=2)
        return k, v

    def put(self, request_id: str, k: np.ndarray, v: np.ndarray) -> None:
        """Hold a host copy made elsewhere (another replica's `gather`) for `swap_in`."""
        if request_id in self._host:
            raise ValueError(f"request {request_id}: already has a host copy")
        self._host[request_id] = (k, v)

    def run(self, cache: KVCache, plan) -> KVCache:
        """A plan's swaps (`Schedule`): drop the host copies it lets go, swap out, then swap in
        (a page a swap-out frees may be a swap-in's destination); returns the updated cache."""
        self.drop(plan.swap_drop)
        self.swap_out(cache, plan.swap_out)
        return self.swap_in(cache, plan.swap_in)

    def drop(self, request_ids: Sequence[str]) -> None:
        """Forget the host copies of requests that ended before swapping in."""
        for request_id in request_ids:
            self._host.pop(request_id, None)

    def swap_out(self, cache: KVCache, entries: list[tuple[str, Sequence[int]]]) -> None:
        """Copy each request's pages to host memory."""
        pages = [p for _, src in entries for p in src]
        if not pages:
            return
        k, v = self.gather(cache, pages)
        lo = 0
        for request_id, src in entries:
            self._host[request_id] = (k[:, :, lo : lo + len(src)], v[:, :, lo : lo + len(src)])
            lo += len(src)
        self.num_out_pages += len(pages)

    def swap_in(self, cache: KVCache, entries: list[tuple[str, Sequence[int]]]) -> KVCache:
        """Write each request's host copy into its new pages; returns the updated cache."""
        pages = [p for _, dst in entries for p in dst]
        if not pages:
            return cache
        copies = [self._host.pop(request_id) for request_id, _ in entries]
        for (request_id, dst), (k, _) in zip(entries, copies):
            if k.shape[2] != len(dst):
                raise ValueError(f"request {request_id}: swaps in {len(dst)} pages, {k.shape[2]} were swapped out")
        k = np.concatenate([c[0] for c in copies], axis=2)
        v = np.concatenate([c[1] for c in copies], axis=2)
        cache = self.scatter(cache, pages, k, v)
        self.num_in_pages += len(pages)
        return cache

    def scatter(self, cache: KVCache, pages: Sequence[int], k: np.ndarray, v: np.ndarray) -> KVCache:
        """Write host K and V, each [num_layers, num_kv_heads, len(pages), page_size, head_dim],
        into `pages`; returns the updated cache."""
        lo = 0
        for idx, n in self._calls(list(pages)):
            pad = [(0, 0), (0, 0), (0, len(idx) - n), (0, 0), (0, 0)]
            cache = _SCATTER(cache, idx, np.pad(k[:, :, lo : lo + n], pad), np.pad(v[:, :, lo : lo + n], pad))
            lo += n
        return cache
