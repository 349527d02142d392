"""One cbjax-serve: uvicorn on the caller's thread, the engine behind an `EngineClient` (in a
process of its own, `server.engine_process`, or on a thread of this one), a drain on SIGTERM,
and the run's outputs written at exit as an offline run writes them."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import uvicorn

from cbjax.app.run import resolve
from cbjax.core.stop import signals_to
from cbjax.serve.app import create_app
from cbjax.serve.generate import ServeState
from cbjax.serve.bridge import EngineBridge
from cbjax.serve.client import EngineClient, EngineEvents
from cbjax.serve.config import ServeConfig
from cbjax.serve.local import EngineThread
from cbjax.serve.metrics import ServerMetrics
from cbjax.serve.remote import EngineProcess
from cbjax.serve.text import load_tokenizer

log = logging.getLogger("cbjax")
DRAIN_ABORT = "server shutting down (server.drain_s passed)"
FORCED_ABORT = "server shutting down (a second Ctrl-C)"


def connect(cfg: ServeConfig, out_dir: Optional[Path], events: EngineEvents) -> EngineClient:
    """The engine `cfg` asks for, its reports going to `events`: in a process of its own
    (`server.engine_process`, the real engine only) or on a thread of this one."""
    if cfg.server.engine_process:
        return EngineProcess(cfg, out_dir, events)
    return EngineThread(cfg, out_dir, events)


class Server:
    """Builds the engine and the app; `run` serves until SIGINT/SIGTERM (or `shutdown`)."""

    def __init__(self, cfg: ServeConfig, out_dir: Optional[Path] = None):
        cfg = resolve(cfg)
        self.cfg = cfg
        self.out_dir = out_dir
        self.bridge = EngineBridge()
        self.engine: EngineClient = connect(cfg, out_dir, self.bridge)
        self.bridge.engine = self.engine
        name = cfg.server.served_model_name or cfg.model.name
        self.metrics = ServerMetrics(self.engine, name, cfg.cache.page_size * cfg.model.kv_bytes_per_token)
        self.bridge.listeners.append(self.metrics.on_finish)
        self.state = ServeState(
            engine=self.engine,
            bridge=self.bridge,
            tokenizer=load_tokenizer(cfg.model.path, cfg.model.vocab_size, cfg.model.eos_token_id, cfg.model.extra_eos_token_ids),
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
        self._drain_timer: Optional[threading.Timer] = None
        self.uvicorn: Optional[_Uvicorn] = None
        self.summary: Optional[dict[str, Any]] = None

    def warmup(self) -> None:
        """Compile before listening (in the engine process, wait until it has)."""
        self.engine.warmup()

    def bind(self, listen: bool = True) -> socket.socket:
        """The server's socket, bound to server.host:server.port and, unless `listen` is false,
        listening (connections wait in its backlog until `run` accepts them). An address it
        cannot take is an OSError naming both keys. cbjax-serve binds before the warmup, so a
        port in use fails at once, and listens (`listen`) after it."""
        cfg = self.cfg.server
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                self.app,
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level,
                access_log=cfg.log_level in ("info", "debug", "trace"),
                lifespan="off",
                # the drain aborts what is left at drain_s; the aborted streams then end at once
                timeout_graceful_shutdown=int(cfg.drain_s) + 10,
            ),
            on_signal=self.begin_drain,
            on_force=self.abort_now,
            on_startup=self.engine.start,  # arrivals count from here, after warmup
        )
        sock = bound_socket(cfg.host, cfg.port)
        if listen:
            self.listen(sock)
        return sock

    def listen(self, sock: socket.socket) -> None:
        """uvicorn listens only once its loop has started: a client that connects as soon as
        cbjax-serve says it is listening would be refused until then. Listening here queues
        such connections in the backlog instead."""
        sock.listen(self.uvicorn.config.backlog)

    def run(self, sock: Optional[socket.socket] = None) -> Optional[dict[str, Any]]:
        """Serve on `sock` (from `bind`; default: bind now) until told to stop; then write
        the outputs and return the summary (None: the engine process failed, and wrote none)."""
        if sock is None:
            sock = self.bind()
        try:
            self.uvicorn.run(sockets=[sock])
        finally:
            # uvicorn has put the default handlers back; a signal now (Ctrl-C again, another
            # SIGTERM) would cut the outputs short, so it is only noted
            with signals_to(_noted):
                self.finish()
        return self.summary

    def begin_drain(self, signum: int = signal.SIGTERM) -> None:
        """Stop admission; requests in flight run on for server.drain_s, then are aborted.
        Safe from a signal handler: it only sets flags and starts a timer."""
        if self.state.draining:
            return
        self.state.draining = True
        self.engine.close_admission()
        self._drain_timer = threading.Timer(self.cfg.server.drain_s, self.bridge.cancel_all, (DRAIN_ABORT,))
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def abort_now(self) -> None:
        """End the drain at once: abort every request left, as `server.drain_s` passing would.
        Safe from a signal handler: the aborts run on a thread, as the drain's timer runs them."""
        self.begin_drain()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        threading.Thread(target=self.bridge.cancel_all, args=(FORCED_ABORT,), daemon=True).start()

    def shutdown(self) -> None:
        """What SIGTERM does, from another thread (tests)."""
        self.begin_drain()
        self.uvicorn.should_exit = True

    def finish(self) -> None:
        """After uvicorn has closed every connection: stop the engine, abort what is left,
        write requests.jsonl, summary.json and config.yaml."""
        self.begin_drain()
        self.summary = self.engine.finish()  # None if the engine failed
        if self.summary is None:
            log.error("cbjax-serve: %s; requests.jsonl written without the engine's summary", self.engine.health().reason)
        if self._drain_timer is not None:
            self._drain_timer.cancel()


def _noted(signum: int, frame: Any) -> None:
    log.warning("cbjax-serve: %s ignored: writing the outputs", signal.Signals(signum).name)


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one; an OSError naming server.host
    and server.port when it cannot be (uvicorn's own bind logs the bare OS error and exits)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # a taken port, an address of no interface here, a name that does not resolve
        sock.close()
        raise OSError(f"server.host={host} server.port={port}: cannot listen there: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn with cbjax's signal handling: the first SIGINT/SIGTERM starts the drain and a
    graceful exit; a second SIGINT (Ctrl-C again) aborts every request left (`on_force`), and
    the graceful exit goes on, so each stream still ends cleanly and each request keeps the
    reason it ended with; a third is uvicorn's force quit. uvicorn's own re-raise of the signal
    at exit (which would kill the process before the outputs are written) is left out."""

    def __init__(self, config: uvicorn.Config, on_signal, on_startup, on_force):
        super().__init__(config)
        self.on_signal, self.on_startup, self.on_force = on_signal, on_startup, on_force
        self._forced = False

    async def startup(self, sockets=None) -> None:
        self.on_startup(asyncio.get_running_loop())  # before any connection is accepted
        await super().startup(sockets)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with signals_to(self.handle_exit):
            yield

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal(sig)
        if self.should_exit and sig == signal.SIGINT and not self._forced:
            # uvicorn would force-quit here and cancel the handlers mid-response
            self._forced = True
            self.on_force()
            return
        super().handle_exit(sig, frame)
