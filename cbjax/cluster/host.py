"""Replicas sharing one host in the simulator (no jax): the engine cluster's situation.

`ClusterEngine` runs every replica's serving loop on one driver thread, and replicas on
forced CPU devices share the host's cores (one XLA:CPU thread pool). A cost model fitted on a
lone replica (`profiled`) charges each iteration what it costs with the host to itself; beside
another busy replica the same iteration gets a part of the host only.

`cluster.host_share` is the share of the host's capacity a lone replica's serving keeps busy
(its driver thread's share of one thread, or its process's share of the cores it can get,
whichever binds). experiments/calibrate_cluster.py fits it on engine runs of its own, a lone
replica's burst against 2 replicas' (the model's identity below), and reports the driver
thread's and the cores' shares beside it. Then `k` busy replicas ask
for `k x host_share` of the host; beyond 1 each iteration slows in proportion (processor
sharing), so an iteration that starts while `k` replicas have work takes

    duration x max(1, k x host_share)

`k` counts the replicas busy when the iteration starts, itself included: those with work, and
those whose last iteration runs past that time (the simulator settles an iteration's
requests at its start, so a replica whose requests all end in it has no work left, yet it is
still running). The factor is fixed at the start (a replica that goes idle mid-way does not
shorten it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from cbjax.executor import SyncExecutor
from cbjax.plan import Schedule, StepOutput
from cbjax.request import Request


def host_stretch(num_busy: int, host_share: float) -> float:
    """How much slower an iteration runs while `num_busy` replicas share the host."""
    return max(1.0, num_busy * host_share)


class SharedHostExecutor(SyncExecutor):
    """A replica's simulated executor on a shared host: `inner`'s durations stretched by
    `host_stretch(busy(plan.start_s), host_share)`.

    The inner cost model sees the replica's own timeline, its clock minus the delay the
    sharing added so far, so an iteration that a neighbour delayed does not look like one
    after an idle loop (the `profiled` model's wake-up cost): only a real idle gap does."""

    def __init__(self, inner: Any, host_share: float, busy: Callable[[float], int]):
        if not getattr(inner, "virtual_clock", False):
            raise ValueError("cluster.host_share: models a shared host in the simulator; it needs executor=sim")
        self.inner = inner
        self.host_share = host_share
        self.busy = busy
        self.delay_s = 0.0  # time the sharing added to this replica's iterations so far
        self.reads_token_ids = getattr(inner, "reads_token_ids", False)

    def execute(self, plan: Schedule) -> StepOutput:
        start = plan.start_s
        plan.start_s = start - self.delay_s
        try:
            out = self.inner.execute(plan)
        finally:
            plan.start_s = start
        duration = out.duration_s * host_stretch(self.busy(start), self.host_share)
        self.delay_s += duration - out.duration_s
        return StepOutput(token_ids=out.token_ids, duration_s=duration, errors=out.errors)

    def validate(self, req: Request) -> Optional[str]:
        return self.inner.validate(req)

    def warmup(self) -> None:
        self.inner.warmup()

    def metrics(self) -> dict[str, Any]:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the inner executor's own fields (cost_model, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def num_busy(replicas: Sequence[Any], t: float) -> int:
    """Replicas busy at `t` on the virtual clock: with work (`EngineLoop.has_work`), or with an
    iteration that ends after `t`."""
    return sum(1 for r in replicas if r.loop.has_work() or r.loop.now() > t)
