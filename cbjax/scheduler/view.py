"""The scheduler as policies see it: `cbjax.scheduler.policy.SchedulerView`, read-only (no jax)."""

from __future__ import annotations

from typing import Callable, Sequence

from cbjax.core.request import Request
from cbjax.scheduler.policy import PolicyContract
from cbjax.scheduler.running import RunningSet


class PolicyView:
    """A read-only view of a scheduler's running set, waiting queue and page pool.
    `reserve_tokens(req)`: the tokens an admission of `req` reserves pages for."""

    __slots__ = ("_running_set", "_policy", "_allocator", "_reserve_tokens")

    def __init__(
        self, running_set: RunningSet, policy: PolicyContract, allocator, reserve_tokens: Callable[[Request], int]
    ):
        self._running_set = running_set
        self._policy = policy
        self._allocator = allocator
        self._reserve_tokens = reserve_tokens

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

    def admission_pages(self, req: Request) -> int:
        """Pages `req` needs to be admitted with its current tokens."""
        return self._allocator.admission_pages(req.num_tokens, self._reserve_tokens(req))
