"""The requests waiting for a slot (no jax): the policy's queue, with the K/V pages each holds
in host memory and the pages each would reserve."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from cbjax.core.request import Request
from cbjax.scheduler.policy import PolicyContract


class WaitingQueue:
    """The waiting requests, in `policy`'s queue, and what is kept beside each: the pages of
    K/V it holds in host memory (swapped out, or prefilled on another replica), out of
    `swap_capacity` host pages; and under a reservation allocator the pages it would reserve
    (`reserve_tokens(req)` tokens), so the smallest reservation, which external fragmentation
    is judged against, costs no scan of the queue."""

    def __init__(self, policy: PolicyContract, allocator, reserve_tokens: Callable[[Request], int], swap_capacity: int):
        self.policy = policy
        self.allocator = allocator  # reserve, pages_for
        self.reserve_tokens = reserve_tokens
        self.swap_capacity = swap_capacity
        self.swap_used = 0
        # ids of requests removed while holding host pages: the next plan drops their copies
        self.dropped: list[str] = []
        self._host_pages: dict[Request, int] = {}
        self._reservations: Counter[int] = Counter()  # pages a waiting request would reserve -> how many

    def host_pages(self, req: Request) -> int:
        """Pages of `req`'s K/V in host memory (0: none)."""
        return self._host_pages.get(req, 0)

    def swap_room(self) -> int:
        """Host pages free for a swap-out."""
        return self.swap_capacity - self.swap_used

    def smallest_reservation(self) -> int:
        """The fewest pages a waiting request would reserve (0: none waits, or pages on demand)."""
        return min(self._reservations) if self._reservations else 0

    def push(self, req: Request, host_pages: int = 0) -> None:
        """Queue an arrived request, which holds `host_pages` pages of K/V in host memory."""
        self._hold(req, host_pages)
        self.policy.push(req)

    def requeue(self, req: Request, host_pages: int) -> None:
        """Queue a preempted request again, its `host_pages` swapped-out pages in host memory."""
        self._hold(req, host_pages)
        self.policy.requeue(req)

    def take(self, req: Request) -> int:
        """Take the head of the queue, `req`, for admission; returns its host pages, which its
        admission copies back (they no longer count against the host memory)."""
        self.policy.pop()
        return self._let_go(req)

    def remove(self, req: Request) -> None:
        """Take `req` out of the queue (aborted), dropping its host pages."""
        self.policy.remove(req)
        if self._let_go(req):
            self.dropped.append(req.request_id)

    def clear(self) -> list[Request]:
        """Empty the queue; returns the requests it held, in queue order."""
        out = list(self.policy)
        while len(self.policy):
            self.policy.pop()
        self._host_pages.clear()
        self._reservations.clear()
        self.swap_used = 0
        return out

    def _hold(self, req: Request, host_pages: int) -> None:
        if host_pages:
            self._host_pages[req] = host_pages
            self.swap_used += host_pages
        self._count_reservation(req, 1)

    def _let_go(self, req: Request) -> int:
        self._count_reservation(req, -1)
        pages = self._host_pages.pop(req, 0)
        self.swap_used -= pages
        return pages

    def _count_reservation(self, req: Request, delta: int) -> None:
        if self.allocator.reserve:
            pages = self.allocator.pages_for(self.reserve_tokens(req))
            self._reservations[pages] += delta
            if not self._reservations[pages]:
                del self._reservations[pages]
