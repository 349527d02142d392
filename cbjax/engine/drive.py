"""The one drive loop: arrivals in time order, the loops' iterations, and the events a cluster
schedules between its replicas (a prefill's end, a KV transfer's end), for one replica or many,
simulated or real (no jax).

On a virtual clock it jumps from event to event: the next thing to happen is the earliest of
an arrival, a cluster event and a busy loop's next iteration (which starts where its last one
ended); at equal times a cluster event comes first, then an arrival, then an iteration, so an
iteration starting at t sees everything that arrived by t. A loop whose next iteration still
comes first after it ran goes on at once. An arrival may join `pending` while the loop runs
(a session's next turn, released as the turn before it ends: `cbjax.engine.followups`); it
is met in time order, as the others.

On the wall clock (the engine, or a paced simulator) it runs in turns: each turn admits the
arrivals due by now, then steps every loop with work once; idle, it naps until the next arrival.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
from collections import deque
from typing import Any, Callable, Optional, Sequence

from cbjax.core.request import Request
from cbjax.core.stop import StopFlag
from cbjax.engine.loop import EngineLoop
from cbjax.engine.stretch import next_time

_INF = float("inf")
# an idle wall-clock driver naps at most this long, so a stop request is not kept waiting
NAP_S = 0.1


class Events:
    """A cluster's own events on the virtual clock: (time, kind, payload), earlier kinds first at
    equal times. `handle(t, kind, payload)` runs each; it returns the loop it gave work to (its
    clock moves to `t`), or None."""

    def __init__(self, handle: Callable[[float, int, Any], Optional[EngineLoop]]):
        self.handle = handle
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, kind, self._seq, payload))

    def next_time(self) -> float:
        return self.heap[0][0] if self.heap else _INF

    def pop(self) -> Optional[EngineLoop]:
        t, kind, _, payload = heapq.heappop(self.heap)
        return self.handle(t, kind, payload)


def drive(
    loops: Sequence[EngineLoop],
    pending: deque[Request],
    admit: Callable[[Request, float], Optional[EngineLoop]],
    *,
    events: Optional[Events] = None,
    stop: Optional[StopFlag] = None,
    max_iterations: Optional[int] = None,
    released: bool = False,
) -> bool:
    """Serve `pending` (sorted by `arrival_s`) through `loops` until nothing is left to do;
    `admit(req, t)` hands an arrival to a loop (returning it, or None). True when `stop` ended
    the run early (`max_iterations`, a cap on the first loop's iterations, ends it too, as
    finished). `released`: arrivals may join `pending` as requests end (sessions' later
    turns), so one loop's steps may reach another's, as a cluster's events do."""
    with _cyclic_gc_paused():
        if loops[0].clock.virtual:
            return _drive_virtual(loops, pending, admit, events, stop, max_iterations, released)
        return _drive_wall(loops, pending, admit, stop, max_iterations)


def _drive_virtual(loops, pending, admit, events, stop, max_iterations, released) -> bool:
    first = loops[0].stats
    order = {id(loop): i for i, loop in enumerate(loops)}
    # the loops with work, by their next iteration's time (then replica order); an entry is
    # current while `queued` holds its time for that loop
    ready: list[tuple[float, int, EngineLoop]] = []
    queued: dict[int, float] = {}

    # a colocated cluster's loops price their stretches ahead (`cbjax.engine.stretch`): a loop
    # then waits until its stretch's last step or an arrival routed to it, not every arrival
    ahead = len(loops) > 1 and events is None and not released and max_iterations is None

    def enqueue(loop: EngineLoop) -> None:
        if loop.has_work():
            t = next_time(loop)
            if queued.get(id(loop)) != t:
                queued[id(loop)] = t
                heapq.heappush(ready, (t, order[id(loop)], loop))
        else:
            queued.pop(id(loop), None)

    for loop in loops:
        enqueue(loop)
    while True:
        if stop is not None and stop.is_set():
            # what arrived by the time the run stopped was there: it ends aborted, not unarrived
            t = max(loop.clock.now() for loop in loops)
            while pending and pending[0].arrival_s <= t:
                admit(pending.popleft(), t)
            return True
        while ready and queued.get(id(ready[0][2])) != ready[0][0]:
            heapq.heappop(ready)  # out of date
        t_step = ready[0][0] if ready else _INF
        t_event = events.next_time() if events is not None else _INF
        t_arrival = pending[0].arrival_s if pending else _INF
        if (t_event <= t_step or t_arrival <= t_step) and (t_event < _INF or t_arrival < _INF):
            if t_event <= t_arrival:
                target, t = events.pop(), t_event
            else:
                t = t_arrival
                target = admit(pending.popleft(), t)
            if target is not None:
                target.clock.advance_to(t)
                enqueue(target)
            continue
        if not ready:
            return False
        _, _, loop = heapq.heappop(ready)
        del queued[id(loop)]
        while ready and queued.get(id(ready[0][2])) != ready[0][0]:
            heapq.heappop(ready)
        t_other = ready[0][0] if ready else _INF
        # run the loop's iterations while each starts before every other event; a decode stretch
        # may run past the other loops' next steps when nothing they do reaches this one (no
        # cluster events, no released arrivals), but never past an arrival or an event
        t_next = min(t_event, t_arrival, t_other)
        until = t_next if events is not None or released else min(t_event, t_arrival)
        while True:
            max_steps = None
            if max_iterations is not None:
                if first.iterations >= max_iterations:
                    return False
                max_steps = max_iterations - first.iterations if loop is loops[0] else None
            loop.step(until, max_steps, ahead)
            loop.boundary()
            if loop.ahead is not None or not loop.has_work() or loop.clock.now() >= t_next:
                break
            if stop is not None and stop.is_set():
                break
            if pending and pending[0].arrival_s < t_arrival:
                break  # a released turn arrives first
        enqueue(loop)


def _drive_wall(loops, pending, admit, stop, max_iterations) -> bool:
    clock, first = loops[0].clock, loops[0].stats
    while True:
        for loop in loops:
            loop.boundary()
        now = clock.now()
        while pending and pending[0].arrival_s <= now:
            admit(pending.popleft(), now)
        if stop is not None and stop.is_set():
            return True
        busy = [loop for loop in loops if loop.has_work()]
        if not busy:
            if not pending:
                return False
            clock.sleep(min(NAP_S, max(0.0, pending[0].arrival_s - clock.now())))
            continue
        if max_iterations is not None and first.iterations >= max_iterations:
            return False
        for loop in busy:
            loop.step()


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector. The loop allocates many short-lived objects,
    all freed by reference counting; each collection would instead walk every live object of
    the run (all requests, every replica's state) and find nothing. Restored on exit, with the
    run's survivors (its requests, logs and results: long-lived) moved to the oldest
    generation at once (`gc.freeze` then `gc.unfreeze`, each a list splice), so that the first
    young collection does not walk them all."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()

