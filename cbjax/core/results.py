"""What a run returns: every request with its fate, the loop's running sums, and load snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from cbjax.core.request import Request


@dataclass
class IterationStats:
    """Running sums and peaks over iterations; per-iteration lists would cost memory on long
    traces. The fields are grouped by how `merge` combines two loops' stats."""

    # sums over iterations
    iterations: int = 0
    occupied_slot_iterations: int = 0
    batched_tokens: int = 0
    pages_used_sum: int = 0
    kv_util_sum: float = 0.0
    # per-iteration shares of the KV pool (Scheduler.kv_breakdown), summed: token states,
    # reserved, internal fragmentation, external fragmentation, free
    kv_share_sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    # seconds summed over iterations: the steps' busy time, and the host wall time of the
    # scheduler's two calls
    busy_s: float = 0.0
    schedule_s: float = 0.0
    postprocess_s: float = 0.0
    # peaks over iterations
    pages_used_peak: int = 0
    batch_peak: int = 0
    # iteration index at which each finished request ended (1-based), for "done in N iterations"
    finish_iteration: dict[str, int] = field(default_factory=dict)

    def merge(self, other: IterationStats) -> None:
        """Add another loop's stats to these (a cluster's replicas): sums add up (the KV shares
        part by part), peaks take the larger, finish iterations join."""
        for key in ("iterations", "occupied_slot_iterations", "batched_tokens", "pages_used_sum", "kv_util_sum",
                    "busy_s", "schedule_s", "postprocess_s"):  # fmt: skip
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.kv_share_sums = [a + b for a, b in zip(self.kv_share_sums, other.kv_share_sums)]
        self.pages_used_peak = max(self.pages_used_peak, other.pages_used_peak)
        self.batch_peak = max(self.batch_peak, other.batch_peak)
        self.finish_iteration.update(other.finish_iteration)


class LoadCounts(NamedTuple):
    """The scheduler's load at one moment: for gauges and admission bounds."""

    running: int  # requests holding a slot
    waiting: int  # requests waiting for one (preempted ones included)
    pages_used: int  # KV pages held (the null page excluded)
    pages_total: int  # usable KV pages
    preemptions: int  # since start
    # the host KV tier (cache.host_pages; all 0 without one): host pages it holds, of how many;
    # prompt tokens admissions found there; pages copied to it and back, since start
    host_pages_used: int = 0
    host_pages_total: int = 0
    host_hit_tokens: int = 0
    host_pages_stored: int = 0
    host_pages_loaded: int = 0


@dataclass
class RunResult:
    requests: list[Request]
    stats: IterationStats
    num_slots: int
    makespan_s: float
    preemptions: int
    wall_s: float
    warmup_s: float = 0.0
    extra: dict = field(default_factory=dict)
    tbt_s: list[float] = field(default_factory=list)  # gaps between consecutive tokens of a request
    interrupted: bool = False  # stopped early by `stop`: unfinished requests were aborted
