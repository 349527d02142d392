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
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from cbjax.cluster.pools import replica_configs
from cbjax.cluster.prefix_index import prompt_page_hashes
from cbjax.cluster.replica import Replica
from cbjax.cluster.router import RouteRequest, make_router
from cbjax.config import RunConfig
from cbjax.engine import EngineLoop, IterationStats, RunResult
from cbjax.metrics import SERVED
from cbjax.outputs import StopFlag
from cbjax.request import FinishReason, Request, Status
from cbjax.scheduler.core import Scheduler
from cbjax.service import ServiceLog

# Event kinds, in their order at equal times (arrivals, not in the heap, rank as _ARRIVE).
_PREFILLED, _TRANSFERRED, _ARRIVE, _STEP = 0, 1, 2, 3


class ClusterServiceLog(ServiceLog):
    """The cluster's one `ServiceLog`; a transferred request's prompt and first token were
    served by its prefill replica, so its decode replica counts only what it adds."""

    def transferred(self, req: Request) -> None:
        self._prompt_done[req] = req.prompt_len
        self._generated[req] = req.num_generated


class ClusterSim:
    """Replicas behind a router on one virtual clock; `serve` runs a list of requests."""

    def __init__(self, cfg: RunConfig, make_executor: Callable[[RunConfig], Any]):
        """`make_executor(replica_cfg)` builds one replica's executor (`cbjax.run.build_executor`)."""
        check_supported(cfg)
        self.cfg = cfg
        self.router = make_router(cfg.cluster.router, cfg.cluster.router_args)
        self.service_log = ClusterServiceLog()
        self.replicas: list[Replica] = []
        for i, (role, rcfg) in enumerate(replica_configs(cfg)):
            executor = make_executor(rcfg)
            scheduler = Scheduler(
                rcfg.scheduler, rcfg.cache, rcfg.model.max_model_len, validate=executor.validate,
                eos_token_id=rcfg.model.eos_token_id, vocab_size=rcfg.model.vocab_size,
            )  # fmt: skip
            on_finish = self._prefilled_event if role == "prefill" else self._done
            loop = EngineLoop(scheduler, executor, on_step=self.service_log.on_step, on_finish=on_finish)
            self.replicas.append(Replica(i, role, rcfg, scheduler, executor, loop))
        self.front = [r for r in self.replicas if r.role != "decode"]  # where arrivals go
        self.decode = [r for r in self.replicas if r.role == "decode"]
        self.rows: dict[Request, dict[str, Any]] = {}  # request -> its extra requests.jsonl fields
        self.transfers_s: list[float] = []
        self.transferred_bytes = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._pending: deque[Request] = deque()  # arrivals to come, in time order
        self._seq = 0
        self._proxies: dict[Request, tuple[Request, RouteRequest]] = {}  # prefill copy -> request, its route
        self._on_finish: Optional[Callable[[Request], None]] = None
        self._stopping = False
        self._now = 0.0

    # ---- events ----
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _wake(self, replica: Replica, t: float) -> None:
        """Queue the replica's next iteration: now if it was idle, else when its current one ends."""
        if replica.step_pending or not replica.loop.has_work():
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
        router = self.router
        hashes = prompt_page_hashes(req, self.cfg.cache.page_size) if router.uses_prefix else ()
        route = RouteRequest(req.request_id, req.prompt_len, hashes, req.client_id, req.priority)
        replica = self.front[self._check(router.route(route, self.front), len(self.front), "route")]
        replica.num_routed += 1
        if hashes:
            replica.prefix.insert(hashes)
        if replica.role == "prefill":
            # one token: the prefill's; the copy shares the prompt's ids
            proxy = dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, max_tokens=1), target_output_len=1
            )
            self._proxies[proxy] = (req, route)
            self.rows[req] = {"prefill_replica": replica.index, "decode_replica": None, "kv_transfer_s": None}
            replica.loop.add(proxy, t)
        else:
            self.rows[req] = {"replica": replica.index, "kv_transfer_s": 0.0}
            replica.loop.add(req, t)
        replica.loop.boundary()  # a rejection is reported at once
        self._wake(replica, t)

    def _check(self, index: int, n: int, what: str) -> int:
        if not (isinstance(index, (int, np.integer)) and 0 <= index < n):
            raise ValueError(
                f"cluster.router: {type(self.router).__name__}.{what} returned {index!r}, not a replica in [0, {n})"
            )
        return int(index)

    def _prefilled_event(self, proxy: Request) -> None:
        if self._stopping or proxy.finish_s is None:
            self._prefilled(proxy, proxy.finish_s)
        else:
            self._push(proxy.finish_s, _PREFILLED, proxy)

    def _prefilled(self, proxy: Request, t: Optional[float]) -> None:
        """The prefill copy ended at `t`: start the transfer, or end the request."""
        req, route = self._proxies.pop(proxy)
        for key in ("scheduled_s", "first_token_s", "last_token_s", "num_preemptions"):
            setattr(req, key, getattr(proxy, key))
        if proxy.finish_reason not in SERVED:  # rejected, aborted, failed: the request's fate
            self._end(req, proxy.finish_reason, t, proxy.reject_reason, proxy.error)
            return
        req.output_token_ids = list(proxy.output_token_ids)
        req.num_generated = proxy.num_generated
        req.num_computed = req.prompt_len
        reason = first_token_reason(req, proxy, self.cfg.model.max_model_len)
        if reason is not None or self._stopping:
            self._end(
                req, reason or FinishReason.ABORTED, t, error=None if reason else "run stopped before its KV transfer"
            )
            return
        dst = self.decode[self._check(self.router.route_decode(route, self.decode), len(self.decode), "route_decode")]
        pages = dst.scheduler.allocator.pages_for(req.num_computed)
        kv_bytes = req.num_computed * self.cfg.model.kv_bytes_per_token
        transfer_s = kv_bytes * 8 / (self.cfg.cluster.kv_link_gbps * 1e9) + self.cfg.cluster.kv_link_latency_s
        dst.num_incoming += 1
        dst.incoming_pages += pages
        row = self.rows[req]
        row["decode_replica"], row["kv_transfer_s"] = dst.index, transfer_s
        self.transfers_s.append(transfer_s)
        self.transferred_bytes += kv_bytes
        self._push(t + transfer_s, _TRANSFERRED, (req, dst, pages))

    def _transferred(self, req: Request, dst: Replica, pages: int, t: float) -> None:
        dst.num_incoming -= 1
        dst.incoming_pages -= pages
        dst.num_routed += 1
        self.service_log.transferred(req)
        dst.scheduler.add_transferred(req, t, pages)
        dst.loop.boundary()
        self._wake(dst, t)

    def _end(
        self, req: Request, reason: Optional[FinishReason], t: Optional[float], reject_reason=None, error=None
    ) -> None:
        """End a request the cluster holds between replicas."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_s = t
        req.reject_reason = reject_reason
        req.error = error
        self._done(req)

    def _done(self, req: Request) -> None:
        if self._on_finish is not None:
            self._on_finish(req)

    # ---- the run ----
    def serve(
        self,
        requests: list[Request],
        *,
        stop: Optional[StopFlag] = None,
        on_finish: Optional[Callable[[Request], None]] = None,
    ) -> RunResult:
        """Serve `requests` (any order), each at its `arrival_s`; every request ends with a fate
        (as `cbjax.engine.serve`, `stop` included). The result covers the whole cluster."""
        wall0 = time.perf_counter()
        self._on_finish = on_finish
        pending = self._pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        heap = self._heap
        with _cyclic_gc_paused():
            interrupted = self._run(pending, heap, stop)
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
                elif kind == _PREFILLED:
                    self._prefilled(payload, t)
                else:
                    self._transferred(*payload, t)
            else:
                req = pending.popleft()
                self._now = req.arrival_s
                self._arrive(req, req.arrival_s)
        return False

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
                self._end(payload[0], FinishReason.ABORTED, now, error="run stopped during its KV transfer")
        for req in pending:
            self._end(req, FinishReason.NOT_ARRIVED, None)

    def _result(self, requests: list[Request], interrupted: bool, wall_s: float) -> RunResult:
        stats = IterationStats()
        tbt: list[float] = []
        for replica in self.replicas:
            s = replica.loop.stats
            for key in ("iterations", "busy_s", "occupied_slot_iterations", "batched_tokens", "pages_used_sum",
                        "kv_util_sum", "schedule_s", "postprocess_s"):  # fmt: skip
                setattr(stats, key, getattr(stats, key) + getattr(s, key))
            stats.pages_used_peak = max(stats.pages_used_peak, s.pages_used_peak)
            stats.batch_peak = max(stats.batch_peak, s.batch_peak)
            stats.kv_share_sums = [a + b for a, b in zip(stats.kv_share_sums, s.kv_share_sums)]
            stats.finish_iteration.update(s.finish_iteration)
            tbt.extend(replica.scheduler.tbt_s)
        return RunResult(
            requests=requests,
            stats=stats,
            num_slots=self.cfg.scheduler.max_num_seqs,
            makespan_s=max(r.loop.last_end for r in self.replicas),
            preemptions=sum(r.scheduler.num_preemptions for r in self.replicas),
            wall_s=wall_s,
            extra=self._cache_stats(),
            tbt_s=tbt,
            interrupted=interrupted,
        )

    def _cache_stats(self) -> dict[str, Any]:
        """The replicas' prefix-cache and swap counters, summed; the hit rate over all prompt
        tokens admitted for the first time, cluster-wide."""
        out: dict[str, Any] = {}
        admitted = hit = 0
        for replica in self.replicas:
            for key, value in replica.scheduler.cache_stats().items():
                if key != "prefix_cache_hit_rate":
                    out[key] = out.get(key, 0) + value
            prefix = replica.scheduler.prefix
            if prefix is not None:
                admitted += prefix.prompt_tokens_admitted
                hit += prefix.prompt_tokens_hit
        out["prefix_cache_hit_rate"] = hit / admitted if admitted else 0.0
        return out

    def summary_fields(self, result: RunResult) -> dict[str, Any]:
        """The cluster's own summary.json fields."""
        c = self.cfg.cluster
        transfers = np.asarray(self.transfers_s, dtype=np.float64)
        out: dict[str, Any] = {
            "cluster_replicas": len(self.replicas),
            "router": c.router,
            "disaggregated": c.disaggregated,
            "kv_transfers": int(transfers.size),
            "kv_transferred_bytes": self.transferred_bytes,
        }
        for p in (50, 99):
            out[f"kv_transfer_s_p{p}"] = float(np.percentile(transfers, p)) if transfers.size else None
        out["kv_transfer_s_mean"] = float(transfers.mean()) if transfers.size else None
        out["replicas"] = [r.summary(result.makespan_s) for r in self.replicas]
        return out

    def row_extras(self, req: Request) -> dict[str, Any]:
        """A request's extra requests.jsonl fields: its replica(s) and KV transfer time."""
        if self.cfg.cluster.disaggregated:
            return self.rows.get(req, {"prefill_replica": None, "decode_replica": None, "kv_transfer_s": None})
        return self.rows.get(req, {"replica": None, "kv_transfer_s": None})


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


def first_token_reason(req: Request, proxy: Request, max_model_len: int) -> Optional[FinishReason]:
    """Why `req` ends at the first token its prefill copy produced, or None: the copy stopped
    on a real token (EOS, a stop token), or the request's own length ends at one token (the
    scheduler's `_length_reason` at one generated token)."""
    if proxy.output_token_ids and proxy.finish_reason in (FinishReason.EOS, FinishReason.STOP):
        return proxy.finish_reason
    if min(req.stop_length(), max_model_len - req.prompt_len) > 1:
        return None
    hit_target = req.target_output_len is not None and req.target_output_len <= 1
    if hit_target and req.sampling.max_tokens > 1 and req.prompt_len + 1 < max_model_len:
        return FinishReason.EOS
    return FinishReason.MAX_MODEL_LEN if req.stop_length() > 1 else FinishReason.LENGTH


def check_supported(cfg: RunConfig) -> None:
    """What this driver runs: the simulator's virtual clock, in one process."""
    c = cfg.cluster
    if c.backend != "local":
        raise ValueError(f"cluster.backend={c.backend}: only local replicas are built; use cluster.backend=local")
    if cfg.executor.name != "sim":
        raise ValueError(
            f"executor.name={cfg.executor.name}: a cluster (cluster.replicas > 1 or P/D pools) runs in the "
            "simulator only for now; use executor=sim"
        )
    if cfg.executor.pace != "none":
        raise ValueError(f"executor.pace={cfg.executor.pace}: a cluster runs on the virtual clock only (pace none)")
    if cfg.distributed.enabled:
        raise ValueError("distributed.num_processes: a cluster runs in one process; set it to 1")
