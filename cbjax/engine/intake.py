"""What reaches a running loop from other threads: submissions, cancellations, the end of
admission, and the server's arrival stamps (no jax).

`submit`, `cancel`, `close_admission`, `receive` and `received` are thread-safe (deque and
dict operations are atomic); the loop takes what came at each iteration boundary (`take`).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from cbjax.core.request import FinishReason, Request
from cbjax.engine.clock import PACE_SLACK_S, Clock


class Intake:
    def __init__(self, clock: Clock):
        self.clock = clock
        self.inbox: deque[Request] = deque()  # submit -> next boundary
        self.cancels: deque[tuple[str, str, FinishReason]] = deque()
        # requests received by the server and not yet submitted (being read and parsed): their
        # arrival stamps, by a key the server holds
        self.receiving: dict[object, float] = {}
        self.wake = threading.Event()
        self.open = True  # admission: False once the server drains

    def pending(self) -> bool:
        return bool(self.inbox or self.cancels)

    def submit(self, req: Request, arrival_s: float | None = None) -> None:
        """A request arriving now (or at `arrival_s`, an earlier stamp: when the server received
        it); it enters the scheduler at the first iteration boundary at or after its arrival,
        and wakes an idle loop at once."""
        req.arrival_s = self.clock.stamp() if arrival_s is None else arrival_s
        self.inbox.append(req)
        self.wake.set()

    def cancel(self, request_id: str, reason: str, finish_reason: FinishReason) -> None:
        self.cancels.append((request_id, reason, finish_reason))
        self.wake.set()

    def close_admission(self) -> None:
        self.open = False
        self.wake.set()

    def receive(self, key: object) -> float:
        """A request reaching the server now, to be submitted once read and parsed: returns its
        arrival stamp. Until `received(key)`, a paced boundary at or after the stamp waits for
        its submission (within PACE_SLACK_S), so the time spent parsing does not push it to the
        next boundary."""
        stamp = self.clock.stamp()
        self.receiving[key] = stamp
        return stamp

    def received(self, key: object) -> None:
        """The request `key` was submitted, or will never be (refused, or not a generation)."""
        self.receiving.pop(key, None)

    def take(self, add: Callable[[Request, float], None], busy: Callable[[], bool]) -> None:
        """Hand the inbox to `add(req, now)`. Paced, the loop's clock may trail the wall clock
        (PACE_SLACK_S): a request that arrived after the boundary's time waits for the next
        boundary, as it would offline; an idle loop (`busy()` False, asked only when it matters)
        first moves its clock to the arrival; a request received by the boundary's time but still
        being parsed is waited for."""
        inbox, clock = self.inbox, self.clock
        if clock.paced and self.receiving and busy():
            self._await_received(clock.now())
        if not inbox:
            return
        if not clock.paced:
            while inbox:
                add(inbox.popleft(), clock.now())
            return
        if not busy():
            clock.advance_to(min(r.arrival_s for r in inbox))
        now = clock.now()
        # stamps taken at receipt need not come in submission order: look at every one
        due, later = [], []
        for _ in range(len(inbox)):
            req = inbox.popleft()
            (due if req.arrival_s <= now else later).append(req)
        inbox.extendleft(reversed(later))
        for req in sorted(due, key=lambda r: r.arrival_s):
            add(req, now)

    def _await_received(self, now: float) -> None:
        """Wait for the requests received by `now` to be submitted, for at most half of
        PACE_SLACK_S past `now` (the other half is the step's own host time)."""
        until = now + PACE_SLACK_S / 2
        while any(stamp <= now for stamp in list(self.receiving.values())):
            left = until - self.clock.stamp()
            if left <= 0:
                return
            self.clock.sleep(min(left, 0.0002))
