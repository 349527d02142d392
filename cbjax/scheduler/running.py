"""The running requests and the fixed slot array they hold (no jax): admission into a slot,
release, and the end of a running request."""

from __future__ import annotations

import heapq
from typing import Optional

from cbjax.core.request import FinishReason, Request, Status


class RunningSet:
    """The requests that hold a slot, in admission order, and which slot each holds.

    Admission takes the lowest free slot. A release frees the slot and the request's pages, and
    tells the plan writer, whose next plans send the slot's state afresh. A prefill replica of
    an engine cluster keeps a finished request's pages until its K/V is copied out
    (`hold_finished_pages`, then `held_pages` and `release_held`): a later plan would
    overwrite them.
    """

    def __init__(self, num_slots: int, allocator, writer, prefix=None):
        self.allocator = allocator  # PageAllocator or ReservationAllocator: free
        self.writer = writer  # PlanWriter: admitted, released
        self.prefix = prefix  # PrefixCache or None: forget
        self.running: list[Request] = []
        self.slots: list[Optional[Request]] = [None] * num_slots
        self._free_slots = list(range(num_slots))  # a min-heap
        self._num_admitted = 0
        # request id -> the tokens it stores at its final length (its stopping length as known),
        # for every request in a slot: what `Scheduler.kv_breakdown` pairs with the page tables
        self.final_tokens: dict[str, int] = {}
        self.hold_finished_pages = False
        self._held: set[str] = set()
        self._ended: list[Request] = []  # finished, still in `running` until `prune`

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def admit(self, req: Request, now: float) -> None:
        """`req` takes the lowest free slot and runs (its pages are allocated already)."""
        req.status = Status.RUNNING
        req.slot = heapq.heappop(self._free_slots)
        self.slots[req.slot] = req
        self._num_admitted += 1
        req.admit_seq = self._num_admitted
        self.writer.admitted(req.request_id)
        self.final_tokens[req.request_id] = req.prompt_len + req.max_output_len - 1
        if req.scheduled_s is None:
            req.scheduled_s = now
        self.running.append(req)

    def release(self, req: Request, keep_pages: bool = False) -> None:
        """Free `req`'s slot, and its pages unless `keep_pages`; it stays in `running`."""
        if not keep_pages:
            self.allocator.free(req.request_id)
        self.writer.released(req.request_id)
        del self.final_tokens[req.request_id]
        self.slots[req.slot] = None
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1

    def evict(self, req: Request) -> None:
        """Take a preempted or aborted request out: its slot and pages are free."""
        self.release(req)
        self.running.remove(req)

    def evict_all(self) -> list[Request]:
        """Take every request out (a run cut short); returns them, in admission order."""
        out = self.running
        for req in out:
            self.release(req)
        self.running, self._ended = [], []
        return out

    def finish(self, req: Request, reason: Optional[FinishReason], now: Optional[float]) -> None:
        """End a running request with `reason` at `now` (both None: recorded later) and release
        its slot; it stays in `running` until `prune`, so a step's ends cost one pass."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._ended.append(req)
        req.finish_s = now
        if self.hold_finished_pages:
            self._held.add(req.request_id)
        self.release(req, keep_pages=self.hold_finished_pages)
        if self.prefix is not None:
            self.prefix.forget(req)

    def prune(self) -> None:
        """Drop the requests that ended from `running`, as a new list (`DecodeStretch` sees a
        changed running list by its identity)."""
        running = self.running.copy()
        for req in self._ended:
            running.remove(req)
        self._ended = []
        self.running = running

    def held_pages(self, request_id: str) -> list[int]:
        """The pages a finished request holds (`hold_finished_pages`), in token order."""
        if request_id not in self._held:
            raise KeyError(f"request {request_id}: holds no pages (finished without hold_finished_pages?)")
        return list(self.allocator.page_tables[request_id])

    def release_held(self, request_id: str) -> None:
        """Free a finished request's held pages (no-op if it holds none)."""
        if request_id in self._held:
            self._held.discard(request_id)
            self.allocator.free(request_id)
