"""The serving loop: arrivals in, `schedule` → `execute` → `postprocess` each iteration, until done."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from cbjax.executor import Executor
from cbjax.outputs import StopFlag
from cbjax.request import Request
from cbjax.plan import Schedule
from cbjax.scheduler.core import Scheduler


@dataclass
class IterationStats:
    """Running sums over iterations; per-iteration lists would cost memory on long traces."""

    iterations: int = 0
    busy_s: float = 0.0
    occupied_slot_iterations: int = 0
    batched_tokens: int = 0
    pages_used_sum: int = 0
    pages_used_peak: int = 0
    kv_util_sum: float = 0.0
    # per-iteration shares of the KV pool (Scheduler.kv_breakdown), summed: token states,
    # reserved, internal fragmentation, external fragmentation, free
    kv_share_sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    batch_peak: int = 0
    # host wall time of the scheduler's two calls, summed over iterations
    schedule_s: float = 0.0
    postprocess_s: float = 0.0
    # iteration index at which each finished request ended (1-based), for "done in N iterations"
    finish_iteration: dict[str, int] = field(default_factory=dict)


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


def serve(
    requests: list[Request],
    scheduler: Scheduler,
    executor: Executor,
    *,
    progress: bool = False,
    max_iterations: Optional[int] = None,
    on_step: Optional[Callable[[Schedule, float, int], None]] = None,
    stop: Optional[StopFlag] = None,
    on_finish: Optional[Callable[[Request], None]] = None,
    tick: Optional[Callable[[], None]] = None,
) -> RunResult:
    """Serve `requests` (any order) to completion; every request ends with a finish reason.

    `on_step(plan, end_s, num_batched_tokens)` runs after each iteration's postprocess.
    `stop` is checked at each iteration boundary (and while idle): once set, the loop ends
    and everything unfinished is aborted. `on_finish` sees each request once, as it ends
    (rejections included); `tick` is called every loop turn (e.g. to flush a log).

    With a pipelined executor (`executor.async_scheduling`) the loop launches step t+1 before
    it reads step t's tokens: `Scheduler.advance` at launch, `Scheduler.commit` when the
    tokens come, and the host's scheduling and packing run while the device computes."""
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    stats = IterationStats()
    bar = _progress_bar(len(requests)) if progress else None
    alloc = scheduler.allocator
    pool_slots = alloc.num_usable_pages * alloc.page_size
    finish_iteration = stats.finish_iteration
    virtual = executor.virtual_clock
    # Pipelined (executor.async_scheduling): step t+1 is scheduled, packed and launched before
    # step t's tokens are read; `inflight` is step t: (plan, launched step, its iteration).
    pipelined = bool(getattr(executor, "pipelined", False)) and not virtual
    inflight = None
    wall0 = time.perf_counter()
    t0 = wall0
    now = 0.0
    last_end = 0.0
    num_done_reported = 0
    num_seen = 0  # scheduler.finished[:num_seen] went to on_finish
    interrupted = False

    def record(plan: Schedule) -> int:
        """The iteration's counters, as the plan leaves the scheduler; returns its batched tokens."""
        batched = plan.num_batched_tokens  # before postprocess clears the requests' num_new_tokens
        stats.iterations += 1
        stats.occupied_slot_iterations += plan.num_scheduled
        stats.batched_tokens += batched
        used = alloc.num_used_pages
        stats.pages_used_sum += used
        if used > stats.pages_used_peak:
            stats.pages_used_peak = used
        stats.kv_util_sum += alloc.token_utilization()
        sums = stats.kv_share_sums
        for i, slots in enumerate(scheduler.kv_breakdown()):
            sums[i] += slots / pool_slots
        if plan.num_scheduled > stats.batch_peak:
            stats.batch_peak = plan.num_scheduled
        return batched

    def finished(plan: Schedule, batched: int, done: list[Request], iteration: int, end: float) -> None:
        nonlocal num_done_reported
        for req in done:
            finish_iteration[req.request_id] = iteration
        if on_step is not None:
            on_step(plan, end, batched)
        if bar is not None and len(scheduler.finished) != num_done_reported:
            bar.update(len(scheduler.finished) - num_done_reported)
            num_done_reported = len(scheduler.finished)

    def land() -> None:
        """Pipelined: read the step in flight's tokens and commit them."""
        nonlocal inflight, now, last_end
        plan, launched, batched, iteration = inflight
        inflight = None
        out = executor.collect(launched)
        now = time.perf_counter() - t0
        # the step's share of the wall clock: from its launch, or from the last step's end
        stats.busy_s += now - max(launched.start - t0, last_end)
        last_end = now
        t_post = time.perf_counter()
        done = scheduler.commit(plan, out.token_ids, now, out.errors)
        stats.postprocess_s += time.perf_counter() - t_post
        finished(plan, batched, done, iteration, now)

    while True:
        if on_finish is not None and len(scheduler.finished) > num_seen:
            for req in scheduler.finished[num_seen:]:
                on_finish(req)
            num_seen = len(scheduler.finished)
        if tick is not None:
            tick()
        if stop is not None and stop.is_set():
            interrupted = True
            break
        if not virtual:
            now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            scheduler.add(pending.popleft(), now)
        if inflight is not None and (not scheduler.has_work() or scheduler.needs_sync()):
            land()  # nothing to overlap with, or the next plan may preempt: tokens first
            continue
        if not scheduler.has_work():
            if not pending:
                break
            # Idle: jump (or wait) to the next arrival.
            if virtual:
                now = pending[0].arrival_s
            else:
                # short naps, so a stop request or a due flush is not kept waiting
                time.sleep(min(0.1, max(0.0, pending[0].arrival_s - (time.perf_counter() - t0))))
            continue
        if max_iterations is not None and stats.iterations >= max_iterations:
            break
        t_sched = time.perf_counter()
        plan = scheduler.schedule(now)
        t_exec = time.perf_counter()
        stats.schedule_s += t_exec - t_sched
        if plan.num_scheduled == 0 and inflight is not None:
            land()  # the step in flight may end requests whose pages or slots the plan needs
            continue
        if plan.num_scheduled == 0:
            raise RuntimeError(
                f"scheduler made no progress at t={now:.3f}s with {len(scheduler.policy)} waiting and "
                f"{len(scheduler.running)} running; this is a bug"
            )
        batched = record(plan)
        if pipelined:
            launched = executor.launch(plan)
            if inflight is not None:
                land()
            t_post = time.perf_counter()
            scheduler.advance(plan, time.perf_counter() - t0)
            stats.postprocess_s += time.perf_counter() - t_post
            inflight = (plan, launched, batched, stats.iterations)
            continue
        out = executor.execute(plan)
        if virtual:
            now += out.duration_s
        else:
            now = time.perf_counter() - t0
        last_end = now
        stats.busy_s += out.duration_s
        t_post = time.perf_counter()
        done = scheduler.postprocess(plan, out.token_ids, now, out.errors)
        stats.postprocess_s += time.perf_counter() - t_post
        finished(plan, batched, done, stats.iterations, now)
    if inflight is not None:  # stopped (or capped) with a step in flight: its tokens count
        land()
    if pending or scheduler.has_work():
        for req in pending:
            scheduler.add(req, now)
        scheduler.abort_all(now)
    if on_finish is not None:
        for req in scheduler.finished[num_seen:]:
            on_finish(req)
    if bar is not None:
        bar.update(len(scheduler.finished) - num_done_reported)
        bar.close()
    return RunResult(
        requests=list(requests),
        stats=stats,
        num_slots=scheduler.max_num_seqs,
        makespan_s=last_end,
        preemptions=scheduler.num_preemptions,
        wall_s=time.perf_counter() - wall0,
        extra=scheduler.cache_stats(),
        tbt_s=scheduler.tbt_s,
        interrupted=interrupted,
    )


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="serving", mininterval=0.5, leave=False)
