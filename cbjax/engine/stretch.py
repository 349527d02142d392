"""Decode stretches on a virtual clock: the steps of a decode stretch run as one plan.

The functions here take an `EngineLoop` (`cbjax.engine.loop`, which imports this module).

`run_stretch` runs the steps of a decode stretch (`cbjax.scheduler.stretch`) that start before
the loop's next event as one plan: several steps of the same decodes, each a token further,
priced, run and recorded step by step, with the results of the same steps run one at a time.

Priced ahead (`ahead`): a loop among several, none of whose steps reaches another's (a
colocated cluster: only arrivals, routed by what each replica holds, join them), prices the
whole stretch, runs the steps that start before the next arrival and keeps the rest
(`Ahead`) for later. Until the stretch's last step begins, no waiting or running count of the
loop moves (a step of a stretch ends no request before its last), so the rest waits, untouched,
until that step is due or an arrival joins the loop (`EngineLoop.add` runs first what began
before it). Its pages are counted as taken by then (`pages_ahead`) for a router that reads them.
"""

from __future__ import annotations

from functools import reduce
from operator import add
from time import perf_counter
from typing import Optional

_INF = float("inf")


class Ahead:
    """Priced steps of a decode stretch not run yet: the first begins at `start`."""

    __slots__ = ("start", "durations", "last_start")

    def __init__(self, start: float, durations: list[float]):
        self.start, self.durations = start, durations
        self.last_start = reduce(add, durations[:-1], start)  # as the clock sums the steps' ends


def steps_before(start: float, durations: list[float], t: float) -> int:
    """How many steps of `durations`, the first beginning at `start`, begin before `t`."""
    n = 0
    for d in durations:
        if start >= t:
            break
        n += 1
        start = start + d
    return n


def run_stretch(loop, start: float, until: float, max_steps: Optional[int], ahead: bool = False) -> bool:
    """Run the next steps of `loop` as a decode stretch if two or more start before `until`
    (at most `max_steps`); False, having run nothing, otherwise. `ahead`: price the whole
    stretch and keep the steps from `until` on as `loop.ahead`."""
    sched, stats = loop.scheduler, loop.stats
    pending, loop.ahead = loop.ahead, None
    if pending is not None and pending.start == start:
        durations = pending.durations
    else:
        first, num_steps = sched.stretch_steps(start)
        if max_steps is not None and num_steps > max_steps:
            num_steps = max_steps
        if num_steps < 2:
            return False
        durations = loop.clock.timeline.price_stretch(first, start, _INF if ahead else until, num_steps)
    num_run = steps_before(start, durations, until) if ahead else len(durations)
    if num_run < 2:
        return False
    if num_run < len(durations):
        durations, rest = durations[:num_run], durations[num_run:]
    else:
        rest = None
    t_sched = perf_counter()
    plan = sched.schedule_stretch(start, num_run)
    stats.schedule_s += perf_counter() - t_sched
    requests = sched.requests_of(plan)
    batched = loop.recorder.planned(plan)
    out = loop.executor.execute(plan)
    ends = loop.clock.run_stretch(start, durations)
    stats.busy_s = reduce(add, durations, stats.busy_s)  # as the steps one by one add them
    t_post = perf_counter()
    done = sched.postprocess(plan, out.token_ids, ends[-1], out.errors, ends=ends)
    stats.postprocess_s += perf_counter() - t_post
    loop.finished_steps(plan, batched, done, tuple(ends), requests)
    if rest is not None:
        loop.ahead = Ahead(ends[-1], rest)
    return True


def next_time(loop) -> float:
    """When `loop` next changes what it holds: now, or where the last step of its stretch
    priced ahead begins."""
    return loop.ahead.last_start if loop.ahead is not None else loop.clock.now()


def pages_ahead(loop, t: float) -> int:
    """Pages that the steps `loop` priced ahead beginning before `t` take (0 without any)."""
    if loop.ahead is None:
        return 0
    ahead = loop.ahead
    return loop.scheduler.stretch.pages_for_steps(steps_before(ahead.start, ahead.durations, t))


def catch_up(loop, t: float) -> None:
    """Run the steps `loop` priced ahead that begin before `t`; the rest are priced again."""
    while loop.ahead is not None:
        if loop.ahead.start >= t:
            loop.ahead = None
        else:
            loop.step(t, ahead=True)
