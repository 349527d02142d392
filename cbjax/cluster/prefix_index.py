"""A router's approximate record of what each replica has cached: the page hashes of the
prompts routed to it, bounded in size, least recently routed evicted first (no jax).

SGLang's cache-aware router and Preble keep such a per-worker tree of routed prompts rather
than asking the workers: it costs no round trip and is right while the worker's cache holds
what was sent to it. Hashes are `cbjax.cache.allocator.chain_hashes` of full prompt pages, the
ones the replicas' prefix caches use; a chained hash names its whole prefix, so a set of them
is the tree.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from cbjax.cache.page_hash import ROOT_HASH, chain_hashes
from cbjax.core.request import Request


def prompt_page_hashes(req: Request, page_size: int) -> tuple[int, ...]:
    """Chained hashes of the full pages of the request's prompt."""
    return tuple(chain_hashes(ROOT_HASH, req.prompt_ids(), page_size))


class PrefixIndex:
    """Page hashes of prompts routed to one replica, at most `capacity_pages` of them on its
    device and, with a host KV tier, `host_capacity_pages` more in its host memory: a page the
    device tier pushes out goes to the host tier (least recently routed first), as the
    replica's cache moves pages it evicts."""

    __slots__ = ("capacity_pages", "host_capacity_pages", "_pages", "_host")

    def __init__(self, capacity_pages: int, host_capacity_pages: int = 0):
        if capacity_pages < 0:
            raise ValueError(f"PrefixIndex: capacity_pages must be >= 0, got {capacity_pages}")
        if host_capacity_pages < 0:
            raise ValueError(f"PrefixIndex: host_capacity_pages must be >= 0, got {host_capacity_pages}")
        self.capacity_pages = capacity_pages
        self.host_capacity_pages = host_capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages) + len(self._host)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading pages of `hashes` the index holds (in either tier)."""
        device, host = self.match_tiers(hashes)
        return device + host

    def match_tiers(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(on the device, in host memory): the leading pages of `hashes` the index holds, by tier."""
        pages, host = self._pages, self._host
        n = m = 0
        for h in hashes:
            if h in pages:
                n += 1
            elif h in host:
                m += 1
            else:
                break
        return n, m

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a routed prompt's pages as most recent on the device; beyond its capacity the
        least recent go to the host tier, and beyond that's capacity they are forgotten."""
        pages, host = self._pages, self._host
        for h in hashes:
            if h in pages:
                pages.move_to_end(h)
            else:
                host.pop(h, None)
                pages[h] = None
        while len(pages) > self.capacity_pages:
            h, _ = pages.popitem(last=False)
            if self.host_capacity_pages:
                host[h] = None
        while len(host) > self.host_capacity_pages:
            host.popitem(last=False)
