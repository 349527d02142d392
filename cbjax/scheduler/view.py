"""The scheduler as policies see it: `cbjax.scheduler.policy.SchedulerView`, read-only (no jax)."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Sequence

from cbjax.core.request import Request
from cbjax.scheduler.policy import PolicyContract
from cbjax.scheduler.running import RunningSet


class PolicyView:
    """A read-only view of a scheduler's running set, waiting queue and page pool, and of its
    prefix cache's tiers (`prefix`, or None). `reserve_tokens(req)`: the tokens an admission
    of `req` reserves pages for."""

    __slots__ = ("_running_set", "_policy", "_allocator", "_reserve_tokens", "_prefix")

    def __init__(
        self, running_set: RunningSet, policy: PolicyContract, allocator, reserve_tokens: Callable[[Request], int],
        prefix=None,
    ):  # fmt: skip
        self._running_set = running_set
        self._policy = policy
        self._allocator = allocator
        self._reserve_tokens = reserve_tokens
        self._prefix = prefix

    @property
    def running(self) -> Sequence[Request]:
        return tuple(self._running_set.running)

    @property
    def num_waiting(self) -> int:
        return len(self._policy)

    @property
    def num_free_slots(self) -> int:
        return self._running_set.num_free_slots

    @property
    def num_free_pages(self) -> int:
        return self._allocator.num_free_pages

    def pages_held(self, request_id: str) -> int:
        return len(self._allocator.page_tables.get(request_id, ()))

    def pages_freed_by(self, request_ids: Iterable[str]) -> int:
        """Pages no table outside `request_ids` holds: those releasing them all frees."""
        tables, alloc = self._allocator.page_tables, self._allocator
        held = Counter(page for rid in request_ids for page in tables.get(rid, ()))
        return sum(1 for page, n in held.items() if n >= alloc.num_holders(page))

    def admission_pages(self, req: Request) -> int:
        """Pages `req` needs to be admitted with its current tokens."""
        return self._allocator.admission_pages(req.num_tokens, self._reserve_tokens(req))

    def cached_pages(self, req: Request) -> tuple[int, int]:
        """(on the device, in the host tier): the leading pages of `req`'s tokens an admission
        now would find cached in each tier ((0, 0) without prefix caching)."""
        prefix = self._prefix
        if prefix is None:
            return 0, 0
        device = len(prefix.match(req))
        return device, len(prefix.match_host(req, device)) if prefix.tier is not None else 0

    @property
    def num_host_pages_free(self) -> int:
        """Host pages of the tier's pool neither the tier nor swapped-out requests hold (0 without a tier)."""
        tier = self._prefix.tier if self._prefix is not None else None
        return max(0, tier.num_pages - tier.num_used - tier.swap_used()) if tier is not None else 0
