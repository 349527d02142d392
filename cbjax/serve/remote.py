"""The engine in a process of its own, beside the server's (`server.engine_process`).

Why: in one process the engine's thread and the event loop share one GIL. Every step, the
loop's writes of the step's tokens and the engine's planning of the next step take turns, so
each step also waits for the other's share (measured in docs/benchmarks.md, Serving). In two
processes they overlap: the server process parses requests and writes chunks while the engine
process plans and runs steps.

The contract is the loop's own, across a pipe (`multiprocessing`, spawned: the server process
starts no JAX runtime of its own, and a forked JAX runtime would not be safe):
- server -> engine: `start` (the clock's origin, `time.perf_counter` being one clock for every
  process of the machine), `submit` (a Request and its arrival stamp), `cancel`, `close`
  (admission), `finish` (stop, abort what is left, write the outputs);
- engine -> server: `ready` (warmed up, with the load counts), then per loop turn with news an
  `events` message (tokens as (request id, token id, time), finished requests as Requests, in
  the order the loop reported them, and the load counts), and `done` with the summary; or
  `error` (the exception's type, message and traceback), at any point.

The engine process writes requests.jsonl (live, as requests end) and the outputs, as a server
that runs the engine on a thread does. It ignores SIGINT and SIGTERM: the server drains on
either and then tells it to finish; if the server process dies, the pipe closes and the engine
process stops.
If the engine process dies, `health` says how (its exit code, or the signal that killed it),
every request ends in error, and `finish` writes requests.jsonl from the server's copies."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from cbjax.engine.online import IDLE_WAIT_S
from cbjax.core.results import LoadCounts
from cbjax.report.files import RequestLog
from cbjax.report.tables import write_requests
from cbjax.core.request import FinishReason, Request
from cbjax.serve.client import ALIVE, EngineEvents, Health
from cbjax.serve.config import ServeConfig

log = logging.getLogger("cbjax")
# The pipe closes as the engine process dies; its exit code follows within moments (the wait
# for it runs on the event loop, once, when the engine is lost).
EXIT_WAIT_S = 5.0


class EngineProcess:
    """`EngineClient` with the engine in a spawned process. Its reports reach `events` on the
    server's event loop (`start`), and, once that has stopped, in `finish`."""

    def __init__(self, cfg: ServeConfig, out_dir: Optional[Path], events: EngineEvents):
        self.events = events
        self.out_dir = out_dir
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(cfg, out_dir, child), name="cbjax-engine", daemon=True)
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # submitted, not yet finished: the server's objects
        self._submitted: list[Request] = []  # every request sent, in order (rows if the engine is lost)
        self._counts = LoadCounts(0, 0, 0, 0, 0)
        self._t0 = time.perf_counter()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._summary: Optional[dict[str, Any]] = None
        self._error: Optional[str] = None

    # ---- start and end ----
    def warmup(self) -> None:
        """Block until the engine process has built and warmed up its executor. A config error
        there is raised here as a ValueError, anything else as a RuntimeError. Interrupted
        (Ctrl-C), it stops the engine process first: that ignores SIGINT and SIGTERM, and would
        wait for a start that never comes, and the server's exit would wait for it."""
        try:
            msg = self._recv()
        except BaseException:
            self._proc.kill()
            self._proc.join()
            raise
        if msg is None or msg[0] != "ready":
            if msg is None:
                raise RuntimeError(f"{self._exit_reason()} while starting")
            self._proc.join(timeout=10)
            _, kind, text, trace = msg
            if kind == "ValueError":  # a config the executor refused: the message names the field
                raise ValueError(text)
            raise RuntimeError(f"the engine process failed while starting:\n{trace}")
        self._counts = msg[1]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the clock now (arrivals count from here), and read the engine's reports on
        `loop` (the server's event loop, from its thread): the events reach their handlers in
        the same loop turn, with no thread between."""
        loop.add_reader(self._conn.fileno(), self._readable)
        self._loop = loop
        self._t0 = time.perf_counter()
        self._command(("start", self._t0))

    def finish(self, timeout_s: float = 600.0) -> Optional[dict[str, Any]]:
        """Once the event loop has stopped: stop the engine, which aborts what is left, reports
        their ends, writes the outputs and exits. Returns the summary; None if the engine
        process failed (`health` says how), requests.jsonl then written here (`_write_rows`)."""
        try:
            self._send(("finish",))
        except OSError:
            pass  # already gone
        deadline = time.monotonic() + timeout_s
        while self._summary is None and self._error is None:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._lost(f"the engine process did not finish within {timeout_s:.0f} s")
                break
            self._handle(self._recv())
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        if self._summary is None and self.out_dir is not None:
            self._write_rows(self.out_dir / "requests.jsonl")
        return self._summary

    def _write_rows(self, path: Path) -> None:
        """With the engine lost (its outputs unwritten): one requests.jsonl row per request sent,
        from the server's copies: the fates the engine reported, and `error` for the rest. The
        engine's live log, which holds a subset of these rows, goes."""
        write_requests(path, self._submitted, lambda r: {"output_token_ids": r.output_token_ids})
        path.with_name(path.name + RequestLog.SUFFIX).unlink(missing_ok=True)

    def health(self) -> Health:
        if self._error is None and self._summary is None and not self._proc.is_alive():
            self._lost(self._exit_reason())  # gone, its pipe's end not yet read
        return ALIVE if self._error is None else Health(False, self._error)

    def _exit_reason(self) -> str:
        """How the engine process ended: its exit code, or the signal that killed it."""
        self._proc.join(timeout=EXIT_WAIT_S)
        code = self._proc.exitcode
        if code is None:
            return "the engine process stopped answering (its pipe closed)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the engine process was killed by {name}"
        return f"the engine process exited with code {code}"

    # ---- the loop's intake ----
    def stamp(self) -> float:
        return time.perf_counter() - self._t0

    def receive(self, key: object) -> float:
        return self.stamp()  # the engine is not paced: nothing waits for the submission

    def received(self, key: object) -> None:
        pass

    def submit(self, req: Request, arrival_s: Optional[float] = None) -> None:
        """Send `req` to the engine; with the engine gone, it ends in error at once."""
        req.arrival_s = self.stamp() if arrival_s is None else arrival_s
        self._requests[req.request_id] = req
        self._submitted.append(req)
        if self._error is None:
            try:
                self._send(("submit", req, req.arrival_s))
                return
            except OSError:
                self._lost(self._exit_reason())
                return
        self._end(req, self._error)
        self.events.tick()

    def cancel(self, request_id: str, reason: str = "client disconnected", finish_reason: FinishReason = FinishReason.ABORTED) -> None:
        self._command(("cancel", request_id, reason, finish_reason))

    def close_admission(self) -> None:
        self._command(("close",))

    def _command(self, msg: tuple) -> None:
        """A command whose loss with the engine changes nothing (its requests end in error)."""
        try:
            self._send(msg)
        except OSError:
            pass

    def counts(self) -> LoadCounts:
        """The load as of the engine's latest report (at most one loop turn old)."""
        return self._counts

    # ---- the pipe ----
    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _recv(self) -> Optional[tuple]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _readable(self) -> None:
        """The pipe has data (on the event loop): handle every message that has come."""
        while self._summary is None and self._error is None and self._conn.poll(0):
            self._handle(self._recv())
        if self._error is not None and self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._loop = None

    def _handle(self, msg: Optional[tuple]) -> None:
        """One report of the engine's, delivered to `events` as the engine's thread would."""
        if msg is None:
            self._lost(self._exit_reason())
            return
        kind = msg[0]
        if kind == "events":
            events, requests = self.events, self._requests
            for event in msg[1]:
                if type(event) is tuple:
                    req = requests.get(event[0])
                    if req is not None:
                        events.on_token(req, event[1], event[2])
                else:
                    req = requests.pop(event.request_id, None)
                    if req is None:
                        req = event
                    else:  # the handler holds the server's object: bring it up to date
                        req.__dict__.update(event.__dict__)
                    events.on_finish(req)
            self._counts = msg[2]
            events.tick()
        elif kind == "done":
            self._summary = msg[1]
        elif kind == "error":
            log.error("cbjax-serve: the engine failed:\n%s", msg[3])
            self._lost(f"the engine failed: {msg[1]}: {msg[2]}")

    def _lost(self, error: str) -> None:
        """The engine is gone: every request it held ends in error, so no handler waits forever."""
        self._error = error
        for req in list(self._requests.values()):
            self._end(req, error)
        self.events.tick()

    def _end(self, req: Request, error: str) -> None:
        self._requests.pop(req.request_id, None)
        req.finish_reason, req.error = FinishReason.ERROR, error
        self.events.on_finish(req)


class _Forward:
    """The engine process's callbacks: buffer the loop's reports, send them once per turn."""

    def __init__(self, conn):
        self.conn = conn
        self.engine = None  # set once the loop exists
        self.events: list = []
        self.sent_counts: Optional[LoadCounts] = None

    def on_token(self, req: Request, token_id: Optional[int], now: float) -> None:
        self.events.append((req.request_id, token_id, now))

    def on_finish(self, req: Request) -> None:
        self.events.append(req)

    def tick(self) -> None:
        counts = self.engine.counts()
        if self.events or counts != self.sent_counts:
            events, self.events = self.events, []
            self.conn.send(("events", events, counts))
            self.sent_counts = counts


def _engine_main(cfg: ServeConfig, out_dir: Optional[Path], conn) -> None:
    """The engine process: build and warm up, then one thread runs the loop and reads the
    server's commands between its turns; at the end, write the outputs."""
    from cbjax.serve.host import EngineHost  # here: the server process needs no executor

    # The server drains on Ctrl-C or SIGTERM, then says finish; a signal to the whole process
    # group (Ctrl-C, `timeout`, systemd, Slurm) reaches this process too, and is the server's.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        forward = _Forward(conn)
        host = EngineHost(cfg, out_dir, forward.on_token, forward.on_finish, forward.tick)
        forward.engine = host
        host.warmup()
        conn.send(("ready", host.counts()))
        commands = _Commands(conn, host)
        while not commands.started.is_set():
            commands(IDLE_WAIT_S)
        host.run(commands.stop, poll=commands)
        conn.send(("done", host.finish()))
    except BaseException as err:  # reported to the server, which ends its requests in error
        try:
            conn.send(("error", type(err).__name__, str(err), traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()


class _Commands:
    """The server's commands, read by the loop's own thread between turns (the loop's
    `intake`): no second thread contends for the engine process's GIL."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.started, self.stop = threading.Event(), threading.Event()

    def __call__(self, timeout_s: float) -> None:
        conn, engine = self.conn, self.engine
        try:
            if not conn.poll(timeout_s):
                return
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "submit":
                    engine.submit(msg[1], msg[2])
                elif kind == "cancel":
                    engine.cancel(msg[1], msg[2], msg[3])
                elif kind == "close":
                    engine.close_admission()
                elif kind == "start":
                    engine.start(msg[1])
                    self.started.set()
                elif kind == "finish":
                    break
                if not conn.poll(0):
                    return
        except (EOFError, OSError):  # the server process is gone: finish, its outputs written
            pass
        self.started.set()
        self.stop.set()
