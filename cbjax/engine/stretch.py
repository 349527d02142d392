"""Decode stretches on a virtual clock: several steps of the same decodes run as one plan.

When every running request decodes and nothing will arrive, finish or need a page for a while
(`cbjax.scheduler.stretch`), the steps that start before the next event (`until`, the drive
loop's) are priced by the timeline one by one, then written, run and recorded as one plan of
that many steps (`Schedule.num_steps`). Every step keeps its own time, tokens and counters:
the run's results are those of the same steps run one at a time, to the last bit.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from cbjax.engine.loop import EngineLoop

_perf_counter = time.perf_counter


def run_stretch(loop: "EngineLoop", start: float, until: float, max_steps: Optional[int]) -> bool:
    """Run the next steps of `loop` as a decode stretch if two or more start before `until`
    (at most `max_steps`); False, having changed nothing, otherwise."""
    sched, stats = loop.scheduler, loop.stats
    first, num_steps = sched.stretch_steps(start)
    if max_steps is not None and num_steps > max_steps:
        num_steps = max_steps
    if num_steps < 2:
        return False
    durations = loop.clock.timeline.price_stretch(first, start, until, num_steps)
    if len(durations) < 2:
        return False
    t_sched = _perf_counter()
    plan = sched.schedule_stretch(start, len(durations))
    stats.schedule_s += _perf_counter() - t_sched
    requests = sched.requests_of(plan)
    batched = loop.recorder.planned(plan)
    out = loop.executor.execute(plan)
    ends = loop.clock.run_stretch(start, durations)
    for d in durations:
        stats.busy_s += d
    t_post = _perf_counter()
    done = sched.postprocess(plan, out.token_ids, ends[-1], out.errors, ends=ends)
    stats.postprocess_s += _perf_counter() - t_post
    loop.finished_steps(plan, batched, done, tuple(ends), requests)
    return True
