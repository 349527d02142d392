"""The loop's running sums (`IterationStats`) and its progress bar: observers of each iteration."""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Optional

from cbjax.core.plan import Schedule
from cbjax.core.request import Request
from cbjax.core.results import IterationStats
from cbjax.scheduler.core import Scheduler

_NEW_TOKENS = attrgetter("num_new_tokens")


class StatsRecorder:
    """Counts each plan as it leaves the scheduler and each request as it ends."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.stats = IterationStats()
        alloc = scheduler.allocator
        self._pool_slots = alloc.num_usable_pages * alloc.page_size

    def planned(self, plan: Schedule) -> int:
        """The iteration's counters, as the plan leaves the scheduler; returns its batched tokens
        (per step, for a decode stretch)."""
        if plan.num_steps > 1:
            return self._planned_stretch(plan)
        stats, sched = self.stats, self.scheduler
        alloc = sched.allocator
        scheduled = plan.scheduled
        batched = sum(map(_NEW_TOKENS, scheduled))  # plan.num_batched_tokens, without its list
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

    def _planned_stretch(self, plan: Schedule) -> int:
        """A decode stretch's steps, counted as `planned` counts each step when it leaves the
        scheduler. The stretch's plan stores all its steps' tokens at once, and takes the pages
        of all its steps (`DecodeStretch.growth`): before step j of n, (n - 1 - j) tokens a row
        less were stored, the pages later steps took were free, and the slots they filled were
        not; nothing else of the pool moves."""
        stats, sched = self.stats, self.scheduler
        alloc = sched.allocator
        rows = len(plan.scheduled)
        n = plan.num_steps
        used = alloc.num_used_pages
        token, reserved, internal, external, free = sched.kv_breakdown()
        stored = alloc.num_stored_tokens
        ps = alloc.page_size
        sums, pool = stats.kv_share_sums, self._pool_slots
        growth = sched.stretch.growth if sched.stretch is not None else ()
        # the pages and filled slots that steps after step j took: all of them, less those taken
        # by step j and before
        later = sum(g[1] for g in growth)
        later_filled = sum(g[2] for g in growth)
        g, num_growth, later_sum = 0, len(growth), 0
        ext = external / pool
        util, s0, s1, s2, s3, s4 = stats.kv_util_sum, sums[0], sums[1], sums[2], sums[3], sums[4]
        j = 0
        while j < n:
            while g < num_growth and growth[g][0] == j:
                later -= growth[g][1]
                later_filled -= growth[g][2]
                g += 1
            end = growth[g][0] if g < num_growth and growth[g][0] < n else n  # until the pool moves again
            step_used = used - later
            later_sum += later * (end - j)
            denom = step_used * ps
            filled = reserved - later_filled
            # the shares are float sums: added step by step, as `planned` adds them; the terms
            # that stay put until the pool moves again are the same floats at each step
            held, free_share = (internal - later * ps + later_filled) / pool, (free + later * ps) / pool
            for behind in range((n - 1 - j) * rows, (n - 1 - end) * rows, -rows):
                util += (stored - behind) / denom if step_used else 1.0
                s0 += (token - behind) / pool
                s1 += (filled + behind) / pool
                s2 += held
                s4 += free_share
            if ext:  # (0.0 in a paged pool: adding it changes nothing)
                for _ in range(j, end):
                    s3 += ext
            j = end
        stats.kv_util_sum = util
        sums[0], sums[1], sums[2], sums[3], sums[4] = s0, s1, s2, s3, s4
        stats.iterations += n
        stats.occupied_slot_iterations += rows * n
        stats.batched_tokens += rows * n
        stats.pages_used_sum += used * n - later_sum
        if used > stats.pages_used_peak:
            stats.pages_used_peak = used
        if rows > stats.batch_peak:
            stats.batch_peak = rows
        return rows

    def ended(self, done: list[Request], iteration: int) -> None:
        """The requests a step finished, at its iteration (1-based)."""
        finish_iteration = self.stats.finish_iteration
        for req in done:
            finish_iteration[req.request_id] = iteration


class TokenReporter:
    """Hands each request's new tokens to `on_token(request, token_id, now)` as steps end;
    `real`: the executor's tokens (else simulated: None each)."""

    def __init__(self, on_token: Callable[[Request, Optional[int], float], None], real: bool):
        self.on_token, self.real = on_token, real
        self._sent: dict[Request, int] = {}  # tokens reported so far per request

    def report(self, requests: list[Request], now: float) -> bool:
        """Report the requests' new tokens; True if there were any."""
        real, sent, on_token = self.real, self._sent, self.on_token
        any_new = False
        for req in requests:
            have = len(req.output_token_ids) if real else req.num_generated
            done = sent.get(req, 0)
            if have > done:
                for k in range(done, have):
                    on_token(req, req.output_token_ids[k] if real else None, now)
                sent[req] = have
                any_new = True
        return any_new

    def forget(self, req: Request) -> None:
        """The request ended: nothing more of it is reported."""
        self._sent.pop(req, None)


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
