"""The engine client: the one contract between cbjax-serve's HTTP side and its engine.

The HTTP side (the bridge, the app, /metrics, the server) never reaches the engine itself: it
holds an `EngineClient`, whose verbs are the same whether the engine runs on a thread of the
server's process (`cbjax.serve.local.EngineThread`) or in a process of its own
(`cbjax.serve.remote.EngineProcess`). The engine's reports come back through the
`EngineEvents` the client was built with (the bridge). No jax here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from cbjax.core.request import FinishReason, Request
from cbjax.core.results import LoadCounts


@dataclass(frozen=True)
class Health:
    """Whether the engine can serve; when it cannot, why (a sentence for a client to read)."""

    alive: bool
    reason: str = ""


ALIVE = Health(True)


@runtime_checkable
class EngineEvents(Protocol):
    """Where a client delivers the engine's reports: a request's tokens (`token_id` None for the
    simulator, which materialises none; `now` on the engine's clock), its end (`req` carries
    its fate), and `tick` after each batch of reports, once per loop turn at most. A request's
    reports come in order: its tokens, then its end. An engine thread calls these on its own
    thread (and may ask `tick` to wait up to `wait_s` for the event loop to have handled what
    it was given); an engine process's client calls them on the server's event loop."""

    def on_token(self, req: Request, token_id: Optional[int], now: float) -> None: ...

    def on_finish(self, req: Request) -> None: ...

    def tick(self, wait_s: float = 0.0) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """The server's handle on its engine. Every verb but `warmup` and `finish` may be called
    from the event loop's thread while the engine runs; none of them blocks on a step."""

    # ---- start and end ----
    def warmup(self) -> None:
        """Build and compile before the server listens; a config the engine refuses raises
        ValueError naming the key."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from now on (called on `loop`, the server's event loop, before it accepts a
        connection): arrivals count from here."""
        ...

    def finish(self) -> Optional[dict[str, Any]]:
        """Once the event loop has stopped: stop the engine, abort what is left, write
        requests.jsonl, summary.json and config.yaml; returns the summary. None: the engine
        could not (see `health`); requests.jsonl then still has a row per request submitted."""
        ...

    # ---- requests ----
    def submit(self, req: Request, arrival_s: Optional[float] = None) -> None:
        """Hand `req` to the engine, arrived at `arrival_s` (a `receive` stamp; None: now).
        Every request submitted ends with exactly one `on_finish`; with the engine unable to
        serve, at once, in error."""
        ...

    def cancel(self, request_id: str, reason: str = "client disconnected", finish_reason: FinishReason = FinishReason.ABORTED) -> None:
        """End the request early (a disconnect, a stop string, the drain); unknown ids and
        requests already ended are ignored."""
        ...

    def close_admission(self) -> None:
        """From now on every submission is rejected (the drain)."""
        ...

    # ---- arrivals, on the engine's clock ----
    def stamp(self) -> float:
        """Now on the engine's clock (seconds since `start`)."""
        ...

    def receive(self, key: object) -> float:
        """A request reaching the server, to be submitted under `key` once parsed: its arrival
        stamp. A paced engine waits (briefly) for such requests at a boundary past their stamp."""
        ...

    def received(self, key: object) -> None:
        """The request `key` was submitted, or will never be."""
        ...

    # ---- state ----
    def counts(self) -> LoadCounts:
        """The engine's load (running, waiting, pages, preemptions), at most one loop turn old."""
        ...

    def health(self) -> Health:
        """Whether the engine can serve (`/health`)."""
        ...
