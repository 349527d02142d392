"""Replicas sharing one host in the simulator (no jax): the engine cluster's situation.

`ClusterEngine` runs every replica's serving loop on one driver thread, in turns: each turn
admits the arrivals due, then steps every replica with work once, in replica order. A
pipelined replica launches its next step and then waits for the one in flight, so a replica's
iteration spans the whole turn, and the turn lasts as long as the replicas' work together
takes on the host they share (one driver thread; replicas on forced CPU devices share the
host's cores, one XLA:CPU thread pool). A cost model fitted on a lone replica (`profiled`)
charges each iteration what it costs with the host to itself.

`cluster.host_share` (s) is the share of the host's capacity a lone replica's serving keeps
busy. The simulator then runs the engine's turns (`cbjax.cluster.driver.ClusterSim`): in a
turn starting at `t`, each busy replica runs its iteration as if alone, taking `span_r`
(from `t` to the end of the step it launched), and every iteration of the turn ends at

    t + turn_length(spans, s),   turn_length = max(max_r span_r, s x sum_r span_r)

the replicas' summed demand on the host at share s, but no less than the longest iteration.
So a replica's decode waits for a neighbour's prefill in the same turn, as on the engine. Two
equal replicas take 2s times a lone iteration; experiments/calibrate_cluster.py fits s so that
the simulator's 2 replicas are as many times faster than one as the engine's are. At s = 1 the
turn is the iterations one after another; at s = 1/2 or less two equal replicas are as fast as
on hosts of their own; above 1 (at most 2) busy replicas slow each other beyond taking turns,
as when their XLA:CPU threads and the driver thread are more than the host's cores.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cbjax.core.executor import SyncExecutor
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request


def turn_length(spans: Sequence[float], host_share: float) -> float:
    """How long a turn lasts whose replicas' iterations take `spans` alone (module docstring);
    a replica alone in its turn (the others idle or only landing: span 0) shares nothing."""
    longest = max(spans, default=0.0)
    if sum(1 for s in spans if s > 0) < 2:
        return longest
    return max(longest, host_share * sum(spans))


class SharedHostExecutor(SyncExecutor):
    """A replica's simulated executor on a shared host: `inner`'s steps, on the replica's own
    timeline. The driver lengthens the replica's iterations to their turn's end and adds what
    it added to `delay_s`; the inner cost model sees the clock minus that delay, so an
    iteration that a neighbour delayed does not look like one after an idle loop (the
    `profiled` model's wake-up cost): only a real idle gap does."""

    def __init__(self, inner: Any):
        if not getattr(inner, "virtual_clock", False):
            raise ValueError("cluster.host_share: models a shared host in the simulator; it needs executor=sim")
        self.inner = inner
        # the turns are the pipelined engine loop's (`executor.async_scheduling`, checked by the
        # driver), whatever the cost model: an iteration spans its turn
        self.pipelined = True
        self.delay_s = 0.0  # time the sharing added to this replica's iterations so far
        self.reads_token_ids = getattr(inner, "reads_token_ids", False)

    def execute(self, plan: Schedule) -> StepOutput:
        start = plan.start_s
        plan.start_s = start - self.delay_s
        try:
            out = self.inner.execute(plan)
        finally:
            plan.start_s = start
        # In a turn the step runs from the turn's start; its launch (the host time that, on a
        # lone pipelined loop, ends the step in flight no earlier) is the host part of this
        # iteration's span: the iteration takes the longer of the two, one plan early.
        return StepOutput(out.token_ids, max(out.duration_s, out.launch_s), errors=out.errors)

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
