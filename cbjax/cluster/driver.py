"""The cluster in the simulator: replicas on one shared virtual clock, driven by events (no jax).

Every replica is today's `Scheduler` + executor + `EngineLoop`, unchanged. Events, in time
order: arrivals (each routed at its arrival time), a replica's next iteration (it starts when
its previous one ends, so it runs `EngineLoop.step` once and its clock moves to the
iteration's end), and under disaggregation a prefill's end (the decode replica is chosen
then) and a KV transfer's end (the request joins the decode replica). A heap orders them, so
replicas overlap in time exactly and no step scans all replicas; a replica whose next
iteration starts before every other event runs it at once, without a trip through the heap.

At equal times a prefill's end, then a transfer's, then an arrival come before an iteration,
so an iteration starting at t sees everything that arrived by t, as a single replica's
`serve` does. A router sees a replica as of its latest planned iteration: requests that
iteration finishes have left it.

Disaggregation: the prefill replica serves a copy of the request capped at one token (its
first token comes from the prefill); then its prompt's K/V, prompt_len x the model's KV bytes
per token, crosses the KV link in `kv_bytes x 8 / (cluster.kv_link_gbps x 1e9) +
cluster.kv_link_latency_s` seconds and reaches the decode replica as a host copy, which it
admits as a swapped-out request (`Scheduler.add_transferred`): its cost model charges the
copy in as a swap-in. Between replicas the cluster owns the request, and ends it itself if
it never reaches one.

With `cluster.host_share` set the replicas share one host, as an engine cluster's do, and the
driver runs the engine driver's turns instead of the event queue's independent timelines
(`_run_turns`, the model in `cbjax.cluster.host`): each turn admits what is due, steps every
busy replica once, and ends when the replicas' iterations together are over on the shared host.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import time
from collections import deque
from typing import Any, Callable, Optional

from cbjax.cluster.core import ClusterBase, ClusterServiceLog, Handoff, first_token_reason
from cbjax.cluster.host import SharedHostExecutor, turn_length
from cbjax.cluster.replica import Replica
from cbjax.config import RunConfig
from cbjax.core.results import RunResult
from cbjax.core.stop import StopFlag
from cbjax.core.request import FinishReason, Request

__all__ = ["ClusterServiceLog", "ClusterSim", "check_supported", "first_token_reason"]

# Event kinds, in their order at equal times (arrivals, not in the heap, rank as _ARRIVE).
_PREFILLED, _TRANSFERRED, _ARRIVE, _STEP = 0, 1, 2, 3


class ClusterSim(ClusterBase):
    """Replicas behind a router on one virtual clock; `serve` runs a list of requests."""

    def __init__(self, cfg: RunConfig, make_executor: Callable[[RunConfig], Any]):
        """`make_executor(replica_cfg)` builds one replica's executor (`cbjax.app.run.build_executor`)."""
        check_supported(cfg)
        self._host_share = cfg.cluster.host_share
        if self._host_share is not None:  # one host for all replicas, in turns (cbjax.cluster.host)
            inner = make_executor

            def make_executor(rcfg):
                return SharedHostExecutor(inner(rcfg))

        super().__init__(cfg, make_executor)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._pending: deque[Request] = deque()  # arrivals to come, in time order
        self._seq = 0
        self._now = 0.0

    # ---- events ----
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _wake(self, replica: Replica, t: float) -> None:
        """Queue the replica's next iteration: now if it was idle, else when its current one ends
        (in turns, the next turn steps it)."""
        if replica.step_pending or not replica.loop.has_work() or self._host_share is not None:
            return
        loop = replica.loop
        loop.advance_to(t)  # idle until t: its virtual clock jumps, as `serve`'s does
        replica.step_pending = True
        self._seq += 1  # self._push, inlined: once per iteration
        heapq.heappush(self._heap, (loop.now(), _STEP, self._seq, replica))

    def _step(self, replica: Replica, stop: Optional[StopFlag]) -> None:
        """Run the replica's iterations while each starts before every other event: the next
        one then needs no trip through the heap."""
        replica.step_pending = False
        loop, heap, pending = replica.loop, self._heap, self._pending
        while True:
            loop.step()
            loop.boundary()  # reports the iteration's finished requests
            t = loop.now()
            if not loop.has_work():
                return
            # (heap[0][0], heap[0][1]) <= (t, _STEP) is heap[0][0] <= t: no kind ranks after _STEP
            if (
                (heap and heap[0][0] <= t)
                or (pending and pending[0].arrival_s <= t)
                or (stop is not None and stop.is_set())
            ):
                # self._wake(replica, t), whose checks hold here: it has work, no step queued,
                # and its clock is at t
                replica.step_pending = True
                self._seq += 1
                heapq.heappush(heap, (t, _STEP, self._seq, replica))
                return
            self._now = t

    def _arrive(self, req: Request, t: float) -> None:
        self._wake(self._admit(req, t), t)

    def _prefilled_event(self, proxy: Request) -> None:
        if self._stopping or proxy.finish_s is None:
            self._prefilled(proxy, proxy.finish_s)
        else:
            self._push(proxy.finish_s, _PREFILLED, proxy)

    def _prefilled(self, proxy: Request, t: Optional[float]) -> None:
        """The prefill copy ended at `t`: start the transfer, or end the request."""
        h = self._handoff(proxy, t)
        if h is not None:
            self._record_transfer(h, h.transfer_s)
            self._push(t + h.transfer_s, _TRANSFERRED, h)

    def _handoff_event(self, kind: int, payload: Any, t: float) -> None:
        """A P/D event from the heap at `t`: a prefill's end (`_PREFILLED`) or a transfer's."""
        if kind == _PREFILLED:
            self._prefilled(payload, t)
        else:
            self._on_transferred(payload, t)

    def _on_transferred(self, h: Handoff, t: float) -> None:
        self._transferred(h, t)
        self._wake(h.dst, t)

    # ---- the run ----
    def serve(
        self,
        requests: list[Request],
        *,
        stop: Optional[StopFlag] = None,
        on_finish: Optional[Callable[[Request], None]] = None,
    ) -> RunResult:
        """Serve `requests` (any order), each at its `arrival_s`; every request ends with a fate
        (as `cbjax.engine.offline.serve`, `stop` included). The result covers the whole cluster."""
        wall0 = time.perf_counter()
        self._on_finish = on_finish
        pending = self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        heap = self._heap
        with _cyclic_gc_paused():
            if self._host_share is None:
                interrupted = self._run(pending, heap, stop)
            else:
                interrupted = self._run_turns(pending, heap, stop, self._host_share)
        if interrupted:
            self._stop(list(pending))
        return self._result(list(requests), interrupted, time.perf_counter() - wall0)

    def _run(self, pending: deque, heap: list, stop: Optional[StopFlag]) -> bool:
        """The event loop; True if `stop` ended it."""
        heappop = heapq.heappop
        while pending or heap:
            if stop is not None and stop.is_set():
                return True
            if heap and (
                not pending
                or heap[0][0] < pending[0].arrival_s
                or (heap[0][0] == pending[0].arrival_s and heap[0][1] < _ARRIVE)
            ):
                t, kind, _, payload = heappop(heap)
                self._now = t
                if kind == _STEP:
                    self._step(payload, stop)
                else:
                    self._handoff_event(kind, payload, t)
            else:
                req = pending.popleft()
                self._now = req.arrival_s
                self._arrive(req, req.arrival_s)
        return False

    def _run_turns(self, pending: deque, heap: list, stop: Optional[StopFlag], share: float) -> bool:
        """The shared host's loop, as `ClusterEngine.serve`'s: a turn at `t` takes what is due by
        `t` (prefill ends, transfer ends and arrivals, in time order), then steps every replica
        with work once, each on its own timeline from `t`, and ends all their iterations at
        `t + turn_length(spans, share)` (`cbjax.cluster.host`); idle, it jumps to the next
        event. True if `stop` ended it."""
        heappop = heapq.heappop
        t = 0.0
        while True:
            if stop is not None and stop.is_set():
                return True
            while (heap and heap[0][0] <= t) or (pending and pending[0].arrival_s <= t):
                if heap and (not pending or (heap[0][0], heap[0][1]) <= (pending[0].arrival_s, _ARRIVE)):
                    te, kind, _, payload = heappop(heap)  # no _STEP events: turns step the replicas
                    self._now = te
                    self._handoff_event(kind, payload, te)
                else:
                    req = pending.popleft()
                    self._now = req.arrival_s
                    self._arrive(req, req.arrival_s)
            busy = [r for r in self.replicas if r.loop.has_work()]
            if not busy:
                if not heap and not pending:
                    return False
                t = min(heap[0][0] if heap else float("inf"), pending[0].arrival_s if pending else float("inf"))
                continue
            ends = []
            for replica in busy:
                loop = replica.loop
                loop.advance_to(t)
                loop.step()
                loop.boundary()  # reports the iteration's finished requests
                ends.append(loop.inflight_end())
            # a landing alone (nothing in flight after it) costs the turn nothing
            t_end = t + turn_length([0.0 if end is None else max(0.0, end - t) for end in ends], share)
            for replica, end in zip(busy, ends):
                if end is not None and end < t_end:
                    replica.executor.delay_s += t_end - end
                    replica.loop.delay_inflight(t_end)
            t = self._now = max(t, t_end)

    def _stop(self, pending: list[Request]) -> None:
        """End what is unfinished: aborted if it had arrived, `not_arrived` if not."""
        self._stopping = True
        now = max([self._now] + [r.loop.now() for r in self.replicas])
        for replica in self.replicas:
            replica.loop.abort_all()
        while self._heap:
            _, kind, _, payload = heapq.heappop(self._heap)
            if kind == _PREFILLED:
                self._prefilled(payload, now)
            elif kind == _TRANSFERRED:
                self._end(payload.req, FinishReason.ABORTED, now, error="run stopped during its KV transfer")
        for req in pending:
            self._end(req, FinishReason.NOT_ARRIVED, None)

@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector. The loop allocates many short-lived objects,
    all freed by reference counting; each collection would instead walk every live object of
    the run (all requests, every replica's state) and find nothing. Restored on exit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def check_supported(cfg: RunConfig) -> None:
    """What this driver runs: the simulator's virtual clock, in one process."""
    c = cfg.cluster
    if cfg.executor.name != "sim":
        raise ValueError(
            f"executor.name={cfg.executor.name}: ClusterSim runs the simulator (executor=sim); an engine "
            "cluster runs in cbjax.cluster.engine.ClusterEngine"
        )
    if c.backend != "local":
        raise ValueError(
            f"cluster.backend={c.backend}: Ray actors run engine replicas (executor=jax); the simulated "
            "cluster runs in one process, use cluster.backend=local"
        )
    if c.host_share is not None and not cfg.executor.async_scheduling:
        raise ValueError(
            f"cluster.host_share={c.host_share}: the shared host runs the pipelined engine loop's turns; "
            "set executor.async_scheduling=true (the default)"
        )
    if cfg.executor.pace != "none":
        raise ValueError(f"executor.pace={cfg.executor.pace}: a cluster runs on the virtual clock only (pace none)")
    if cfg.distributed.enabled:
        raise ValueError("distributed.num_processes: a cluster runs in one process; set it to 1")
