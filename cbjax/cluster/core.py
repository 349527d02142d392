"""What every cluster driver shares (no jax): building the replicas, routing an arrival, the
prefill copy of a request under P/D and the decision to move it to a decode replica, ending
a request the cluster holds, and the cluster's result, summary fields and request rows.

A driver (`ClusterSim` on a virtual clock, `ClusterEngine` on the wall clock) decides only
when things happen: when an iteration runs, and when a prefilled request's K/V reaches its
decode replica.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from cbjax.cluster.pools import replica_configs
from cbjax.cluster.prefix_index import prompt_page_hashes
from cbjax.cluster.replica import Replica
from cbjax.cluster.router import RouteRequest, make_router
from cbjax.config import RunConfig
from cbjax.core.stop import StopFlag
from cbjax.engine.followups import Followups, arrivals
from cbjax.engine.loop import EngineLoop
from cbjax.core.results import IterationStats, RunResult
from cbjax.report.metrics import SERVED
from cbjax.core.request import FinishReason, Request, Status
from cbjax.scheduler.intake import output_bound
from cbjax.sim.pricing import build_scheduler
from cbjax.report.service import ServiceLog


# What a request's row takes from its prefill copy: its admission and first token, and with a
# host KV tier the prompt tokens its admission found in each tier and its loads' seconds.
_FROM_PREFILL = ("scheduled_s", "first_token_s", "last_token_s", "num_preemptions",
                 "prefix_hit_tokens_device", "prefix_hit_tokens_host", "kv_load_s")  # fmt: skip


class ClusterServiceLog(ServiceLog):
    """The cluster's one `ServiceLog`; a transferred request's prompt and first token were
    served by its prefill replica, so its decode replica counts only what it adds."""

    def transferred(self, req: Request) -> None:
        self._prompt_done[req] = req.prompt_len
        self._generated[req] = req.num_generated


@dataclasses.dataclass
class Handoff:
    """A prefilled request on its way from a prefill replica to a decode replica."""

    req: Request
    proxy: Request  # its prefill copy, finished on `src`
    src: Replica
    dst: Replica
    pages: int  # pages it needs on `dst`
    transfer_s: float  # the KV link's time for it (the simulator's cost)


class ClusterBase:
    """Replicas behind a router; `serve` runs a list of requests, which subclasses drive in
    time (`_drive`)."""

    # True: a prefill replica keeps a finished prefill's pages until the driver releases them
    # (`Scheduler.hold_finished_pages`), so their K/V can be copied out first.
    holds_prefill_pages = False

    def __init__(
        self,
        cfg: RunConfig,
        make_executor: Callable[[RunConfig], Any],
        make_loop: Callable[..., EngineLoop] = EngineLoop,
    ):
        """`make_executor(replica_cfg)` builds each replica's executor, in replica order
        (`cbjax.app.run.build_executor`); `make_loop` its `EngineLoop`."""
        self.cfg = cfg
        self.router = make_router(cfg.cluster.router, cfg.cluster.router_args, seed=cfg.seed)
        self.service_log = ClusterServiceLog()
        self.replicas: list[Replica] = []
        for i, (role, rcfg) in enumerate(replica_configs(cfg)):
            executor = make_executor(rcfg)
            scheduler = build_scheduler(rcfg, executor)
            on_finish = self._prefilled_event if role == "prefill" else self._done
            if role == "prefill" and self.holds_prefill_pages:
                scheduler.hold_finished_pages = True
            loop = make_loop(scheduler, executor, on_step=self.service_log.on_step, on_finish=on_finish)
            self.replicas.append(Replica(i, role, rcfg, scheduler, executor, loop))
        self.front = [r for r in self.replicas if r.role != "decode"]  # where arrivals go
        self.decode = [r for r in self.replicas if r.role == "decode"]
        self.rows: dict[Request, dict[str, Any]] = {}  # request -> its extra requests.jsonl fields
        self.transfers_s: list[float] = []
        self.transferred_bytes = 0
        self._proxies: dict[Request, tuple[Request, RouteRequest, Replica]] = {}  # prefill copy -> request, route, replica
        self._on_finish: Optional[Callable[[Request], None]] = None
        self._stopping = False
        # The error that ended the run early (a replica's executor failed), raised by the
        # caller once the outputs are written; None when the run ended by itself or by `stop`.
        self.failure: Optional[Exception] = None

    # ---- the run ----
    def serve(
        self,
        requests: list[Request],
        *,
        stop: Optional[StopFlag] = None,
        on_finish: Optional[Callable[[Request], None]] = None,
    ) -> RunResult:
        """Serve `requests` (any order), each at its `arrival_s`; every request ends with a fate
        (as `cbjax.engine.offline.serve`, `stop` and sessions included). The result covers the
        whole cluster."""
        pending, followups, self._on_finish = arrivals(requests, on_finish)
        return self._drive(requests, pending, followups, stop)

    def _drive(
        self, requests: list[Request], pending: deque[Request], followups: Optional[Followups], stop: Optional[StopFlag]
    ) -> RunResult:
        """Run the replicas over the `pending` arrivals and the sessions' later turns
        (`followups`, None without sessions) until every request has ended."""
        raise NotImplementedError

    # ---- routing ----
    def _admit(self, req: Request, t: float) -> Replica:
        """Route an arrival and hand it (or, under P/D, its prefill copy) to its replica."""
        router = self.router
        for replica in self.front:
            replica.view_s = t
        hashes = prompt_page_hashes(req, self.cfg.cache.page_size) if router.uses_prefix else ()
        route = RouteRequest(req.request_id, req.prompt_len, hashes, req.client_id, req.priority)
        replica = self.front[self._check(router.route(route, self.front), len(self.front), "route")]
        replica.num_routed += 1
        if req.session_id is not None:  # the other replicas' host tiers wait for this turn no more
            for other in self.replicas:
                if other is not replica and other.scheduler.tier is not None:
                    other.scheduler.tier.turn_not_admitted(req)
        if hashes:
            replica.prefix.insert(hashes)
        if replica.role == "prefill":
            reason = self._undecodable(req)
            if reason is not None:  # rejected on arrival, as a lone replica rejects it
                self.rows[req] = {"prefill_replica": replica.index, "decode_replica": None, "kv_transfer_s": None}
                self._end(req, FinishReason.REJECTED, t, reason)
                return replica
            # one token: the prefill's; the copy shares the prompt's ids
            proxy = dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, max_tokens=1), target_output_len=1
            )
            self._proxies[proxy] = (req, route, replica)
            self.rows[req] = {"prefill_replica": replica.index, "decode_replica": None, "kv_transfer_s": None}
            replica.loop.add(proxy, t)
        else:
            self.rows[req] = {"replica": replica.index, "kv_transfer_s": 0.0}
            replica.loop.add(req, t)
        replica.loop.boundary()  # a rejection is reported at once
        return replica

    def _undecodable(self, req: Request) -> Optional[str]:
        """Why no decode replica could ever hold `req`, judged as its `Scheduler.add` would
        judge it (the first replica's reason), or None. A request that ends at its first token
        never reaches one; one that may generate no token at all (`max_tokens` or
        `target_output_len` below 1) is judged too, as its prefill copy's one-token cap hides
        what a lone replica rejects it for."""
        if req.stop_length() == 1:
            return None
        bound, first = req.max_output_len, None
        try:
            for replica in self.decode:
                req.max_output_len = output_bound(req, replica.scheduler.max_model_len)
                reason = replica.scheduler.rejection_reason(req)
                if reason is None:
                    return None
                first = first or reason
            return first
        finally:
            req.max_output_len = bound  # set for real where it is queued

    def _check(self, index: int, n: int, what: str) -> int:
        if not (isinstance(index, (int, np.integer)) and 0 <= index < n):
            raise ValueError(
                f"cluster.router: {type(self.router).__name__}.{what} returned {index!r}, not a replica in [0, {n})"
            )
        return int(index)

    # ---- prefill/decode handoff ----
    def _prefilled_event(self, proxy: Request) -> None:
        """A prefill copy ended (its replica's `on_finish`); the driver times what follows."""
        raise NotImplementedError

    def _handoff(self, proxy: Request, t: Optional[float]) -> Optional[Handoff]:
        """The prefill copy ended at `t`: the transfer to a decode replica, or None when the
        request ends here (ended by this call)."""
        req, route, src = self._proxies.pop(proxy)
        for key in _FROM_PREFILL:
            setattr(req, key, getattr(proxy, key))
        if proxy.finish_reason not in SERVED:  # rejected, aborted, failed: the request's fate
            self._end(req, proxy.finish_reason, t, proxy.reject_reason, proxy.error)
            return None
        req.output_token_ids = list(proxy.output_token_ids)
        req.num_generated = proxy.num_generated
        req.num_computed = req.prompt_len
        reason = first_token_reason(req, proxy, self.cfg.model.max_model_len)
        if reason is not None or self._stopping:
            self._end(
                req, reason or FinishReason.ABORTED, t, error=None if reason else "run stopped before its KV transfer"
            )
            return None
        dst = self.decode[self._check(self.router.route_decode(route, self.decode), len(self.decode), "route_decode")]
        pages = dst.scheduler.allocator.pages_for(req.num_computed)
        kv_bytes = req.num_computed * self.cfg.model.kv_bytes_per_token
        transfer_s = kv_bytes * 8 / (self.cfg.cluster.kv_link_gbps * 1e9) + self.cfg.cluster.kv_link_latency_s
        dst.num_incoming += 1
        dst.incoming_pages += pages
        self.transferred_bytes += kv_bytes
        return Handoff(req, proxy, src, dst, pages, transfer_s)

    def _record_transfer(self, h: Handoff, transfer_s: float) -> None:
        """The request's row and the cluster's transfer times: `transfer_s` for its K/V."""
        row = self.rows[h.req]
        row["decode_replica"], row["kv_transfer_s"] = h.dst.index, transfer_s
        self.transfers_s.append(transfer_s)

    def _transferred(self, h: Handoff, t: float) -> None:
        """The request's K/V reached its decode replica at `t`: it joins that replica's queue."""
        dst, req = h.dst, h.req
        dst.num_incoming -= 1
        dst.incoming_pages -= h.pages
        dst.num_routed += 1
        self.service_log.transferred(req)
        dst.scheduler.add_transferred(req, t, h.pages)
        dst.loop.boundary()

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

    # ---- results ----
    def _result(self, requests: list[Request], interrupted: bool, wall_s: float, warmup_s: float = 0.0) -> RunResult:
        stats = IterationStats()
        tbt: list[float] = []
        for replica in self.replicas:
            stats.merge(replica.loop.stats)
            tbt.extend(replica.scheduler.tbt_s)
        return RunResult(
            requests=requests,
            stats=stats,
            num_slots=self.cfg.scheduler.max_num_seqs,
            makespan_s=max(r.loop.clock.last_end for r in self.replicas),
            preemptions=sum(r.scheduler.num_preemptions for r in self.replicas),
            wall_s=wall_s,
            warmup_s=warmup_s,
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
        if "prefix_hit_rate_host" in out:  # host tiers: the rates over the cluster's admissions too
            for tier in ("device", "host"):
                out[f"prefix_hit_rate_{tier}"] = out[f"prefix_hit_tokens_{tier}"] / admitted if admitted else 0.0
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
