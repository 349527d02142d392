"""The cluster on the real engine: replicas in one process, each on its own devices, on the
wall clock (no jax here: the executors hold the devices).

One driver thread runs the router and every replica's `EngineLoop`: each turn it admits the
arrivals due by now, then steps every replica with work once. A pipelined executor
(`executor.async_scheduling`) launches its next step before it reads the previous one's
tokens, so while the driver waits on one replica's tokens the others' steps run on their own
devices (jax dispatches asynchronously).

Prefill/decode disaggregation: a prefill replica keeps a finished prefill's pages
(`Scheduler.hold_finished_pages`) until the driver has copied their K/V to host memory
(`JaxExecutor.export_kv`); the copy is whole whatever the prefill mesh, so it enters the
decode replica's cache (`import_kv`, then the scheduler's swap-in) resharded for that mesh.
A request's `kv_transfer_s` is the measured copy time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional

from cbjax.cluster.core import ClusterBase
from cbjax.config import RunConfig
from cbjax.core.results import RunResult
from cbjax.core.stop import StopFlag
from cbjax.engine.drive import drive
from cbjax.core.request import FinishReason, Request


class ClusterEngine(ClusterBase):
    """Replicas behind a router on the wall clock; `serve` runs a list of requests."""

    holds_prefill_pages = True

    def __init__(self, cfg: RunConfig, make_executor: Callable[[RunConfig], Any], clock: Callable[[], float] = time.perf_counter):
        """`make_executor(replica_cfg)` builds each replica's engine executor on its own devices,
        in replica order (`cbjax.app.run.cluster_executors`)."""
        check_engine_supported(cfg)
        super().__init__(cfg, make_executor)
        self._clock = clock
        self._t0 = clock()

    def now(self) -> float:
        return self._clock() - self._t0

    def warmup(self, sampling: bool) -> float:
        """Compile every replica's programs; compiles after warmup count from the last one."""
        t0 = time.perf_counter()
        kv_transfer = self.cfg.cluster.disaggregated  # K/V copies out of prefill and into decode replicas
        for replica in self.replicas:
            replica.executor.warmup(sampling=sampling, kv_transfer=kv_transfer)
        for replica in self.replicas:
            replica.executor.restart_compile_count()
        return time.perf_counter() - t0

    # ---- prefill/decode ----
    def _prefilled_event(self, proxy: Request) -> None:
        """A prefill copy ended on its replica: copy its K/V to the decode replica now."""
        src = self._proxies[proxy][2]
        t = proxy.finish_s if proxy.finish_s is not None else self.now()
        h = self._handoff(proxy, t)
        if h is not None:
            t0 = self._clock()
            pages = src.scheduler.held_pages(proxy.request_id)[: h.pages]
            h.dst.executor.import_kv(h.req.request_id, src.executor.export_kv(pages))
            self._record_transfer(h, self._clock() - t0)
        src.scheduler.release_held(proxy.request_id)
        if h is not None:
            self._transferred(h, self.now())

    # ---- the run ----
    def serve(
        self,
        requests: list[Request],
        *,
        stop: Optional[StopFlag] = None,
        on_finish: Optional[Callable[[Request], None]] = None,
    ) -> RunResult:
        """Warm every replica up, then serve `requests` (any order), each at its `arrival_s` on
        the wall clock; every request ends with a fate (as `cbjax.engine.offline.serve`)."""
        self._on_finish = on_finish
        warmup_s = self.warmup(any(r.sampling.temperature > 0 for r in requests))
        self._t0 = self._clock()
        for replica in self.replicas:
            replica.loop.clock.restart(self._t0)
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        loops = [replica.loop for replica in self.replicas]
        interrupted = drive(loops, pending, lambda req, t: self._admit(req, t).loop, stop=stop)
        self._stopping = True
        for replica in self.replicas:
            replica.loop.abort_all()
        for req in pending:
            self._end(req, FinishReason.NOT_ARRIVED, None)
        for replica in self.replicas:
            replica.executor.close()
        return self._result(list(requests), interrupted, self.now(), warmup_s)


    def summary_fields(self, result: RunResult) -> dict[str, Any]:
        """`ClusterBase.summary_fields`, and compiles after warmup over the whole cluster:
        replicas in this process share one count, a remote replica (a Ray actor) has its own."""
        out = super().summary_fields(result)
        local, remote = [], []
        for replica in self.replicas:
            count = replica.executor.metrics()["compiles_after_warmup"]
            (remote if getattr(replica.executor, "remote", False) else local).append(count)
        out["compiles_after_warmup"] = max(local, default=0) + sum(remote)
        return out


def check_engine_supported(cfg: RunConfig) -> None:
    """What this driver runs: engine replicas on the wall clock, in one process."""
    if cfg.executor.name != "jax":
        raise ValueError(f"executor.name={cfg.executor.name}: ClusterEngine runs the engine; use executor=jax")
    if cfg.distributed.enabled:
        raise ValueError("distributed.num_processes: an engine cluster runs replicas on one host's devices; set it to 1")
