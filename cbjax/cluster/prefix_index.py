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

from cbjax.cache.allocator import ROOT_HASH, chain_hashes
from cbjax.core.request import Request


def prompt_page_hashes(req: Request, page_size: int) -> tuple[int, ...]:
    """Chained hashes of the full pages of the request's prompt."""
    return tuple(chain_hashes(ROOT_HASH, req.prompt_ids(), page_size))


class PrefixIndex:
    """Page hashes of prompts routed to one replica, at most `capacity_pages` of them."""

    __slots__ = ("capacity_pages", "_pages")

    def __init__(self, capacity_pages: int):
        if capacity_pages < 0:
            raise ValueError(f"PrefixIndex: capacity_pages must be >= 0, got {capacity_pages}")
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading pages of `hashes` the index holds."""
        pages = self._pages
        n = 0
        for h in hashes:
            if h not in pages:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a routed prompt's pages as most recent; evict the least recent beyond capacity."""
        pages = self._pages
        for h in hashes:
            if h in pages:
                pages.move_to_end(h)
            else:
                pages[h] = None
        while len(pages) > self.capacity_pages:
            pages.popitem(last=False)
