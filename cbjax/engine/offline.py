"""Offline serving: a list of requests, each at its arrival time, through one `EngineLoop`."""

from __future__ import annotations

import time
from typing import Callable, Optional

from cbjax.core.executor import Executor
from cbjax.core.plan import Schedule
from cbjax.core.request import Request
from cbjax.core.results import RunResult
from cbjax.core.stop import StopFlag
from cbjax.engine.drive import drive
from cbjax.engine.followups import arrivals
from cbjax.engine.loop import EngineLoop
from cbjax.scheduler.core import Scheduler


def serve(
    requests: list[Request],
    scheduler: Scheduler,
    executor: Executor,
    *,
    progress: bool = False,
    max_iterations: Optional[int] = None,
    on_step: Optional[Callable[[Schedule, float, int, list[Request]], None]] = None,
    stop: Optional[StopFlag] = None,
    on_finish: Optional[Callable[[Request], None]] = None,
    tick: Optional[Callable[[], None]] = None,
    pace: str = "none",
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    stretches: bool = True,
) -> RunResult:
    """Serve `requests` (any order) offline, each at its `arrival_s`; every request ends with a
    fate. `stop` is checked at each iteration boundary (and while idle): once set, the loop
    ends, what had arrived and is unfinished is aborted, and what had not arrived ends as
    `not_arrived`. `max_iterations` caps the run the same way. `stretches=False` plans (and
    hands the executor) every step of a decode stretch on its own (`cbjax.engine.loop.run_stretch`):
    the same results, more slowly. A session's later turns (`pause_s` set) arrive as the turns
    before them end (`cbjax.engine.followups`)."""
    pending, followups, on_finish = arrivals(requests, on_finish)
    loop = EngineLoop(
        scheduler, executor, pace=pace, on_step=on_step, on_finish=on_finish, tick=tick,
        progress=progress, total=len(requests), clock=clock, sleep=sleep, stretches=stretches,
    )  # fmt: skip
    loop.clock.restart()

    def admit(req: Request, now: float) -> EngineLoop:
        loop.add(req, now)
        loop.boundary()  # a rejection is reported at once
        return loop

    interrupted = drive([loop], pending, admit, stop=stop, max_iterations=max_iterations)
    loop.abort_all(list(pending) + (followups.close() if followups is not None else []))
    result = run_result(loop, interrupted)
    loop.close()
    # offline, requests come back in the caller's order
    result.requests = list(requests)
    return result


def run_result(loop: EngineLoop, interrupted: bool = False) -> RunResult:
    """The loop's run so far, for summary.json and requests.jsonl."""
    sched, clock = loop.scheduler, loop.clock
    return RunResult(
        requests=list(loop.requests), stats=loop.stats, num_slots=sched.max_num_seqs,
        makespan_s=clock.last_end, preemptions=sched.num_preemptions,
        wall_s=clock.clock() - clock.wall0, extra=sched.cache_stats(), tbt_s=sched.tbt_s,
        interrupted=interrupted,
    )  # fmt: skip
