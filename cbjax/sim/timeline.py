"""The one owner of simulated time: when each step begins and ends on a virtual clock (no jax).

A cost model prices a step from its plan and a `StepContext`; the timeline is what knows the
context (is a step in flight, did the loop idle before this plan, what ran before) and turns
prices into spans. Run to completion, a step spans `[start, start + total_s]`.

Pipelined, as the engine runs with `executor.async_scheduling`, the loop launches step t + 1
before it collects step t. The device runs launched steps one after another, so a step begins
when its launch's host time is over (`StepTime.launch_s`, from where the loop collected the
step before) and the step before it is done, whichever is later; the step in flight is
collected no earlier than that launch returns (and `StepTime.collect_share` of its own device
time after it), so a launch that outlasts it delays its end. A launch with a step in flight
takes `StepTime.held_s` more (where the host and the device share a CPU core, its step's compute
holds the core the loop needs).
A step collected with nothing launched behind it (the loop goes idle, the run ends, or the
next plan needs its tokens) ends at its `drain_s` share: the host time the next launch would
otherwise hide is not there.

A host-tier prefetch (`HostCopies.prefetch`, priced as `StepTime.prefetch_s`) runs on the copy
engine beside the steps, from its step's begin and after the copy engine's previous prefetch;
a later step whose rows read one of its pages (a row sent with its page table) begins no
earlier than that copy ends.
"""

from __future__ import annotations

from collections import deque
from itertools import accumulate
from operator import add
from typing import Optional

from cbjax.core.plan import Schedule
from cbjax.core.timing import NO_CONTEXT, CostModel, StepContext, StepTime


def shifted(plan: Schedule, j: int) -> Schedule:
    """`plan` (one decode step) with every row `j` tokens further: a stretch's step j."""
    if not j:
        return plan
    rows = [s._replace(num_computed=s.num_computed + j) for s in plan.scheduled]
    return Schedule(plan.num_slots, rows, [], plan.start_s, [], [], plan.page_size, plan.step_id, None)


class VirtualStep:
    """A launched step on the virtual clock: its plan's time and its span."""

    __slots__ = ("time", "begin", "end", "rows")

    def __init__(self, time: StepTime, begin: float, end: float, rows: int):
        self.time, self.begin, self.end, self.rows = time, begin, end, rows


class Timeline:
    """Spans for one loop's steps under `cost`; the only state is what the system holds."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        history = cost.history
        self._recent: Optional[deque[int]] = deque(maxlen=history) if history else None
        self._free = 0.0  # where the device is free: the end of the latest launched step
        self._last_end: Optional[float] = None  # where the latest collected step ended
        self._in_flight: Optional[VirtualStep] = None  # launched, not collected yet
        # decode stretches price their steps one by one from the first's context, which holds
        # for a cost model that reads no earlier steps
        self.stretches = not history
        self._copies_free = 0.0  # where the copy engine is free of prefetches
        self._loading: dict[int, float] = {}  # device page -> when its prefetch ends
        self._load_times = (0.0, 0.0)  # the latest priced plan with host copies: (load_s, prefetch_s)

    def load_times(self) -> tuple[float, float]:
        """(load_s, prefetch_s) of the latest plan priced with host-tier copies."""
        return self._load_times

    def _copies(self, plan: Schedule, time: StepTime, begin: float) -> float:
        """Where a step planned to begin at `begin` begins, once the prefetches its rows read
        have ended; starts its own prefetch there."""
        loading = self._loading
        if loading:
            for s in plan.scheduled:
                if s.page_table is not None:
                    for page in s.page_table:
                        end = loading.get(page)
                        if end is not None and end > begin:
                            begin = end
            self._loading = {p: e for p, e in loading.items() if e > begin}
        if plan.host_copies is not None:
            self._load_times = (time.load_s, time.prefetch_s)
            if time.prefetch_s:
                start = begin if begin > self._copies_free else self._copies_free
                end = self._copies_free = start + time.prefetch_s
                for _, _, pages in plan.host_copies.prefetch:
                    self._loading.update(dict.fromkeys(pages, end))
        return begin

    def _context(self, plan: Schedule, start: float, in_flight_rows: int) -> StepContext:
        last = self._last_end
        idle = start - last if not in_flight_rows and last is not None and start > last else 0.0
        recent = self._recent
        if recent is None:
            if not (idle or in_flight_rows):
                return NO_CONTEXT
            return StepContext(in_flight_rows, idle)
        ctx = StepContext(in_flight_rows, idle, tuple(recent))
        recent.appendleft(sum(n for n, _, _ in plan.cost_rows()))
        return ctx

    def run(self, plan: Schedule, start: float) -> tuple[float, float]:
        """A step run to completion from `start`: its (duration, end)."""
        time = self.cost(plan, self._context(plan, start, 0))
        duration = time.total_s
        if self._loading or plan.host_copies is not None:
            start = self._copies(plan, time, start)
        end = start + duration
        self._last_end = self._free = end
        return duration, end

    def price_stretch(self, plan: Schedule, start: float, until: float, num_steps: int) -> list[float]:
        """The durations of a decode stretch's steps that start before `until`, at most
        `num_steps`, the first being `plan`'s (one step) from `start` and step j its rows a token
        further; each as `run` would price it one by one. Prices only: nothing moves."""
        ctx = self._context(plan, start, 0)
        stretch = getattr(self.cost, "stretch_s", None)
        out = stretch(plan, ctx, start, until, num_steps) if stretch is not None else None
        if out is not None:
            return out
        out, t = [], start
        for j in range(num_steps):
            if t >= until:
                break
            d = self.cost(shifted(plan, j), ctx if j == 0 else NO_CONTEXT).total_s
            out.append(d)
            t += d
        return out

    def run_stretch(self, start: float, durations: list[float]) -> list[float]:
        """A decode stretch's steps back to back from `start` (`price_stretch`'s durations):
        their ends."""
        ends = accumulate(durations, add, initial=start)  # summed in order, as one by one
        next(ends)
        ends = list(ends)
        self._last_end = self._free = ends[-1] if ends else start
        return ends

    def launch(self, plan: Schedule, start: float) -> VirtualStep:
        """A pipelined step planned at `start`, while the step in flight (if any) runs."""
        prev = self._in_flight
        time = self.cost(plan, self._context(plan, start, prev.rows if prev is not None else 0))
        launched = start + time.launch_s
        if prev is not None:
            launched += time.held_s  # on a shared core: the step's compute before the loop's next work
            if time.launch_s:
                # the loop collects it only after this launch returns, and the work it still owes
                collected = launched + time.collect_share * prev.time.device_s
                if collected > prev.end:
                    prev.end = collected
                    if collected > self._free:
                        self._free = collected
        begin = launched if launched > self._free else self._free
        if self._loading or plan.host_copies is not None:
            begin = self._copies(plan, time, begin)
        rows = len(plan.padded_rows) if plan.padded_rows is not None else len(plan.scheduled)
        step = self._in_flight = VirtualStep(time, begin, begin + time.total_s, rows)
        self._free = step.end
        return step

    def land(self, step: VirtualStep, covered: bool) -> tuple[float, float]:
        """The loop collects `step`; `covered`: it launched the next step first. Its (begin, end)."""
        drain = step.time.drain_s
        if not covered and drain is not None and step.begin + drain < step.end:
            step.end = step.begin + drain
            self._free = step.end  # nothing was launched after it
        if step is self._in_flight:
            self._in_flight = None
        self._last_end = step.end
        return step.begin, step.end
