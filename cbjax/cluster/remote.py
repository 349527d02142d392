"""The driver's side of a replica whose executor runs elsewhere: `RemoteExecutor`, the full
`Executor` protocol over a `Transport` that carries each call to the replica's
`cbjax.cluster.executor_host.ExecutorHost` (a child process's pipe, a Ray actor); no jax.

A transport sends a call at once (`send`, returning a `Pending`) and waits for its reply
(`wait`); calls to one replica run there in the order sent. So `launch` returns as soon as
the plan is on its way, the replica runs the step while the driver plans the next one, and
`collect` waits for the launch's reply, then for the step's tokens.

A replica that fails (a call raised there, or its process ended) raises `ReplicaFailed`, one
line naming the replica and what it was doing; from then on every call to it raises the same.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request

# What the replica was doing in each call, for `ReplicaFailed`'s message.
DOING = {
    "ready": "starting", "warmup": "warming up", "restart_compile_count": "warming up",
    "launch": "stepping", "collect": "stepping", "execute": "stepping",
    "export_kv": "copying K/V out", "import_kv": "copying K/V in", "metrics": "reporting its metrics",
    "close": "closing",
}  # fmt: skip


class ReplicaFailed(RuntimeError):
    """A replica's executor failed where it runs; `replica` is its index in the cluster."""

    def __init__(self, replica: int, doing: str, cause: str):
        super().__init__(f"replica {replica} failed while {doing}: {cause}")
        self.replica = replica


@dataclasses.dataclass
class Pending:
    """A call sent to a replica, its reply not read yet (`Transport.wait`)."""

    name: str
    ticket: Any  # the transport's own handle: a sequence number, a Ray object reference
    source: "Transport"

    def result(self) -> Any:
        return self.source.wait(self)


class Transport:
    """How a call crosses to one replica's `ExecutorHost`. A subclass implements `_send`,
    `_wait` and `close`; this base keeps the failure, once there is one."""

    def __init__(self, replica: int):
        self.replica = replica
        self.failure: Optional[ReplicaFailed] = None

    def send(self, name: str, *args: Any) -> Pending:
        """Start `ExecutorHost.<name>(*args)` on the replica; returns at once."""
        if self.failure is not None:
            raise self.failure
        return Pending(name, self._send(name, args), self)

    def wait(self, pending: Pending) -> Any:
        """The call's result; `ReplicaFailed` if it raised or the replica is gone."""
        if self.failure is not None:
            raise self.failure
        return self._wait(pending)

    def call(self, name: str, *args: Any) -> Any:
        return self.wait(self.send(name, *args))

    def fail(self, name: str, cause: str) -> ReplicaFailed:
        """Record the replica's failure during call `name` (kept for every later call)."""
        if self.failure is None:
            self.failure = ReplicaFailed(self.replica, DOING.get(name, name), cause)
        return self.failure

    def _send(self, name: str, args: tuple) -> Any:
        """Send the call; an argument may be another replica's `Pending` (`export_kv`'s), which
        the transport hands over as it carries data."""
        raise NotImplementedError

    def _wait(self, pending: Pending) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Let the replica go (its process ends); no call after this one."""
        raise NotImplementedError


@dataclasses.dataclass
class RemoteStep:
    """A step launched on a remote replica (`RemoteExecutor.launch`), its tokens not read yet."""

    step: int  # the replica's id for it
    start: float  # the driver's perf_counter at launch (the loop's clock reads it)
    pending: Pending  # the launch call: its error, if it failed, surfaces at collect


class RemoteExecutor:
    """An `Executor` whose work runs on a replica's `ExecutorHost` (`transport`): the flags come
    from the replica's executor, every call crosses to it."""

    def __init__(self, transport: Transport):
        """Waits until the replica has built its executor (`ReplicaFailed` if it could not)."""
        self.transport = transport
        info = transport.call("ready")
        self.virtual_clock: bool = info["virtual_clock"]
        self.pipelined: bool = info["pipelined"]
        self.reads_token_ids: bool = info["reads_token_ids"]
        self.pid: int = info["pid"]  # the replica's process
        self._step = 0
        self._metrics: dict[str, Any] = {}  # the latest read, kept when the replica is gone
        self._closed = False

    def timeline(self) -> None:
        return None  # a replica's executor runs on the wall clock (ExecutorHost.ready checks)

    def validate(self, req: Request) -> Optional[str]:
        """Nothing: the engine rejects nothing the scheduler does not (`JaxExecutor.validate`),
        and a call would wait behind the replica's step in flight."""
        return None

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        self.transport.call("warmup", sampling, kv_transfer)

    def restart_compile_count(self) -> None:
        self.transport.call("restart_compile_count")
        self._metrics = self.transport.call("metrics")

    def execute(self, plan: Schedule) -> StepOutput:
        return self.transport.call("execute", plan)

    def launch(self, plan: Schedule) -> RemoteStep:
        self._step += 1
        start = time.perf_counter()
        return RemoteStep(self._step, start, self.transport.send("launch", self._step, plan))

    def collect(self, launched: RemoteStep) -> StepOutput:
        self.transport.wait(launched.pending)
        return self.transport.call("collect", launched.step)

    def export_kv(self, pages: Sequence[int]) -> Pending:
        """The copy-out call, under way: another `RemoteExecutor`'s `import_kv` takes it (the
        data crosses as the transport carries it; a failure names this replica)."""
        return self.transport.send("export_kv", list(pages))

    def import_kv(self, request_id: str, kv: Any) -> None:
        self.transport.call("import_kv", request_id, kv)

    def host_load_times(self) -> tuple[float, float]:
        """Not measured across the process boundary: a request's `kv_load_s` stays 0 here."""
        return 0.0, 0.0

    def metrics(self) -> dict[str, Any]:
        """The replica's executor metrics; once it failed, the last ones read, with
        `compiles_after_warmup` unknown (None)."""
        if self.transport.failure is not None:
            return {**self._metrics, "compiles_after_warmup": None}
        if self._closed:
            return self._metrics
        self._metrics = self.transport.call("metrics")
        return self._metrics

    def close(self) -> None:
        """Keep the metrics, close the replica's executor and let its process go. A replica
        that already failed is let go without a call."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.transport.failure is None:
                self._metrics = self.transport.call("metrics")
                self.transport.call("close")
        finally:
            self.transport.close()
