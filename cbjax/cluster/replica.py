"""One replica of a cluster: today's scheduler, executor and `EngineLoop`, unchanged, with the
router's record of what was sent to it; it is also the router's live, read-only view of
itself (`cbjax.cluster.router.ReplicaState`)."""

from __future__ import annotations

from typing import Any, Sequence

from cbjax.cluster.prefix_index import PrefixIndex
from cbjax.config import RunConfig
from cbjax.engine.loop import EngineLoop
from cbjax.engine.stretch import pages_ahead
from cbjax.scheduler.core import Scheduler


class Replica:
    """A scheduler, an executor and their loop, plus what the cluster driver tracks about it."""

    def __init__(self, index: int, role: str, cfg: RunConfig, scheduler: Scheduler, executor: Any, loop: EngineLoop):
        self.index = index
        self.role = role  # colocated | prefill | decode
        self.cfg = cfg
        self.scheduler = scheduler
        self.executor = executor
        self.loop = loop
        # The router's approximate record of this replica's cache: prompts routed here, as
        # many pages as the replica's pool holds, and its host tier's.
        self.prefix = PrefixIndex(scheduler.allocator.num_usable_pages, cfg.cache.host_pages)
        self.num_routed = 0  # requests routed (or, decode replicas, transferred) here
        # requests whose K/V is on its way here, and their pages: counted as waiting and held
        self.num_incoming = 0
        self.incoming_pages = 0
        # when the router looks: pages the loop's steps priced ahead take by then count as taken
        self.view_s = 0.0

    # ---- ReplicaState, read by routers ----
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.policy) + self.num_incoming

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_pages(self) -> int:
        ahead = pages_ahead(self.loop, self.view_s)
        return max(0, self.scheduler.allocator.num_free_pages - ahead - self.incoming_pages)

    @property
    def num_usable_pages(self) -> int:
        return self.scheduler.allocator.num_usable_pages

    @property
    def num_indexed_pages(self) -> int:
        return len(self.prefix)

    def cached_pages(self, page_hashes: Sequence[int]) -> int:
        return self.prefix.match(page_hashes)

    def cached_pages_by_tier(self, page_hashes: Sequence[int]) -> tuple[int, int]:
        return self.prefix.match_tiers(page_hashes)

    # ---- summary.json ----
    def summary(self, makespan_s: float) -> dict[str, Any]:
        """This replica's entry of summary.json's `replicas` list."""
        stats, sched = self.loop.stats, self.scheduler
        iters = stats.iterations
        prefix = sched.prefix
        return {
            "replica": self.index,
            "role": self.role,
            "hardware": self.cfg.hardware.name,
            # the engine's mesh; the simulator's roofline TP size
            "tensor": self.cfg.executor.mesh.tensor if self.cfg.executor.name == "jax" else self.cfg.hardware.num_devices,
            "num_pages": self.cfg.cache.num_pages,
            "requests": self.num_routed,
            "iterations": iters,
            "utilization": stats.busy_s / makespan_s if makespan_s > 0 else 0.0,
            "mean_batch_size": stats.occupied_slot_iterations / iters if iters else 0.0,
            "peak_batch_size": stats.batch_peak,
            "kv_pages_used_peak": stats.pages_used_peak,
            "preemptions": sched.num_preemptions,
            "prefix_cache_hit_rate": prefix.hit_rate if prefix is not None else 0.0,
        }
