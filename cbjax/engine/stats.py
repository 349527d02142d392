"""The loop's running sums (`IterationStats`) and its progress bar: observers of each iteration."""

from __future__ import annotations

from typing import Optional

from cbjax.core.plan import Schedule
from cbjax.core.request import Request
from cbjax.core.results import IterationStats
from cbjax.scheduler.core import Scheduler


class StatsRecorder:
    """Counts each plan as it leaves the scheduler and each request as it ends."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.stats = IterationStats()
        alloc = scheduler.allocator
        self._pool_slots = alloc.num_usable_pages * alloc.page_size

    def planned(self, plan: Schedule) -> int:
        """The iteration's counters, as the plan leaves the scheduler; returns its batched tokens."""
        stats, sched = self.stats, self.scheduler
        alloc = sched.allocator
        scheduled = plan.scheduled
        batched = 0
        for s in scheduled:  # plan.num_batched_tokens, without its list
            batched += s.num_new_tokens
        num_scheduled = len(scheduled)
        stats.iterations += 1
        stats.occupied_slot_iterations += num_scheduled
        stats.batched_tokens += batched
        used = alloc.num_used_pages
        stats.pages_used_sum += used
        if used > stats.pages_used_peak:
            stats.pages_used_peak = used
        stats.kv_util_sum += alloc.token_utilization(used)
        sums, pool = stats.kv_share_sums, self._pool_slots
        token, reserved, internal, external, free = sched.kv_breakdown()
        sums[0] += token / pool
        sums[1] += reserved / pool
        sums[2] += internal / pool
        sums[3] += external / pool
        sums[4] += free / pool
        if num_scheduled > stats.batch_peak:
            stats.batch_peak = num_scheduled
        return batched

    def ended(self, done: list[Request], iteration: int) -> None:
        """The requests a step finished, at its iteration (1-based)."""
        finish_iteration = self.stats.finish_iteration
        for req in done:
            finish_iteration[req.request_id] = iteration


class ProgressBar:
    """Finished requests out of `total`, on a tqdm bar on stderr."""

    def __init__(self, total: Optional[int]):
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", desc="serving", mininterval=0.5, leave=False)
        self._reported = 0

    def update(self, finished: int) -> None:
        if finished != self._reported:
            self._bar.update(finished - self._reported)
            self._reported = finished

    def close(self) -> None:
        self._bar.close()
