"""The cluster in the simulator: replicas on one virtual clock, each on its own timeline (no jax).

Every replica is a `Scheduler` + executor + `EngineLoop`, as a lone run's; the one drive loop
(`cbjax.engine.drive`) runs them in time order. Arrivals are routed at their arrival time.
Under prefill/decode disaggregation two events join them: a prefill's end (the decode replica
is chosen then) and a KV transfer's end (the request joins the decode replica); at equal times
a prefill's end comes before a transfer's, and both before an arrival and an iteration. A
router sees a replica as of its latest planned iteration: requests that iteration finishes
have left it.

Disaggregation: the prefill replica serves a copy of the request capped at one token (its
first token comes from the prefill); then its prompt's K/V, prompt_len x the model's KV bytes
per token, crosses the KV link in `kv_bytes x 8 / (cluster.kv_link_gbps x 1e9) +
cluster.kv_link_latency_s` seconds and reaches the decode replica as a host copy, which it
admits as a swapped-out request (`Scheduler.add_transferred`): its cost model charges the
copy in as a swap-in. Between replicas the cluster owns the request, and ends it itself if
it never reaches one.

Replicas are independent machines: each has its own devices and host, as the system under
study runs them.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Any, Callable, Optional

from cbjax.cluster.core import ClusterBase, ClusterServiceLog, Handoff, first_token_reason
from cbjax.config import RunConfig
from cbjax.core.request import FinishReason, Request
from cbjax.report.metrics import SERVED
from cbjax.core.results import RunResult
from cbjax.core.stop import StopFlag
from cbjax.engine.drive import Events, drive
from cbjax.engine.followups import Followups
from cbjax.engine.loop import EngineLoop

__all__ = ["ClusterServiceLog", "ClusterSim", "check_supported", "first_token_reason"]

# Event kinds, in their order at equal times.
_PREFILLED, _TRANSFERRED = 0, 1


class ClusterSim(ClusterBase):
    """Replicas behind a router on one virtual clock; `serve` runs a list of requests.

    Its executors are the simulator's, or engines timed by a cost model
    (`cbjax.sim.costed.CostTimed`): the engine's replicas on the simulator's clock, whose
    decisions are the simulator's. A prefilled request's K/V goes through the executors
    (`export_kv` as its prefill ends, `import_kv` when its decode replica is chosen; nothing
    for the simulator's)."""

    holds_prefill_pages = True  # until its K/V is exported, as its prefill ends

    def __init__(self, cfg: RunConfig, make_executor: Callable[[RunConfig], Any]):
        """`make_executor(replica_cfg)` builds one replica's executor (`cbjax.app.run.build_executor`)."""
        check_supported(cfg)
        super().__init__(cfg, make_executor)
        self._events = Events(self._on_event)
        self._kv: dict[Request, Any] = {}  # prefill copy -> its exported K/V, until it moves on

    def _arrive(self, req: Request, t: float) -> EngineLoop:
        return self._admit(req, t).loop

    def _prefilled_event(self, proxy: Request) -> None:
        src = self._proxies[proxy][2]
        if proxy.finish_reason in SERVED:  # its prompt's K/V, on its first pages
            pages = src.scheduler.held_pages(proxy.request_id)[: src.scheduler.allocator.pages_for(proxy.num_computed)]
            self._kv[proxy] = src.executor.export_kv(pages)
        src.scheduler.release_held(proxy.request_id)  # freed as the prefill ends, as without K/V to move
        if self._stopping or proxy.finish_s is None:
            self._prefilled(proxy, proxy.finish_s)
        else:
            self._events.push(proxy.finish_s, _PREFILLED, proxy)

    def _prefilled(self, proxy: Request, t: Optional[float]) -> None:
        """The prefill copy ended at `t`: start the transfer, or end the request."""
        kv = self._kv.pop(proxy, None)
        h = self._handoff(proxy, t)
        if h is not None:
            h.dst.executor.import_kv(h.req.request_id, kv)
            self._record_transfer(h, h.transfer_s)
            self._events.push(t + h.transfer_s, _TRANSFERRED, h)

    def _on_event(self, t: float, kind: int, payload: Any) -> Optional[EngineLoop]:
        if kind == _PREFILLED:
            self._prefilled(payload, t)
            return None
        h: Handoff = payload
        self._transferred(h, t)
        return h.dst.loop

    def _drive(
        self, requests: list[Request], pending: deque[Request], followups: Optional[Followups], stop: Optional[StopFlag]
    ) -> RunResult:
        """The replicas in time order on the virtual clock, with the P/D events between them."""
        wall0 = time.perf_counter()
        loops = [replica.loop for replica in self.replicas]
        # P/D's events and sessions' later turns are the only ways one replica's steps reach another's
        events = self._events if self.cfg.cluster.disaggregated else None
        interrupted = drive(loops, pending, self._arrive, events=events, stop=stop, released=followups is not None)
        unreleased = followups.close() if followups is not None else []
        if interrupted or unreleased:
            self._stop(list(pending) + unreleased)
        return self._result(list(requests), interrupted, time.perf_counter() - wall0)

    def _stop(self, pending: list[Request]) -> None:
        """End what is unfinished: aborted if it had arrived, `not_arrived` if not."""
        self._stopping = True
        now = max(r.loop.now() for r in self.replicas)
        for replica in self.replicas:
            replica.loop.abort_all()
        heap = self._events.heap
        while heap:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _PREFILLED:
                self._prefilled(payload, now)
            else:
                self._end(payload.req, FinishReason.ABORTED, now, error="run stopped during its KV transfer")
        for req in pending:
            self._end(req, FinishReason.NOT_ARRIVED, None)


def check_supported(cfg: RunConfig) -> None:
    """What this driver runs: the simulator's virtual clock, in one process (`cluster.backend`
    processes or inline: the simulated replicas are host objects, with no devices to own)."""
    c = cfg.cluster
    if cfg.executor.name != "sim":
        raise ValueError(
            f"executor.name={cfg.executor.name}: ClusterSim runs the simulator (executor=sim); an engine "
            "cluster runs in cbjax.cluster.engine.ClusterEngine"
        )
    if c.backend == "ray":
        raise ValueError(
            "cluster.backend=ray: Ray actors hold engine replicas (executor=jax); the simulated cluster "
            "runs in this process, use cluster.backend=processes (the default) or inline"
        )
    if cfg.executor.pace != "none":
        raise ValueError(f"executor.pace={cfg.executor.pace}: a cluster runs on the virtual clock only (pace none)")
    if cfg.distributed.enabled:
        raise ValueError("distributed.num_processes: a cluster runs in one process; set it to 1")
