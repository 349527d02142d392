"""Between the event loop and the engine: each request's events reach its handler's queue.

The bridge is the `EngineEvents` of the server's engine client, and submits and cancels through
that client (`EngineClient`) alone. An engine thread calls `on_token` and `on_finish` on its
own thread; an engine process's client calls them on the event loop. Events are buffered and handed
to the asyncio loop once per loop turn (`tick`, at each iteration boundary and as a step's
tokens are committed): one wakeup of the event loop per iteration rather than one per token.
The buffer keeps a request's events in order (its tokens, then its end). A request's first
token goes ahead of the other requests' events of the same hand-off: its handler runs first in
the event loop's turn, so a time to first token does not queue behind the chunks of every
stream already running. Hand-offs reach a loop in tick order (one callback each, run in
order). `tick` may wait, a bounded time, for the event loop to have run the handlers the
events woke: the engine thread then holds no GIL while they write their chunks."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from cbjax.core.request import FinishReason, Request
from cbjax.serve.client import EngineClient


@dataclass
class Token:
    token_id: Optional[int]  # None: the simulator materialises no tokens
    time_s: float  # on the engine's clock


@dataclass
class Finished:
    req: Request


Mailbox = asyncio.Queue  # a request's events (Tokens, then Finished) for its handler; event-loop thread only


class EngineBridge:
    """Owns the per-request queues and the count of requests in flight.

    `listeners` are called where `on_finish` is (metrics) for each finished request, before
    its handler hears of it."""

    def __init__(self) -> None:
        self.engine: Optional[EngineClient] = None  # set once the client exists (it takes this bridge)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, Mailbox]] = {}
        self._lock = threading.Lock()
        self.num_in_flight = 0  # submitted, not yet finished
        self.listeners: list[Callable[[Request], None]] = []
        self._pending: list = []  # (queue entry, event) since the last tick; engine thread only
        self._first: list = []  # the same for requests' first tokens, handed off ahead of _pending
        self._fresh: set[str] = set()  # requests submitted that have had no token yet
        self._renamed: dict[str, int] = {}  # live requests renamed from each id asked for, by that id

    # ---- the handler's side (event loop thread) ----
    def submit(self, req: Request, arrival_s: Optional[float] = None) -> Mailbox:
        """Submit `req` to the engine, arrived at `arrival_s` (the engine's `stamp` at receipt;
        None: now); its events arrive on the returned mailbox."""
        queue = Mailbox()
        with self._lock:
            self._queues[req.request_id] = (asyncio.get_running_loop(), queue)
            self.num_in_flight += 1
            self._fresh.add(req.request_id)
            if req.original_request_id is not None:
                self._renamed[req.original_request_id] = self._renamed.get(req.original_request_id, 0) + 1
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
        """Whether a live request has this id, or was asked for under it and renamed."""
        with self._lock:
            return request_id in self._queues or request_id in self._renamed

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
                asked = req.original_request_id
                if asked is not None:
                    left = self._renamed.pop(asked) - 1
                    if left:
                        self._renamed[asked] = left
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
        try:
            here: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:  # off an event loop: the engine's thread
            here = None
        for loop, (f, r) in by_loop.items():
            if loop is here:  # called on the event loop itself (an engine process's report)
                _deliver(loop, f + r, None)
                continue
            done = threading.Event() if wait_s > 0 else None
            try:
                loop.call_soon_threadsafe(_deliver, loop, f + r, done)
            except RuntimeError:  # the event loop has closed (shutdown): nobody listens
                continue
            if done is not None:
                handled.append(done)
        for done in handled:
            done.wait(wait_s)


def _deliver(loop: asyncio.AbstractEventLoop, events: list[tuple[Mailbox, object]], done: Optional[threading.Event]) -> None:
    """One hand-off, on its event loop: each event to its queue, in order. A put schedules the
    waiting handler's wakeup, so handlers run in the order of their first event here (first
    tokens first), and hand-offs in tick order."""
    for queue, event in events:
        queue.put_nowait(event)
    if done is not None:
        # after the handlers the events woke: their wakeups were scheduled by put_nowait
        loop.call_soon(done.set)
