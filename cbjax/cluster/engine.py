"""The cluster on the real engine: replicas on the wall clock, each on its own devices (no jax
here: the executors hold the devices).

Where the executors run is `cluster.backend`'s choice: each in a child process of its own
(`processes`, `cbjax.cluster.processes`), in Ray actors (`ray`), or all in this process
(`inline`). The router, every replica's scheduler and `EngineLoop`, and this driver stay in
this process, on one thread: each turn it admits the arrivals due by now, then steps every
replica with work once. A pipelined executor (`executor.async_scheduling`) launches its next
step before it reads the previous one's tokens, so while the driver waits on one replica's
tokens the others' steps run on their own devices.

Prefill/decode disaggregation: a prefill replica keeps a finished prefill's pages
(`Scheduler.hold_finished_pages`) until the driver has copied their K/V to host memory
(`export_kv`); the copy is whole whatever the prefill mesh, so it enters the decode replica's
cache (`import_kv`, then the scheduler's swap-in) resharded for that mesh. A request's
`kv_transfer_s` is the measured copy time.

A replica that fails (`ReplicaFailed`: a step raised, its process died) ends the run, as a
dead engine core ends vLLM's: its requests end with fate `error` and the failure as their
error, the other replicas' unfinished ones are aborted, those not arrived end `not_arrived`,
and `failure` holds the one-line error for the caller to raise once the outputs are written.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from cbjax.cluster.core import ClusterBase
from cbjax.cluster.remote import ReplicaFailed
from cbjax.cluster.replica import Replica
from cbjax.config import RunConfig
from cbjax.core.results import RunResult
from cbjax.core.stop import StopFlag
from cbjax.engine.drive import drive
from cbjax.engine.followups import Followups
from cbjax.core.request import FinishReason, Request


class ClusterEngine(ClusterBase):
    """Replicas behind a router on the wall clock; `serve` runs a list of requests."""

    holds_prefill_pages = True

    def __init__(self, cfg: RunConfig, make_executor: Callable[[RunConfig], Any], clock: Callable[[], float] = time.perf_counter):
        """`make_executor(replica_cfg)` gives each replica's engine executor on its own devices,
        in replica order: a proxy of one in a child process (`cbjax.cluster.processes.ProcessReplicas`)
        or a Ray actor (`cbjax.cluster.ray_actors.RayReplicas`), or one built in this process
        (`cbjax.app.run.cluster_executors`, `cluster.backend=inline`)."""
        check_engine_supported(cfg)
        super().__init__(cfg, make_executor)
        self._clock = clock
        self._t0 = clock()

    def now(self) -> float:
        return self._clock() - self._t0

    @property
    def inline(self) -> bool:
        """Every replica in this process (`cluster.backend=inline`): one compile count for all."""
        return self.cfg.cluster.backend == "inline"

    def warmup(self, sampling: bool) -> float:
        """Compile every replica's programs (side by side where each has a process of its
        own); compiles after warmup count from the last one."""
        t0 = time.perf_counter()
        kv_transfer = self.cfg.cluster.disaggregated  # K/V copies out of prefill and into decode replicas

        def warm(replica: Replica) -> None:
            replica.executor.warmup(sampling=sampling, kv_transfer=kv_transfer)

        if self.inline:
            for replica in self.replicas:
                warm(replica)
        else:
            with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
                list(pool.map(warm, self.replicas))
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
            try:
                h.dst.executor.import_kv(h.req.request_id, src.executor.export_kv(pages))
            except ReplicaFailed as err:  # the run stops at the next turn (`_Halt`)
                self.failure = self.failure or err
                src.scheduler.release_held(proxy.request_id)
                h.dst.num_incoming -= 1
                h.dst.incoming_pages -= h.pages
                self._end(h.req, FinishReason.ERROR, self.now(), error=str(err))
                return
            self._record_transfer(h, self._clock() - t0)
        src.scheduler.release_held(proxy.request_id)
        if h is not None:
            self._transferred(h, self.now())

    # ---- the run ----
    def _drive(
        self, requests: list[Request], pending: deque[Request], followups: Optional[Followups], stop: Optional[StopFlag]
    ) -> RunResult:
        """Warm every replica up, then serve the arrivals on the wall clock; a replica's failure
        ends the run (the module docstring)."""
        warmup_s, interrupted = 0.0, False
        try:
            warmup_s = self.warmup(any(r.sampling.temperature > 0 for r in requests))
            self._t0 = self._clock()
            for replica in self.replicas:
                replica.loop.clock.restart(self._t0)
            loops = [replica.loop for replica in self.replicas]
            interrupted = drive(loops, pending, lambda req, t: self._admit(req, t).loop, stop=_Halt(self, stop))
        except ReplicaFailed as err:
            self.failure = self.failure or err
        interrupted = interrupted or self.failure is not None
        self._stopping = True
        unreleased = followups.close() if followups is not None else []
        for replica in self.replicas:
            self._end_replica(replica)
        for req in list(pending) + unreleased:
            self._end(req, FinishReason.NOT_ARRIVED, None)
        for replica in self.replicas:
            try:
                replica.executor.close()
            except ReplicaFailed as err:
                self.failure = self.failure or err
        return self._result(list(requests), interrupted, self.now(), warmup_s)

    def _end_replica(self, replica: Replica) -> None:
        """End what is unfinished on `replica`: aborted (after a failure elsewhere, with it as
        the reason), or, on a failed replica (the one that failed, or one that fails as its
        step in flight lands), fate `error`."""
        if self.failure is None or self.failure.replica != replica.index:
            try:
                replica.loop.abort_all(error=None if self.failure is None else f"run stopped: {self.failure}")
                return
            except ReplicaFailed as err:  # its step in flight did not land
                self.failure = self.failure or err
                failure = err
        else:
            failure = self.failure
        replica.loop.fail_all(str(failure))

    def summary_fields(self, result: RunResult) -> dict[str, Any]:
        """`ClusterBase.summary_fields`; the engine's counters and times over the whole cluster
        (`cluster_metrics`); `replica_failure`, the error that ended the run."""
        out = super().summary_fields(result)
        metrics = [replica.executor.metrics() for replica in self.replicas]
        out.update(cluster_metrics(metrics, [r["iterations"] for r in out["replicas"]], self.inline))
        out["replica_failure"] = None if self.failure is None else str(self.failure)
        return out


# The executor's counters and times (`JaxExecutor.metrics`) a cluster's summary adds up over its
# replicas; the rest (its settings) are the first replica's, as for one replica.
SUMMED_METRICS = (
    "compiled_programs", "warmup_compiles", "warmup_cache_hits", "warmup_programs_loaded", "sampler_calls",
    "mixed_iterations", "context_iterations", "host_pack_s", "device_wait_s", "swap_s", "spec_drafting_steps",
)  # fmt: skip


def cluster_metrics(metrics: list[dict[str, Any]], iterations: list[int], inline: bool) -> dict[str, Any]:
    """The engine metrics of a cluster whose replicas' executors report `metrics` and ran
    `iterations` each: counters and times summed, `bucket_calls` summed per bucket, model-step
    calls per iteration over all iterations. Compiles after warmup and warmup seconds: in one
    process (`inline`) the replicas share one count and warm up one after another; in their own
    processes they count apart and warm up side by side. A figure some replica lacks (a failed
    one's) is None."""
    out: dict[str, Any] = {}
    for key in SUMMED_METRICS:
        values = [m.get(key) for m in metrics]
        out[key] = None if None in values else sum(values)
    counts = [m.get("compiles_after_warmup") for m in metrics]
    out["compiles_after_warmup"] = None if None in counts else (max(counts) if inline else sum(counts))
    warmups = [m.get("warmup_s") for m in metrics]
    out["warmup_s"] = None if None in warmups else (sum(warmups) if inline else max(warmups))
    calls: dict[str, int] = {}
    for m in metrics:
        for bucket, n in (m.get("bucket_calls") or {}).items():
            calls[bucket] = calls.get(bucket, 0) + n
    out["bucket_calls"] = {b: calls[b] for b in sorted(calls, key=int)}
    ratios = [m.get("device_calls_per_iteration") for m in metrics]
    total = sum(iterations)
    out["device_calls_per_iteration"] = (
        None if None in ratios else sum(r * n for r, n in zip(ratios, iterations)) / total if total else 0.0
    )
    return out


class _Halt:
    """The drive loop's stop flag: `stop`'s, or a replica failed between steps (a K/V copy)."""

    def __init__(self, cluster: ClusterEngine, stop: Optional[StopFlag]):
        self.cluster, self.stop = cluster, stop

    def is_set(self) -> bool:
        return self.cluster.failure is not None or (self.stop is not None and self.stop.is_set())


def check_engine_supported(cfg: RunConfig) -> None:
    """What this driver runs: engine replicas on one host's devices, on the wall clock, each
    replica's mesh splitting the model (checked here, before any replica starts, naming the
    key that set its size: a pool's `cluster.*_tensor` under P/D)."""
    if cfg.executor.name != "jax":
        raise ValueError(f"executor.name={cfg.executor.name}: ClusterEngine runs the engine; use executor=jax")
    if cfg.distributed.enabled:
        raise ValueError("distributed.num_processes: an engine cluster runs replicas on one host's devices; set it to 1")
    c = cfg.cluster
    sizes = [("executor.mesh.tensor", cfg.executor.mesh.tensor)]
    if c.disaggregated:
        pools = (("prefill", c.prefill_tensor), ("decode", c.decode_tensor))
        sizes = [(f"cluster.{pool}_tensor", t) if t is not None else sizes[0] for pool, t in pools]
    for key, tensor in sizes:
        field = cfg.model.unsplit_by(tensor)
        if field is not None:
            raise ValueError(f"{key}={tensor}: model.{field}={getattr(cfg.model, field)} is not divisible by it")
