"""`cluster.backend=processes` (the engine cluster's default): each replica's executor in a child
process of its own, as vLLM's data-parallel engine cores run. The router and every replica's
scheduler and `EngineLoop` stay in the driver (`cbjax.cluster.engine.ClusterEngine`).

Children start with multiprocessing's "spawn" (a fresh interpreter: jax is never forked), each
with its own devices in its environment (`cbjax.cluster.devices`) and one pipe to the driver.
A child builds its executor (`cbjax.cluster.executor_host.ExecutorHost`), then answers the
driver's calls in the order sent: plans in, tokens out, and under P/D the K/V of a prefilled
request as numpy arrays, from the prefill child through the driver to the decode child.
Children ignore SIGINT and SIGTERM: a Ctrl-C, or a SIGTERM to the whole process group
(`timeout`, systemd, Slurm), reaches the driver, which stops the run and closes them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Iterator, Mapping, Optional

from cbjax.cluster.devices import replica_environments, visible_gpus
from cbjax.cluster.executor_host import ExecutorHost, describe
from cbjax.cluster.pools import replica_configs
from cbjax.cluster.remote import Pending, RemoteExecutor, ReplicaFailed, Transport
from cbjax.config import RunConfig

# A child still running this long after its pipe closed is killed.
JOIN_TIMEOUT_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the driver's to handle: children ignore them
_START_LOCK = threading.Lock()  # the environment is the process's: one child starts at a time


def replica_main(conn, build: Callable[[RunConfig], Any], cfg: RunConfig, cpu: Optional[int] = None) -> None:
    """A replica process: pinned to `cpu` if given, build the executor, then answer calls until
    `close` or until the driver is gone."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if cpu is not None:  # before jax starts its threads, which inherit it
        os.sched_setaffinity(0, [cpu])
    host = ExecutorHost(build, cfg)
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        reply = host.answer(name, args)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as err:  # a result that does not pickle
            conn.send(("error", describe(err)))
        if name == "close":
            return


class PipeTransport(Transport):
    """Calls to one child process over its pipe. Replies come back in the order of the calls;
    one read ahead of its `wait` is kept until then."""

    def __init__(self, replica: int, conn, process):
        super().__init__(replica)
        self.conn, self.process = conn, process
        self._sent = 0
        self._read = 0
        self._replies: dict[int, tuple[str, Any]] = {}

    def _send(self, name: str, args: tuple) -> int:
        args = tuple(a.result() if isinstance(a, Pending) else a for a in args)  # K/V from another child
        try:
            self.conn.send((name, args))
        except (EOFError, OSError):
            raise self._lost(name) from None
        self._sent += 1
        return self._sent - 1

    def _wait(self, pending: Pending) -> Any:
        seq = pending.ticket
        while seq not in self._replies:
            self._replies[self._read] = self._recv(pending.name)
            self._read += 1
        status, value = self._replies.pop(seq)
        if status == "error":
            raise self.fail(pending.name, value)
        return value

    def _recv(self, name: str) -> tuple[str, Any]:
        """The next reply; `ReplicaFailed` once the child has ended with none left to read."""
        while True:
            ready = wait_any([self.conn, self.process.sentinel])
            if self.conn in ready or self.conn.poll():  # a reply sent before the child ended still counts
                try:
                    return self.conn.recv()
                except (EOFError, OSError):
                    raise self._lost(name) from None
            if self.process.sentinel in ready:
                raise self._lost(name)

    def _lost(self, name: str) -> ReplicaFailed:
        self.process.join(timeout=JOIN_TIMEOUT_S)
        code = self.process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with code {code}"
        return self.fail(name, f"its process (pid {self.process.pid}) {how}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        self.process.join(timeout=JOIN_TIMEOUT_S)
        if self.process.is_alive():  # (it ignores SIGTERM)
            self.process.kill()
            self.process.join()


class ProcessReplicas:
    """`make_executor` for `ClusterEngine`: a child process per replica of `cfg`, all started
    at once so they build their executors side by side; each call hands out the next replica's
    `RemoteExecutor`, in replica order. `shutdown` ends the processes."""

    def __init__(self, build: Callable[[RunConfig], Any], cfg: RunConfig, environ: Optional[Mapping[str, str]] = None):
        """`build(replica_cfg)` makes an executor in a child (`cbjax.app.run.build_executor`,
        pickled by reference); `environ`: the driver's environment (default `os.environ`)."""
        environ = os.environ if environ is None else environ
        self.configs = [rcfg for _, rcfg in replica_configs(cfg)]
        envs = replica_environments([c.executor.mesh.tensor for c in self.configs], environ, visible_gpus(environ))
        context = multiprocessing.get_context("spawn")
        self.transports: list[PipeTransport] = []
        self._next = 0
        cpus = sorted(os.sched_getaffinity(0)) if cfg.cluster.pin_replicas else None
        try:
            for i, (rcfg, env) in enumerate(zip(self.configs, envs)):
                ours, theirs = context.Pipe()
                cpu = cpus[i % len(cpus)] if cpus else None
                process = context.Process(
                    target=replica_main, args=(theirs, build, rcfg, cpu), name=f"cbjax-replica-{i}", daemon=True
                )
                with _environment(env):
                    process.start()
                theirs.close()
                self.transports.append(PipeTransport(i, ours, process))
        except BaseException:
            self.shutdown()
            raise

    def __call__(self, cfg: RunConfig) -> RemoteExecutor:
        i = self._next
        if i >= len(self.configs) or cfg != self.configs[i]:
            raise ValueError(f"ProcessReplicas: replica {i}'s config is not the one its process was started with")
        self._next += 1
        return RemoteExecutor(self.transports[i])

    def shutdown(self) -> None:
        for transport in self.transports:
            transport.close()


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in this process's environment while a child starts (a spawned child inherits
    it), and SIGINT and SIGTERM ignored from its first instruction where this is the main thread."""
    with _START_LOCK:
        saved = {key: os.environ.get(key) for key in env}
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
        try:
            os.environ.update(env)
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
