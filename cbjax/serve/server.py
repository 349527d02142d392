"""One cbjax-serve: uvicorn on the caller's thread, the engine in a process of its own (the real
engine, `server.engine_process`) or on a thread of this one, a drain on SIGTERM, and the run's
outputs written at exit as an offline run writes them."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import uvicorn

from cbjax.app.run import resolve
from cbjax.serve.app import create_app
from cbjax.serve.generate import ServeState
from cbjax.serve.bridge import EngineBridge
from cbjax.serve.config import ServeConfig
from cbjax.serve.direct import RawSend
from cbjax.serve.host import EngineHost
from cbjax.serve.metrics import ServerMetrics
from cbjax.serve.remote import EngineProcess, uses_engine_process
from cbjax.serve.text import load_tokenizer

log = logging.getLogger("cbjax")
DRAIN_ABORT = "server shutting down (server.drain_s passed)"
# The engine thread and the event loop share the GIL. A thread that wants it waits for the
# holder to block, or at most the switch interval (CPython's default is 5 ms); tokens the
# engine has just released would wait that long behind its planning of the next step. While
# serving, the interval is short enough to be small beside a token's latency.
SWITCH_INTERVAL_S = 0.0002
# After handing a step's tokens to the event loop, the engine thread waits (at most this long)
# for the handlers to have written them before it plans on: it would otherwise hold the GIL
# through its planning while the event loop waits for it at each of its turns. Paced, the wait
# moves no step (the next step starts where the last one ended on the paced clock, and the
# bound is well inside PACE_SLACK_S).
HANDOFF_WAIT_S = 0.001


class Server:
    """Builds the engine and the app; `run` serves until SIGINT/SIGTERM (or `shutdown`)."""

    def __init__(self, cfg: ServeConfig, out_dir: Optional[Path] = None):
        cfg = resolve(cfg)
        self.cfg = cfg
        self.out_dir = out_dir
        self.bridge = EngineBridge()
        # the engine: in a process of its own (`remote`), or on a thread of this one (`host`)
        self.remote: Optional[EngineProcess] = None
        self.host: Optional[EngineHost] = None
        if uses_engine_process(cfg):
            self.remote = EngineProcess(cfg, out_dir, self.bridge)
            self.bridge.engine = self.remote
        else:
            self.host = EngineHost(cfg, out_dir, self.bridge.on_token, self.bridge.on_finish, self._tick)
            self.bridge.engine = self.host
        name = cfg.server.served_model_name or cfg.model.name
        self.metrics = ServerMetrics(self.bridge.engine, name)
        self.bridge.listeners.append(self.metrics.on_finish)
        self.state = ServeState(
            bridge=self.bridge,
            tokenizer=load_tokenizer(cfg.model.path, cfg.model.vocab_size, cfg.model.eos_token_id),
            metrics=self.metrics,
            model_name=name,
            max_model_len=cfg.model.max_model_len,
            vocab_size=cfg.model.vocab_size,
            server=cfg.server,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            chunked_prefill=cfg.scheduler.chunked_prefill,
            created=int(time.time()),
        )
        self.app = create_app(self.state)
        self.stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._drain_timer: Optional[threading.Timer] = None
        self.uvicorn: Optional[_Uvicorn] = None
        self.summary: Optional[dict[str, Any]] = None

    def _tick(self) -> None:
        self.bridge.tick(HANDOFF_WAIT_S)

    def warmup(self) -> None:
        """Compile before listening (in the engine process, wait until it has)."""
        if self.remote is not None:
            self.remote.wait_ready()
        else:
            self.host.warmup()

    def bind(self) -> socket.socket:
        """The server's socket, bound and listening (connections wait in its backlog until
        `run` accepts them)."""
        cfg = self.cfg.server
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                RawSend(self.app),  # streams write their chunks past the middleware (`direct`)
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level,
                access_log=cfg.log_level in ("info", "debug", "trace"),
                lifespan="off",
                # the drain aborts what is left at drain_s; the aborted streams then end at once
                timeout_graceful_shutdown=int(cfg.drain_s) + 10,
            ),
            on_signal=self.begin_drain,
            on_startup=self.remote.attach if self.remote is not None else None,
        )
        sock = self.uvicorn.config.bind_socket()
        # uvicorn listens only once its loop has started: a client that connects as soon as
        # `bind` returns (when cbjax-serve says it is listening) would be refused until then.
        # Listening here queues such connections in the backlog instead.
        sock.listen(self.uvicorn.config.backlog)
        return sock

    def run(self, sock: Optional[socket.socket] = None) -> Optional[dict[str, Any]]:
        """Serve on `sock` (from `bind`; default: bind now) until told to stop; then write
        the outputs and return the summary (None: the engine process failed, and wrote none)."""
        if sock is None:
            sock = self.bind()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self.remote is not None:  # arrivals count from here, after warmup
            self.remote.start()
        else:
            self.host.start()
            self._thread = threading.Thread(target=self.host.run, args=(self.stop,), name="cbjax-engine", daemon=True)
            self._thread.start()
        try:
            self.uvicorn.run(sockets=[sock])
        finally:
            self.finish()
            sys.setswitchinterval(switch_interval)
        return self.summary

    def begin_drain(self, signum: int = signal.SIGTERM) -> None:
        """Stop admission; requests in flight run on for server.drain_s, then are aborted.
        Safe from a signal handler: it only sets flags and starts a timer."""
        if self.state.draining:
            return
        self.state.draining = True
        self.bridge.engine.close_admission()
        self._drain_timer = threading.Timer(self.cfg.server.drain_s, self.bridge.cancel_all, (DRAIN_ABORT,))
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def shutdown(self) -> None:
        """What SIGTERM does, from another thread (tests)."""
        self.begin_drain()
        self.uvicorn.should_exit = True

    def finish(self) -> None:
        """After uvicorn has closed every connection: stop the engine, abort what is left,
        write requests.jsonl, summary.json and config.yaml."""
        self.begin_drain()
        self.stop.set()
        if self.remote is not None:
            self.summary = self.remote.finish()  # None if the engine process failed
            if self.summary is None:
                log.error("cbjax-serve: %s; requests.jsonl written without the engine's summary", self.remote.error)
                if self.out_dir is not None:
                    self.remote.write_rows(self.out_dir / "requests.jsonl")
        else:
            if self._thread is not None:
                self._thread.join()
            self.summary = self.host.finish()
        if self._drain_timer is not None:
            self._drain_timer.cancel()


class _Uvicorn(uvicorn.Server):
    """uvicorn with cbjax's signal handling: the first SIGINT/SIGTERM starts the drain and a
    graceful exit; uvicorn's own re-raise of the signal at exit (which would kill the process
    before the outputs are written) is left out."""

    def __init__(self, config: uvicorn.Config, on_signal, on_startup=None):
        super().__init__(config)
        self.on_signal, self.on_startup = on_signal, on_startup

    async def startup(self, sockets=None) -> None:
        if self.on_startup is not None:  # on the event loop, before any connection is accepted
            self.on_startup(asyncio.get_running_loop())
        await super().startup(sockets)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal(sig)
        super().handle_exit(sig, frame)
