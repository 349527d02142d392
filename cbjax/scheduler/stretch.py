"""Decode stretches (no jax): runs of plans the scheduler can write without planning.

Once every running request is decoding, nothing waits and no request needs a new page within
the next k steps, each of those steps is exactly the one before with every context one token
longer: same requests, same order, same slots, no page-table change. `DecodeStretch` counts
such a stretch once, then writes its plans directly, as `Planner.plan` would have written them,
field for field: one step at a time (`next_plan`), or several steps as one plan
(`Schedule.num_steps`, `write`) when the loop knows how many of them start before anything
else happens. A request that finishes or leaves changes the running list, and the next plan
counts again. Plans carrying token ids (the engine's) are always planned.
"""

from __future__ import annotations

from typing import Optional

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request, Status
from cbjax.scheduler.output import PlanWriter
from cbjax.scheduler.policy import PolicyContract
from cbjax.scheduler.running import RunningSet


class DecodeStretch:
    """Counts and writes a stretch over `running_set`; `policy`'s queue must stay empty and
    the running list unchanged while it lasts (checked at each plan)."""

    def __init__(self, running_set: RunningSet, writer: PlanWriter, policy: PolicyContract, allocator, token_budget: int):
        self.running_set = running_set
        self.writer = writer
        self.policy = policy
        self.allocator = allocator
        self.token_budget = token_budget
        self._left = 0  # single-step plans the current stretch still holds
        self._running: Optional[list[Request]] = None  # the running list it was counted on
        self._size = 0

    def _current(self) -> int:
        """Steps the current stretch still holds (counted again when the running list changed
        or something waits)."""
        running = self.running_set.running
        if self._left <= 0 or running is not self._running or len(running) != self._size or len(self.policy):
            self._left = self._count(running)
            self._running, self._size = running, len(running)
        return self._left

    def next_plan(self, now: float) -> Optional[Schedule]:
        """The stretch's next single-step plan, or None when the next plan needs planning."""
        if self._current() <= 0:
            return None
        self._left -= 1
        return self._write(now, 1, 1)

    def steps(self, now: float) -> tuple[Optional[Schedule], int]:
        """(a one-step plan of the stretch's next step, without writing it: for pricing, and the
        steps the stretch holds from it), or (None, 0) when the next plan needs planning. Steps
        end before a request would outgrow its pages and at the latest at its last token."""
        if self._current() <= 0:
            return None, 0
        running = self.running_set.running
        rows = [ScheduledRequest(r.request_id, r.slot, r.num_computed, 1, True, None, False, None, None, True)
                for r in running]  # fmt: skip
        finish = min(r.max_output_len - r.num_generated for r in running)
        plan = Schedule(self.writer.num_slots, rows, [], now, [], [], self.allocator.page_size, 0, None)
        return plan, min(self._left, finish)

    def write(self, now: float, num_steps: int) -> Schedule:
        """The stretch's next `num_steps` steps as one plan (at most `steps`'s count)."""
        if not 1 <= num_steps <= self._current():
            raise ValueError(f"DecodeStretch.write: {num_steps} steps, the stretch holds {self._left}")
        self._left -= num_steps
        return self._write(now, num_steps, num_steps)

    def _count(self, running: list[Request]) -> int:
        """How many plans from the next one are pure continuations (0: the next is not)."""
        if not running or len(self.policy) or self.writer.token_ids or len(running) > self.token_budget:
            return 0
        tables, ps = self.allocator.page_tables, self.allocator.page_size
        status = Status.RUNNING
        left = None
        for req in running:
            computed = req.num_computed
            if req.status is not status or req.num_new_tokens or req.prompt_len + req.num_generated - computed != 1:
                return 0
            if not req.num_generated:  # its prefill's last token: the step yields its first token
                return 0
            # steps until its pages are full: the one after needs a new page
            n = len(tables[req.request_id]) * ps - computed
            if left is None or n < left:
                left = n
                if left <= 0:
                    return 0
        return left

    def _write(self, now: float, num_steps: int, tokens: int) -> Schedule:
        """The plan `Planner.plan` writes for the stretch's next step(s), with its side effects:
        each decode's tokens are stored in its pages, the writer counts the plans."""
        alloc = self.allocator
        running = self.running_set.running
        scheduled = []
        for req in running:
            computed = req.num_computed
            alloc.try_append(req.request_id, computed + tokens)  # within its pages (counted)
            req.num_new_tokens = 1  # per step; the stretch stores its later steps' tokens too
            scheduled.append(ScheduledRequest(req.request_id, req.slot, computed, 1, True, None, False, None, None, True))
        return self.writer.write_continuation(running, scheduled, now, num_steps)
