"""The engine on a thread of the server's process: an `EngineClient` over `EngineHost` and the
thread that runs its loop (the simulator always runs so; the real engine unless
`server.engine_process`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Optional

from cbjax.core.request import FinishReason, Request
from cbjax.core.results import LoadCounts
from cbjax.serve.client import ALIVE, EngineEvents, Health
from cbjax.serve.config import ServeConfig
from cbjax.serve.host import EngineHost

log = logging.getLogger("cbjax")
# After handing a step's tokens to the event loop, the engine thread waits (at most this long)
# for the handlers to have written them before it plans on: the two share the GIL, and the
# engine's planning would otherwise delay the writes, which wait for it at each of their turns.
# Paced, the wait moves no step (the next step starts where the last one ended on the paced
# clock, and the bound is well inside PACE_SLACK_S).
HANDOFF_WAIT_S = 0.001


class EngineThread:
    """`EngineClient` with the engine's loop on a thread of this process. Its reports reach
    `events` on that thread. Should the thread fail, every request it held, and every later
    one, ends in error, and `health` says why."""

    def __init__(self, cfg: ServeConfig, out_dir: Optional[Path], events: EngineEvents):
        self.events = events
        self.host = EngineHost(cfg, out_dir, events.on_token, self._on_finish, self._tick)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # orders `submit` against the thread's failure
        self._live: dict[str, Request] = {}  # submitted, not yet finished (ended in error if the thread fails)
        self._failure: Optional[str] = None

    def _on_finish(self, req: Request) -> None:
        self._live.pop(req.request_id, None)
        self.events.on_finish(req)

    def _tick(self) -> None:
        self.events.tick(HANDOFF_WAIT_S)

    # ---- start and end ----
    def warmup(self) -> None:
        self.host.warmup()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.host.start()
        self._thread = threading.Thread(target=self._run, name="cbjax-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.host.run(self._stop)
        except Exception as err:  # an engine bug: the server stays up to say so
            log.exception("cbjax-serve: the engine thread failed")
            with self._lock:
                self._failure = f"the engine thread failed: {type(err).__name__}: {err}"
                for req in list(self._live.values()):
                    self._fail(req)
            self.events.tick()

    def _fail(self, req: Request) -> None:
        """End `req` in error (under `_lock`): its row goes to the live log, its end to `events`."""
        req.finish_reason, req.error = FinishReason.ERROR, self._failure
        self.host.on_finish(req)

    def finish(self) -> Optional[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            self.host.keep_rows()
            return None
        return self.host.finish()

    # ---- requests ----
    def submit(self, req: Request, arrival_s: Optional[float] = None) -> None:
        with self._lock:
            if self._failure is None:
                self._live[req.request_id] = req
                self.host.submit(req, arrival_s)
                return
            req.arrival_s = self.host.stamp() if arrival_s is None else arrival_s
            self._fail(req)
        self.events.tick()

    def cancel(self, request_id: str, reason: str = "client disconnected", finish_reason: FinishReason = FinishReason.ABORTED) -> None:
        self.host.cancel(request_id, reason, finish_reason)

    def close_admission(self) -> None:
        self.host.close_admission()

    # ---- arrivals ----
    def stamp(self) -> float:
        return self.host.stamp()

    def receive(self, key: object) -> float:
        return self.host.receive(key)

    def received(self, key: object) -> None:
        self.host.received(key)

    # ---- state ----
    def counts(self) -> LoadCounts:
        return self.host.counts()

    def health(self) -> Health:
        return ALIVE if self._failure is None else Health(False, self._failure)
