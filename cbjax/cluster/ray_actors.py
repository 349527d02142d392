"""`cluster.backend=ray`: each engine replica's executor in a Ray actor that owns the replica's
devices (its own process, on any host of the Ray cluster); the router and every replica's
scheduler and `EngineLoop` stay in the driver (`cbjax.cluster.engine.ClusterEngine`).

The actor is the replica's `cbjax.cluster.executor_host.ExecutorHost`, as a child process's is
under `cluster.backend=processes`; only the way a call crosses differs (`RayTransport`: a call
is an actor task, its reply an object reference). Ray runs one caller's tasks on an actor in
order. Under P/D a prefilled request's K/V goes from the prefill actor's `export_kv` straight
to the decode actor's `import_kv` through Ray's object store.

Devices: on a Ray cluster with GPUs each actor asks for `executor.mesh.tensor` GPUs (Ray sets
CUDA_VISIBLE_DEVICES); without GPUs each actor is one CPU process with `executor.mesh.tensor`
forced XLA:CPU devices.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any, Callable, Optional

import ray

from cbjax.cluster.executor_host import ExecutorHost, ReplicaError
from cbjax.cluster.remote import Pending, RemoteExecutor, Transport
from cbjax.config import RunConfig

# A Ray actor that never starts (no resources free) fails the run after this long.
ACTOR_START_TIMEOUT_S = 300.0


class RayTransport(Transport):
    """Calls to one replica's actor."""

    def __init__(self, replica: int, actor):
        super().__init__(replica)
        self.actor = actor

    def _send(self, name: str, args: tuple) -> _Call:
        upstream = tuple(a for a in args if isinstance(a, Pending))
        args = tuple(a.ticket.ref if isinstance(a, Pending) else a for a in args)  # Ray hands the object over
        return _Call(self.actor.call.remote(name, *args), upstream)

    def _wait(self, pending: Pending) -> Any:
        call: _Call = pending.ticket
        timeout = ACTOR_START_TIMEOUT_S if pending.name == "ready" else None
        try:
            return ray.get(call.ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise self.fail(
                pending.name,
                f"its actor did not start within {ACTOR_START_TIMEOUT_S:.0f} s; the Ray cluster has "
                f"{ray.available_resources()} free (each replica needs 1 CPU, and executor.mesh.tensor GPUs on a "
                "cluster with GPUs)",
            ) from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
            # Ray fails a call whose argument (another replica's call) failed with that call's
            # error: the failure is then that replica's, which its own wait raises
            for source in call.upstream:
                source.result()
            raise self.fail(pending.name, _cause(err)) from None

    def close(self) -> None:
        """The actor ends with `RayReplicas.shutdown`."""


@dataclasses.dataclass
class _Call:
    """An actor task under way (`Pending.ticket`)."""

    ref: Any  # its object reference
    upstream: tuple[Pending, ...]  # other replicas' calls whose results are its arguments


def _cause(err: Exception) -> str:
    """One line for an actor call that failed: the replica's own (`ReplicaError`), or Ray's."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if isinstance(err.cause, ReplicaError) else f"{type(err.cause).__name__}: {err.cause}"
        return str(cause).splitlines()[0]
    return f"its actor died ({str(err).strip().splitlines()[0]})"


class RayReplicas:
    """`make_executor` for `ClusterEngine` under `cluster.backend=ray`: one actor per replica.
    `shutdown` kills the actors, and Ray itself if this object started it."""

    def __init__(self, build: Callable[[RunConfig], Any], address: Optional[str] = None, **init_kwargs):
        """`build(replica_cfg)` makes an executor in an actor (`cbjax.app.run.build_executor`);
        `address`: a running Ray cluster's (None: the one `ray start` made on this host, or a
        new local one); `init_kwargs` go to `ray.init` (e.g. num_cpus for a local one)."""
        self.build = build
        self.started_ray = False
        if not ray.is_initialized():
            # ray.init puts its own SIGTERM handler (exit at once) in place of the run's, which
            # ends the run with every request's fate saved: the run's stays
            main = threading.current_thread() is threading.main_thread()
            handler = signal.getsignal(signal.SIGTERM) if main else None
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **init_kwargs)
            if main:
                signal.signal(signal.SIGTERM, handler)
            self.started_ray = True
        self.actors: list[Any] = []
        self.gpus = ray.cluster_resources().get("GPU", 0) > 0

    def __call__(self, cfg: RunConfig) -> RemoteExecutor:
        tensor = cfg.executor.mesh.tensor
        if self.gpus:
            options: dict[str, Any] = {"num_gpus": tensor, "num_cpus": 1}
        else:
            env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={tensor}"}
            options = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
        actor = ray.remote(ExecutorHost).options(**options).remote(self.build, cfg)
        self.actors.append(actor)
        return RemoteExecutor(RayTransport(len(self.actors) - 1, actor))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
