"""Between the event loop and the engine thread: each request's events reach its handler's queue.

The engine calls `on_token` and `on_finish` on its own thread. Events are buffered and handed
to the asyncio loop once per loop turn (`tick`, at each iteration boundary and as a step's
tokens are committed): one wakeup of the event loop per iteration rather than one per token.
The buffer keeps a request's events in order (its tokens, then its end). A request's first
token goes ahead of the other requests' events of the same hand-off: its handler runs first in
the event loop's turn, so a time to first token does not queue behind the chunks of every
stream already running. Hand-offs reach a loop in tick order: one queued while an earlier one
still holds events back behind its first tokens' handlers waits behind those events
(`_Outbox`), or a request could see its end before its last tokens. `tick` may wait, a
bounded time, for the event loop to have run the handlers the events woke: the engine thread
then holds no GIL while they write their chunks."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from cbjax.core.request import FinishReason, Request


@dataclass
class Token:
    token_id: Optional[int]  # None: the simulator materialises no tokens
    time_s: float  # on the engine's clock


@dataclass
class Finished:
    req: Request


class Mailbox(asyncio.Queue):
    """A request's events on the event loop: queued for its handler, or, once the handler has
    attached a sink, passed to the sink by the delivering callback itself (no handler wakeup
    per event). Event-loop thread only."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: Optional[Callable[[object], None]] = None

    def attach(self, sink: Callable[[object], None]) -> None:
        """From now on events go to `sink`; those already queued go first, in order."""
        while not self.empty():
            sink(self.get_nowait())
        self.sink = sink


class EngineBridge:
    """Owns the per-request queues and the count of requests in flight.

    `listeners` are called on the engine thread for each finished request (metrics, the live
    request log) before its handler hears of it."""

    def __init__(self) -> None:
        self.engine = None  # set once the EngineLoop exists (it takes our callbacks)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, Mailbox]] = {}
        self._lock = threading.Lock()
        self.num_in_flight = 0  # submitted, not yet finished
        self.listeners: list[Callable[[Request], None]] = []
        self._pending: list = []  # (queue entry, event) since the last tick; engine thread only
        self._first: list = []  # the same for requests' first tokens, handed off ahead of _pending
        self._fresh: set[str] = set()  # requests submitted that have had no token yet
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}

    # ---- the handler's side (event loop thread) ----
    def submit(self, req: Request, arrival_s: Optional[float] = None) -> Mailbox:
        """Submit `req` to the engine, arrived at `arrival_s` (the engine's `stamp` at receipt;
        None: now); its events arrive on the returned mailbox."""
        queue = Mailbox()
        with self._lock:
            self._queues[req.request_id] = (asyncio.get_running_loop(), queue)
            self.num_in_flight += 1
            self._fresh.add(req.request_id)
        self.engine.submit(req, arrival_s)
        return queue

    def cancel(self, request_id: str, reason: str, finish_reason: FinishReason = FinishReason.ABORTED) -> None:
        with self._lock:
            live = request_id in self._queues
        if live:
            self.engine.cancel(request_id, reason, finish_reason)

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            ids = list(self._queues)
        for request_id in ids:
            self.engine.cancel(request_id, reason)

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._queues

    def num_waiting(self) -> int:
        """Requests accepted and not yet holding a slot (a racy read; good for a bound)."""
        return max(0, self.num_in_flight - self.engine.counts().running)

    # ---- the engine's side (engine thread) ----
    def on_token(self, req: Request, token_id: Optional[int], now: float) -> None:
        rid = req.request_id
        entry = self._queues.get(rid)
        if entry is not None:
            if rid in self._fresh:
                self._fresh.discard(rid)
                self._first.append((entry, Token(token_id, now)))
            else:
                self._pending.append((entry, Token(token_id, now)))

    def on_finish(self, req: Request) -> None:
        for listener in self.listeners:
            listener(req)
        with self._lock:
            entry = self._queues.pop(req.request_id, None)
            if entry is not None:
                self.num_in_flight -= 1
            self._fresh.discard(req.request_id)
        if entry is not None:
            self._pending.append((entry, Finished(req)))

    def tick(self, wait_s: float = 0.0) -> None:
        """Hand the buffered events to their event loops (the engine's `tick`). With `wait_s`,
        wait up to that long for each loop to have run the handlers the events woke. Called on
        an event loop (the engine in another process, its reports read there), that loop's
        events are delivered at once."""
        if not (self._pending or self._first):
            return
        first, rest = self._first, self._pending
        self._first, self._pending = [], []
        by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
        for (loop, queue), event in first:
            by_loop.setdefault(loop, ([], []))[0].append((queue, event))
        for (loop, queue), event in rest:
            by_loop.setdefault(loop, ([], []))[1].append((queue, event))
        handled = []
        here = asyncio._get_running_loop()  # None off an event loop (the engine's thread), without raising
        for loop, (f, r) in by_loop.items():
            outbox = self._outboxes.get(loop)
            if outbox is None:
                outbox = self._outboxes[loop] = _Outbox(loop)
            if loop is here:  # called on the event loop itself (an engine process's report)
                outbox.deliver(f, r, None)
                continue
            done = threading.Event() if wait_s > 0 else None
            try:
                loop.call_soon_threadsafe(outbox.deliver, f, r, done)
            except RuntimeError:  # the event loop has closed (shutdown): nobody listens
                continue
            if done is not None:
                handled.append(done)
        for done in handled:
            done.wait(wait_s)


Events = list[tuple[Mailbox, object]]


class _Outbox:
    """One event loop's hand-offs, delivered in tick order (event-loop thread only).

    A hand-off's first tokens are queued at once; its other events wait for a callback queued
    behind the wakeups of the handlers those first tokens woke, so even a sink's direct write
    comes after them. A hand-off that reaches the loop while an earlier one's events still
    wait queues its events behind them: delivered at once, they could overtake the earlier
    ones of the same request (its end before its last tokens). Its first tokens still go at
    once, as nothing of theirs came before. The loop falls that far behind only when it runs
    slower than the engine (`tick` waits a bounded time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: deque[tuple[Events, Optional[threading.Event]]] = deque()
        self.scheduled = False  # a `_drain` is queued on the loop

    def deliver(self, first: Events, rest: Events, done: Optional[threading.Event]) -> None:
        for queue, event in first:
            queue.put_nowait(event)
        if not (first or self.scheduled):
            _deliver_rest(self.loop, rest, done)
            return
        self.waiting.append((rest, done))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self.scheduled = False
        while self.waiting:
            rest, done = self.waiting.popleft()
            _deliver_rest(self.loop, rest, done)


def _deliver_rest(loop: asyncio.AbstractEventLoop, rest: Events, done: Optional[threading.Event]) -> None:
    for queue, event in rest:
        sink = queue.sink
        if sink is None:
            queue.put_nowait(event)
        else:
            sink(event)
    if done is not None:
        # after the handlers the events woke: their wakeups were scheduled by put_nowait
        loop.call_soon(done.set)
