"""Shared base of priority, sjf and mlfq: a heap-ordered waiting queue with rank-based preemption."""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Iterator, Optional

from cbjax.core.request import Request, Status
from cbjax.scheduler.policy import QueuedPolicy, SchedulerView


class RankedQueue:
    """Requests ordered by a key fixed when queued, then by queueing order: O(log n) push and pop."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()

    def push(self, key: tuple, request: Request) -> None:
        heapq.heappush(self._heap, (key, next(self._seq), request))

    def peek(self) -> Optional[Request]:
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        """O(n): for aborts, not for the per-iteration path."""
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Queue order. Sorts a copy: for aborts and inspection, not for the per-iteration path."""
        return (entry[2] for entry in sorted(self._heap))


class RankedPolicy(QueuedPolicy):
    """Serves the waiting request of lowest `rank` first, first come first served among equals.

    A request's rank is read when it is queued, so it must not change while the request waits.
    A preempted request goes ahead of fresh ones of equal rank, the most recently preempted
    first (vLLM prepends them to its waiting queue). Victims are the worst ranked running
    requests, the latest admitted among equals. With equal ranks everywhere this is fcfs
    exactly. With `preempts` set, a head that lacks a slot or pages evicts running requests it
    strictly outranks.
    """

    preempts = False

    def __init__(self, cfg):
        super().__init__(cfg, RankedQueue())
        self._num_requeued = itertools.count()
        self._victims: Optional[_Victims] = None

    def rank(self, request: Request) -> float:
        """Lower is served first."""
        raise NotImplementedError

    # ---- waiting queue ----
    def push(self, request: Request) -> None:
        self._queue.push((self.rank(request), 1), request)

    def requeue(self, request: Request) -> None:
        self._queue.push((self.rank(request), 0, -next(self._num_requeued)), request)

    # ---- decisions ----
    def victim_key(self, request: Request) -> tuple:
        return (self.rank(request), request.admit_seq)

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.victim_key)

    @property
    def may_preempt_for(self) -> bool:
        return self.preempts

    def preempt_for(self, waiting: Request, scheduler: SchedulerView) -> Optional[Request]:
        if not self.preempts:
            return None
        if self._victims is None:
            self._victims = _Victims(self, scheduler)
        return self._victims.take(waiting)

    def on_step(self, scheduled: list[Request], now: float) -> None:
        self._victims = None


class _Victims:
    """The running requests in eviction order, built once per admission phase.

    Within one phase ranks are fixed and successive heads never rank better than earlier ones
    (a victim requeues below the head that evicted it), so requests admitted in the phase are
    never victims, and each head's candidates are a prefix of what earlier heads left: k
    evictions cost one sort, not k scans of the running set. `on_step` ends the phase.
    """

    def __init__(self, policy: RankedPolicy, scheduler: SchedulerView):
        self.policy, self.scheduler = policy, scheduler
        self.running = list(scheduler.running)
        self.ranks = [policy.rank(r) for r in self.running]
        self.worst = max(self.ranks, default=None)
        self.order: Optional[list[Request]] = None  # sorted lazily: most phases evict nobody

    def _sort(self) -> None:
        view = self.scheduler
        keyed = sorted(zip(self.ranks, (r.admit_seq for r in self.running), self.running), reverse=True)
        self.order = [req for _, _, req in keyed]
        self.neg_ranks = [-rank for rank, _, _ in keyed]  # ascending
        self.held = [0]  # held[i]: pages of order[:i]
        for req in self.order:
            self.held.append(self.held[-1] + view.pages_held(req.request_id))
        self.next = 0

    def take(self, waiting: Request) -> Optional[Request]:
        bar = self.policy.rank(waiting)
        if self.worst is None or self.worst <= bar:
            return None
        if self.order is None:
            self._sort()
        end = bisect.bisect_left(self.neg_ranks, -bar)  # order[:end] rank strictly worse
        while self.next < end and self.order[self.next].status is not Status.RUNNING:
            self.next += 1  # only if `schedule` ran twice without `on_step`: never evict a stranger
        if end <= self.next:
            return None
        # Evict nothing unless evicting every outranked request would make room for the head.
        # Their summed pages bound what evicting them frees; a prefix page another running
        # request shares stays held, so where the bound is met the exact count decides.
        view = self.scheduler
        need = view.admission_pages(waiting)
        free = view.num_free_pages
        if need > free + self.held[end] - self.held[self.next]:
            return None
        if need > free and need > free + view.pages_freed_by(r.request_id for r in self.order[self.next : end]):
            return None
        victim = self.order[self.next]
        self.next += 1
        return victim
