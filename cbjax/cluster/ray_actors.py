"""`cluster.backend=ray`: each engine replica's executor runs in a Ray actor that owns the
replica's devices (its own process, on any host of the Ray cluster); the router and every
replica's scheduler and `EngineLoop` stay in the driver (`cbjax.cluster.engine.ClusterEngine`).

The driver sends each step's plan (`cbjax.core.plan.Schedule`, plain data) to the replica's actor
and reads back its tokens, as the executor interface already splits a step: `launch` returns
at once with the actor's reply still pending, `collect` waits for it, so a pipelined replica's
next plan is made while its actor runs the step, and the actors of different replicas run
side by side. Under P/D a prefilled request's K/V goes from the prefill actor's `export_kv`
straight to the decode actor's `import_kv` through Ray's object store.

Devices: on a Ray cluster with GPUs each actor asks for `executor.mesh.tensor` GPUs (Ray sets
CUDA_VISIBLE_DEVICES); without GPUs each actor is one CPU process with `executor.mesh.tensor`
forced XLA:CPU devices.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional, Sequence

import ray

from cbjax.config import RunConfig
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request

# A Ray actor that never starts (no resources free) fails the run after this long.
ACTOR_START_TIMEOUT_S = 300.0


class ExecutorActor:
    """One replica's engine executor, in its own process (a Ray actor)."""

    def __init__(self, build: Callable[[RunConfig], Any], cfg: RunConfig):
        """`build(cfg)`: the executor (`cbjax.app.run.build_executor`, pickled by reference)."""
        self.executor = build(dataclasses.replace(cfg, progress=False))
        self._launched: dict[int, Any] = {}

    def ready(self) -> bool:
        return bool(self.executor.pipelined)

    def pid(self) -> int:
        return os.getpid()

    def warmup(self, sampling: bool, kv_transfer: bool) -> None:
        self.executor.warmup(sampling=sampling, kv_transfer=kv_transfer)

    def restart_compile_count(self) -> None:
        self.executor.restart_compile_count()

    def launch(self, step: int, plan: Schedule) -> None:
        self._launched[step] = self.executor.launch(plan)

    def collect(self, step: int) -> StepOutput:
        return self.executor.collect(self._launched.pop(step))

    def execute(self, plan: Schedule) -> StepOutput:
        return self.executor.execute(plan)

    def export_kv(self, pages: Sequence[int]):
        return self.executor.export_kv(pages)

    def import_kv(self, request_id: str, kv) -> None:
        self.executor.import_kv(request_id, kv)

    def metrics(self) -> dict:
        return self.executor.metrics()

    def close(self) -> None:
        self.executor.close()


@dataclasses.dataclass
class RemoteStep:
    """A step launched on an actor (`RayExecutor.launch`), its tokens not read yet."""

    step: int
    start: float  # the driver's perf_counter at launch (EngineLoop reads it)
    ref: Any  # the actor's launch call: its error, if it failed, surfaces at collect


class RayExecutor:
    """The driver's side of a replica whose executor is an `ExecutorActor`."""

    virtual_clock = False
    reads_token_ids = True
    remote = True  # its compile count is its own process's (ClusterEngine.summary_fields)

    def __init__(self, actor):
        self.actor = actor
        try:
            self.pipelined = ray.get(actor.ready.remote(), timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"cluster.backend=ray: a replica actor did not start within {ACTOR_START_TIMEOUT_S:.0f} s; the Ray "
                f"cluster has {ray.available_resources()} free (each replica needs 1 CPU, and executor.mesh.tensor "
                "GPUs on a cluster with GPUs)"
            ) from None
        self._step = 0
        self._metrics: Optional[dict] = None

    def validate(self, req: Request) -> Optional[str]:
        return None  # the engine checks nothing beyond the scheduler (JaxExecutor.validate)

    def timeline(self) -> None:
        return None  # the engine runs on the wall clock

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        ray.get(self.actor.warmup.remote(sampling, kv_transfer))

    def restart_compile_count(self) -> None:
        ray.get(self.actor.restart_compile_count.remote())

    def execute(self, plan: Schedule) -> StepOutput:
        return ray.get(self.actor.execute.remote(plan))

    def launch(self, plan: Schedule) -> RemoteStep:
        self._step += 1
        ref = self.actor.launch.remote(self._step, plan)  # actor calls from one caller run in order
        return RemoteStep(self._step, time.perf_counter(), ref)

    def collect(self, launched: RemoteStep) -> StepOutput:
        ray.get(launched.ref)
        return ray.get(self.actor.collect.remote(launched.step))

    def export_kv(self, pages: Sequence[int]):
        """An object reference: the K/V stays in Ray's object store until `import_kv` takes it."""
        return self.actor.export_kv.remote(list(pages))

    def import_kv(self, request_id: str, kv) -> None:
        ray.get(self.actor.import_kv.remote(request_id, kv))

    def metrics(self) -> dict:
        """The actor's executor metrics (kept once the actor is gone)."""
        if self._metrics is None:
            return ray.get(self.actor.metrics.remote())
        return self._metrics

    def close(self) -> None:
        """After serving: keep the metrics, stop the actor's executor."""
        self._metrics = ray.get(self.actor.metrics.remote())
        ray.get(self.actor.close.remote())


class RayReplicas:
    """`make_executor` for `ClusterEngine` under `cluster.backend=ray`: one `ExecutorActor` per
    replica. `shutdown` kills the actors, and Ray itself if this object started it."""

    def __init__(self, build: Callable[[RunConfig], Any], address: Optional[str] = None, **init_kwargs):
        """`build(replica_cfg)` makes an executor in an actor (`cbjax.app.run.build_executor`);
        `address`: a running Ray cluster's (None: the one `ray start` made on this host, or a
        new local one); `init_kwargs` go to `ray.init` (e.g. num_cpus for a local one)."""
        self.build = build
        self.started_ray = False
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **init_kwargs)
            self.started_ray = True
        self.actors: list[Any] = []
        self.gpus = ray.cluster_resources().get("GPU", 0) > 0

    def __call__(self, cfg: RunConfig) -> RayExecutor:
        tensor = cfg.executor.mesh.tensor
        if self.gpus:
            options: dict[str, Any] = {"num_gpus": tensor, "num_cpus": 1}
        else:
            env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={tensor}"}
            options = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
        actor = ray.remote(ExecutorActor).options(**options).remote(self.build, cfg)
        self.actors.append(actor)
        return RayExecutor(actor)

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
