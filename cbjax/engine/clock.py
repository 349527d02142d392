"""The loop's clock: where a step begins and ends, on one of three clocks (no jax).

- `VirtualClock` (a simulated executor, `pace="none"`): time advances by each step's span on
  the executor's timeline and jumps over idle gaps;
- `PacedClock` (a simulated executor, `pace="realtime"`): the virtual clock follows the wall
  clock; each step's tokens are released at the step's simulated end, the loop sleeping until
  then, so an endpoint answers with the cost model's latencies;
- `WallClock` (the real engine): time is read from the wall clock.

Every clock runs a step to completion (`run`); the virtual and wall clocks also run a
pipelined loop's steps (`launch`, then `collect` once the next step is launched or the loop
needs the tokens). Both return the step's output, its busy seconds (its share of the clock)
and its end.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from cbjax.core.executor import Executor
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.timing import Timeline

PACES = ("none", "realtime")
# A paced loop within this much of its virtual clock counts as keeping up: steps chain on the
# virtual clock (start = the previous step's end) rather than on the wall clock, so sleep
# overshoot does not accumulate. Beyond it, time slips to the wall clock: an honest delay.
PACE_SLACK_S = 0.005


class Clock:
    """Seconds since the loop started. A subclass says how a step's span is found."""

    virtual = False  # time jumps over idle gaps (`advance_to`)
    stretches = False  # it runs decode stretches (`run_stretch`): a virtual, unpaced clock
    paced = False  # a virtual clock that follows the wall clock
    pipelines = False  # it can run a pipelined executor's steps (`launch`, `collect`)

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.clock, self.sleep = clock, sleep
        self.wall0 = self.t0 = clock()
        self.last_end = 0.0  # where the latest step ended

    def now(self) -> float:
        return self.clock() - self.t0

    def stamp(self) -> float:
        """The arrival time of a request reaching the loop now."""
        return self.clock() - self.t0

    def restart(self, t0: Optional[float] = None) -> None:
        """Start at 0 now, or at `t0` on the wall clock (several loops sharing one origin)."""
        self.wall0 = self.t0 = self.clock() if t0 is None else t0

    def advance_to(self, t: float) -> None:
        """The loop is idle until `t` (a virtual clock jumps there)."""

    def run(self, executor: Executor, plan: Schedule, start: float) -> tuple[StepOutput, float, float]:
        """Run `plan`'s step to completion from `start`: its output, busy seconds and end."""
        raise NotImplementedError

    def launch(self, executor: Executor, plan: Schedule, start: float) -> Any:
        raise NotImplementedError(f"{type(self).__name__} runs each step to completion")

    def collect(self, executor: Executor, handle: Any, covered: bool) -> tuple[StepOutput, float, float]:
        raise NotImplementedError(f"{type(self).__name__} runs each step to completion")

    def load_times(self, executor: Executor) -> tuple[float, float]:
        """(load_s, prefetch_s): the seconds the host-tier loads and prefetches of the step just
        run or launched took, as the executor measured them (`Executor.host_load_times`)."""
        return executor.host_load_times()


class WallClock(Clock):
    pipelines = True

    def run(self, executor: Executor, plan: Schedule, start: float) -> tuple[StepOutput, float, float]:
        begin = self.now()
        out = executor.execute(plan)
        self.last_end = end = self.now()
        return out, end - begin, end

    def launch(self, executor: Executor, plan: Schedule, start: float) -> Any:
        return executor.launch(plan)

    def collect(self, executor: Executor, handle: Any, covered: bool) -> tuple[StepOutput, float, float]:
        out = executor.collect(handle)
        end = self.now()
        # the step's share of the wall clock: from its launch, or from the last step's end
        begin = max(handle.start - self.t0, self.last_end)
        self.last_end = end
        return out, end - begin, end


class VirtualClock(Clock):
    virtual = True
    pipelines = True

    def __init__(self, timeline: Timeline, clock: Callable[[], float] = time.perf_counter, sleep=time.sleep):
        super().__init__(clock, sleep)
        self.timeline = timeline
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def stamp(self) -> float:
        return self._now

    def restart(self, t0: Optional[float] = None) -> None:
        super().restart(t0)
        self._now = 0.0

    def advance_to(self, t: float) -> None:
        if self._now < t:
            self._now = t

    def run(self, executor: Executor, plan: Schedule, start: float) -> tuple[StepOutput, float, float]:
        out = executor.execute(plan)
        duration, end = self.timeline.run(plan, start)
        self._now = self.last_end = end
        return out, duration, end

    def load_times(self, executor: Executor) -> tuple[float, float]:
        """As the timeline priced them."""
        return self.timeline.load_times()

    @property
    def stretches(self) -> bool:
        return not self.paced and self.timeline.stretches

    def run_stretch(self, start: float, durations: list[float]) -> list[float]:
        """A decode stretch's steps from `start`, priced already: their ends."""
        ends = self.timeline.run_stretch(start, durations)
        self._now = self.last_end = ends[-1]
        return ends

    def launch(self, executor: Executor, plan: Schedule, start: float) -> Any:
        return executor.execute(plan), self.timeline.launch(plan, start)

    def collect(self, executor: Executor, handle: Any, covered: bool) -> tuple[StepOutput, float, float]:
        out, step = handle
        begin, end = self.timeline.land(step, covered)
        if end > self._now:
            self._now = end
        self.last_end = self._now
        return out, end - begin, end


class PacedClock(VirtualClock):
    """A virtual clock paced to the wall clock; it runs each step to completion."""

    virtual = False
    paced = True
    pipelines = False

    def now(self) -> float:
        wall = self.clock() - self.t0
        if wall - self._now < PACE_SLACK_S:
            return self._now  # keeping up: the next step starts where the last one ended
        return wall

    def stamp(self) -> float:
        """An arrival is stamped when it happened; a paced loop's `now` may trail the wall clock
        by up to PACE_SLACK_S, and the arrival waits for the first boundary at or after it."""
        return self.clock() - self.t0

    def advance_to(self, t: float) -> None:
        """Idle until `t`: the next step starts at `t`, as offline, or at the wall clock if the
        loop comes to it more than PACE_SLACK_S late."""
        if self._now < t:
            self._now = t

    def run(self, executor: Executor, plan: Schedule, start: float) -> tuple[StepOutput, float, float]:
        out = executor.execute(plan)
        duration, end = self.timeline.run(plan, start)
        delay = end - (self.clock() - self.t0)
        if delay > 0:
            self.sleep(delay)
        self._now = self.last_end = end
        return out, duration, end


def make_clock(
    executor: Executor,
    pace: str = "none",
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> Clock:
    """The clock for `executor`: virtual (or paced, `pace="realtime"`) on its timeline, else wall."""
    if pace not in PACES:
        raise ValueError(f"executor.pace: unknown value {pace!r}; choose one of {', '.join(PACES)}")
    timeline = executor.timeline() if executor.virtual_clock else None
    if timeline is None:
        return WallClock(clock, sleep)
    return (VirtualClock if pace == "none" else PacedClock)(timeline, clock, sleep)
