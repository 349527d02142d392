"""Decode stretches (no jax): runs of plans the scheduler can write without planning.

Once every running request is decoding and nothing waits, each of the next steps is exactly
the one before with every context one token longer: same requests, same order, same slots.
`DecodeStretch` counts such a stretch once, then writes its plans directly, as `Planner.plan`
would have written them, field for field: one step at a time (`next_plan`), or several steps
as one plan (`Schedule.num_steps`, `write`) when the loop knows how many of them start before
anything else happens. A request that finishes or leaves changes the running list, and the
next plan counts again. Plans carrying token ids (the engine's) are always planned.

A request whose pages fill during a stretch takes its next page at the step that needs it, as
the planner's `try_append` would, when the pool is paged, keeps no host tier, and holds free
or evictable pages for every such step of the stretch (`grows`), and no running request
learns the token ids of a page it fills (`PrefixCache.learns_pages`): then no step can
preempt or register a page, and the pages are taken in the planner's order (step by step,
each in running order), so every request gets the same pages and every eviction is the one
the planner's step makes. Otherwise a stretch ends before any request outgrows its pages.
"""

from __future__ import annotations

from typing import Optional

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request, Status
from cbjax.scheduler.output import PlanWriter, new_row
from cbjax.scheduler.policy import PolicyContract
from cbjax.scheduler.running import RunningSet


class DecodeStretch:
    """Counts and writes a stretch over `running_set`; `policy`'s queue must stay empty and
    the running list unchanged while it lasts (checked at each plan)."""

    def __init__(
        self, running_set: RunningSet, writer: PlanWriter, policy: PolicyContract, allocator, token_budget: int,
        grows: bool = False, prefix=None,
    ):  # fmt: skip
        self.running_set, self.writer, self.policy = running_set, writer, policy
        self.allocator, self.token_budget = allocator, token_budget
        self.grows = grows  # stretches may take new pages (see the module)
        self.prefix = prefix  # the PrefixCache, or None
        self._grows = False  # the current stretch takes new pages
        # the last written stretch's page growth, per step that took pages: (step, pages taken,
        # growth of the pool's filled slots), for the loop's per-step counters
        self.growth: list[tuple[int, int, int]] = []
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
        end at the latest at a request's last token, and, unless the stretch `grows`, before a
        request would outgrow its pages."""
        if self._current() <= 0:
            return None, 0
        running = self.running_set.running
        rows = [new_row(ScheduledRequest, (r.request_id, r.slot, r.num_computed, 1, True, None, False, None, None, True, 0))
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

    def pages_for_steps(self, num_steps: int) -> int:
        """The new pages the stretch's next `num_steps` steps take (0 unless it `grows`)."""
        if not self._grows or num_steps <= 0:
            return 0
        return _takes_before(self._first_takes(self.running_set.running), num_steps, self.allocator.page_size)

    def _first_takes(self, running: list[Request]) -> list[int]:
        """Per running request, the step (from 0) whose token outgrows its pages: step k stores
        num_computed + k + 1 tokens, so it takes a page at that step and every page_size after."""
        tables, ps = self.allocator.page_tables, self.allocator.page_size
        return [len(tables[r.request_id]) * ps - r.num_computed for r in running]

    def _count(self, running: list[Request]) -> int:
        """How many plans from the next one are pure continuations (0: the next is not)."""
        self._grows = False
        if not running or len(self.policy) or self.writer.token_ids or len(running) > self.token_budget:
            return 0
        status = Status.RUNNING
        for req in running:
            if req.status is not status or req.num_new_tokens or req.prompt_len + req.num_generated - req.num_computed != 1:
                return 0
            if not req.num_generated:  # its prefill's last token: the step yields its first token
                return 0
        firsts = self._first_takes(running)
        prefix = self.prefix
        self._grows = self.grows and not (prefix is not None and any(map(prefix.learns_pages, running)))
        if self._grows:
            return self._growing_count(running, firsts, self.allocator.num_free_pages)
        left = min(firsts)  # the steps before a request needs a new page
        return left if left > 0 else 0

    def _growing_count(self, running: list[Request], firsts: list[int], free: int) -> int:
        """`_count` for a stretch that takes pages (`grows`): the steps, up to the first request's
        last token, whose new pages `free` pages hold."""
        ps = self.allocator.page_size
        horizon = min(r.max_output_len - r.num_generated for r in running)
        if _takes_before(firsts, horizon, ps) <= free:
            return horizon
        steps = sorted(k for f in firsts for k in range(f, horizon, ps))
        return steps[free]  # the step that would take the first page the pool lacks

    def _write(self, now: float, num_steps: int, tokens: int) -> Schedule:
        """The plan `Planner.plan` writes for the stretch's next step(s), with its side effects:
        each decode's tokens are stored in its pages, the writer counts the plans."""
        alloc = self.allocator
        running = self.running_set.running
        if self._grows:
            grew = self._grow(running, num_steps)
        else:
            grew, self.growth = (), []
        scheduled = []
        for req in running:
            computed = req.num_computed
            alloc.try_append(req.request_id, computed + tokens)  # within its pages (counted)
            req.num_new_tokens = 1  # per step; the stretch stores its later steps' tokens too
            table = None
            if req in grew:  # its row carries its page table, as the planner's would
                table = tuple(alloc.page_tables[req.request_id])
                self.writer.sent_pages(req.request_id, len(table))
            scheduled.append(new_row(ScheduledRequest, (req.request_id, req.slot, computed, 1, True, None, False, table,
                                                        None, True, 0)))  # fmt: skip
        return self.writer.write_continuation(running, scheduled, now, num_steps)

    def _grow(self, running: list[Request], num_steps: int) -> set[Request]:
        """Take the pages the next `num_steps` steps need, in the planner's order (step by step,
        each in running order), and note the growth per step (`growth`). Returns the requests
        that took pages."""
        alloc = self.allocator
        tables, ps = alloc.page_tables, alloc.page_size
        finals = self.running_set.final_tokens
        takes = [(k, i, req) for i, (req, first) in enumerate(zip(running, self._first_takes(running)))
                 for k in range(first, num_steps, ps)]  # fmt: skip
        self.growth = growth = []
        if not takes:
            return set()
        takes.sort(key=lambda t: (t[0], t[1]))
        for k, _, req in takes:
            rid = req.request_id
            table = tables[rid]
            final = finals[rid]
            before = len(table) * ps
            alloc.try_append(rid, req.num_computed + k + 1)
            after = len(table) * ps
            # the pool's filled slots (`PageAllocator.slot_breakdown`): min(c, f) per request
            filled = (after if final >= after else final) - (before if final >= before else final)
            if growth and growth[-1][0] == k:
                growth[-1] = (k, growth[-1][1] + (after - before) // ps, growth[-1][2] + filled)
            else:
                growth.append((k, (after - before) // ps, filled))
        return {req for _, _, req in takes}


def _takes_before(firsts: list[int], num_steps: int, page_size: int) -> int:
    """The pages requests whose first takes are `firsts` (`DecodeStretch._first_takes`) take in
    steps 0 .. num_steps - 1."""
    return sum(1 + (num_steps - 1 - f) // page_size for f in firsts if f < num_steps)
