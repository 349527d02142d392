"""The serving loop as a class: arrivals in, `schedule` -> `execute` -> `postprocess` each iteration.

`EngineLoop` owns one scheduler and one executor and runs one iteration per `step`. Offline
runs (`serve`) feed it a list of requests at their arrival times; the online server
(`cbjax.serve`) drives `run` on its own thread and feeds it with `submit` and `cancel`, both
thread-safe. Three clocks:

- virtual (a simulated executor, `pace="none"`): time advances by each step's predicted
  duration and jumps over idle gaps;
- realtime-paced (a simulated executor, `pace="realtime"`): the virtual clock follows the wall
  clock; each step's tokens are released at the step's simulated end, the loop sleeping until
  then, so an endpoint answers with the cost model's latencies;
- wall (the real engine): time is read from the wall clock.

With a pipelined executor (`executor.pipelined`) a step launches before the previous one's
tokens are read: `Scheduler.advance` at launch, `Scheduler.commit` when the tokens come.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from cbjax.core.executor import Executor
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import FinishReason, Request
from cbjax.core.results import IterationStats, LoadCounts, RunResult
from cbjax.scheduler.core import Scheduler

PACES = ("none", "realtime")
# A paced loop within this much of its virtual clock counts as keeping up: steps chain on the
# virtual clock (start = the previous step's end) rather than on the wall clock, so sleep
# overshoot does not accumulate. Beyond it, time slips to the wall clock: an honest delay.
PACE_SLACK_S = 0.005
IDLE_WAIT_S = 0.05  # an idle `run` looks at its stop flag at least this often
_perf_counter = time.perf_counter


class EngineLoop:
    """One scheduler and one executor; one iteration per `step`.

    Callbacks run on the loop's thread:
    - `on_step(plan, end_s, num_batched_tokens, requests)`: after each iteration's postprocess,
      with the plan's requests in plan order;
    - `on_token(request, token_id, now)`: each token as it is committed (`token_id` None when
      the executor simulates tokens);
    - `on_finish(request)`: each request once, as it ends (rejections and aborts included);
    - `tick()`: every loop turn (e.g. to flush a log), and as soon as a step's tokens went to
      `on_token`: a hand-off of tokens waits for no more of the loop's own work (the next
      boundary's intake, a pipelined step's `advance`).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        pace: str = "none",
        on_step: Optional[Callable[[Schedule, float, int, list[Request]], None]] = None,
        on_token: Optional[Callable[[Request, Optional[int], float], None]] = None,
        on_finish: Optional[Callable[[Request], None]] = None,
        tick: Optional[Callable[[], None]] = None,
        progress: bool = False,
        total: Optional[int] = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if pace not in PACES:
            raise ValueError(f"executor.pace: unknown value {pace!r}; choose one of {', '.join(PACES)}")
        self.scheduler = scheduler
        self.executor = executor
        self.virtual = executor.virtual_clock and pace == "none"
        self.paced = executor.virtual_clock and pace == "realtime"
        # a virtual clock runs a pipelined executor's steps back to back on it (`_launch_virtual`);
        # a paced one runs each step to completion
        self.pipelined = executor.pipelined and (self.virtual or not executor.virtual_clock)
        scheduler.plan_token_ids = executor.reads_token_ids
        self.on_step, self.on_token, self.on_finish, self.tick = on_step, on_token, on_finish, tick
        self.stats = IterationStats()
        self.requests: list[Request] = []  # every request that entered, in order of entry
        self._bar = _progress_bar(total) if progress else None
        self._num_done_reported = 0
        self._num_seen = 0  # scheduler.finished[:_num_seen] went to on_finish
        alloc = scheduler.allocator
        self._pool_slots = alloc.num_usable_pages * alloc.page_size
        self._inflight = None  # pipelined: (plan, launched step, batched tokens, iteration, requests)
        self._emitted: dict[Request, int] = {}  # on_token: tokens reported so far per request
        self._inbox: deque[Request] = deque()  # submit -> next boundary (deque ops are atomic)
        # requests received by the server and not yet submitted (being read and parsed): their
        # arrival stamps, by a key the server holds (dict ops are atomic)
        self._receiving: dict[object, float] = {}
        self._cancels: deque[tuple[str, str, FinishReason]] = deque()
        self._wake = threading.Event()
        self._admission_open = True
        # the wall clock and its sleep (a test may pass a fake pair); a pipelined executor's
        # `Launched.start` is on time.perf_counter, the default
        self._clock, self._sleep = clock, sleep
        self._wall0 = clock()
        self._t0 = self._wall0
        self._now = 0.0  # virtual and paced clocks: the current time
        self.last_end = 0.0  # end of the latest iteration
        self._virtual_end = 0.0  # virtual clock, pipelined: where the latest launched step ends

    # ---- the clock ----
    def now(self) -> float:
        """Seconds since the loop started, on its clock."""
        if self.virtual:
            return self._now
        wall = self._clock() - self._t0
        if self.paced and wall - self._now < PACE_SLACK_S:
            return self._now  # keeping up: the next step starts where the last one ended
        return wall

    def stamp(self) -> float:
        """The arrival time of a request reaching the loop now: the wall clock (the virtual one
        when it is not paced). A paced loop's `now` may trail the wall clock by up to
        PACE_SLACK_S; an arrival is still stamped when it happened, and waits for the first
        boundary at or after it, as offline."""
        if self.virtual:
            return self._now
        return self._clock() - self._t0

    def receive(self, key: object) -> float:
        """A request reaching the server now, to be submitted once read and parsed: returns its
        arrival stamp. Until `received(key)`, a paced boundary at or after the stamp waits for
        its submission (within PACE_SLACK_S), so the time spent parsing does not push it to the
        next boundary."""
        stamp = self.stamp()
        self._receiving[key] = stamp
        return stamp

    def received(self, key: object) -> None:
        """The request `key` was submitted, or will never be (refused, or not a generation)."""
        self._receiving.pop(key, None)

    def counts(self) -> LoadCounts:
        """The scheduler's load now (from another thread: a racy read of list lengths and
        counters, which may see an iteration half done but never a torn number)."""
        sched = self.scheduler
        alloc = sched.allocator
        return LoadCounts(len(sched.running), len(sched.policy), alloc.num_used_pages, alloc.num_usable_pages,
                          sched.num_preemptions)  # fmt: skip

    def advance_to(self, t: float) -> None:
        """A virtual clock idle until `t` jumps there (never backwards)."""
        if self._now < t:
            self._now = t

    def inflight_end(self) -> Optional[float]:
        """A virtual pipelined loop: where its step in flight ends on its clock; None when no
        step is in flight (or the clock is not virtual)."""
        if not self.virtual or self._inflight is None:
            return None
        return self._inflight[1].end

    def delay_inflight(self, end: float) -> None:
        """A virtual pipelined loop: its step in flight ends at `end` instead, when that is later
        (a cluster driver whose replicas share one host: `cbjax.cluster.host`)."""
        launched = self._inflight[1]
        if end > launched.end:
            launched.end = end
            self._virtual_end = max(self._virtual_end, end)

    def restart_clock(self, t0: Optional[float] = None) -> None:
        """Start the clock at 0 now, or at `t0` on its clock (several loops sharing one
        origin); after warmup, before the first arrival."""
        self._wall0 = self._t0 = self._clock() if t0 is None else t0
        self._now = 0.0

    # ---- intake (thread-safe) ----
    def submit(self, req: Request, arrival_s: Optional[float] = None) -> None:
        """A request arriving now (or at `arrival_s`, an earlier `stamp`: when the server
        received it); it enters the scheduler at the first iteration boundary at or after its
        arrival, and wakes an idle loop at once."""
        req.arrival_s = self.stamp() if arrival_s is None else arrival_s
        self._inbox.append(req)
        self._wake.set()

    def cancel(
        self, request_id: str, reason: str = "client disconnected", finish_reason: FinishReason = FinishReason.ABORTED
    ) -> None:
        """End a request at the next boundary (`aborted` by default; `stop` for a stop string
        found by the server): its slot and pages are free before the next plan."""
        self._cancels.append((request_id, reason, finish_reason))
        self._wake.set()

    def close_admission(self) -> None:
        """Later submissions are rejected (a draining server)."""
        self._admission_open = False
        self._wake.set()

    def add(self, req: Request, now: Optional[float] = None) -> None:
        """Hand an arrived request to the scheduler (on the loop's thread)."""
        now = self.now() if now is None else now
        self.requests.append(req)
        if not self._admission_open:
            self.scheduler.reject(req, "server is shutting down", now)
            return
        self.scheduler.add(req, now)

    def boundary(self) -> None:
        """Between iterations: report finished requests, take submissions and cancellations."""
        sched = self.scheduler
        self._admit()
        while self._cancels:
            request_id, reason, finish_reason = self._cancels.popleft()
            if self._inflight is not None:
                self._land()  # the step in flight holds the request's slot
            sched.abort(request_id, self.now(), reason, finish_reason)
        self._report_finished()
        if self.tick is not None:
            self.tick()

    def _admit(self) -> None:
        """Hand the inbox to the scheduler. Paced, the loop's clock may trail the wall clock
        (PACE_SLACK_S): a request that arrived after the boundary's time waits for the next
        boundary, as it would offline; an idle loop first moves its clock to the arrival; a
        request received by the boundary's time but still being parsed is waited for."""
        inbox = self._inbox
        if self.paced and self._receiving and self.has_work():
            self._await_received(self.now())
        if not inbox:
            return
        if not self.paced:
            while inbox:
                self.add(inbox.popleft())
            return
        if not self.has_work():
            # idle: the next step starts at the earliest arrival, as offline; or at the wall
            # clock if the loop comes to it more than PACE_SLACK_S late
            self.advance_to(min(r.arrival_s for r in inbox))
        now = self.now()
        # stamps taken at receipt need not come in submission order: look at every one
        due, later = [], []
        for _ in range(len(inbox)):
            req = inbox.popleft()
            (due if req.arrival_s <= now else later).append(req)
        inbox.extendleft(reversed(later))
        for req in sorted(due, key=lambda r: r.arrival_s):
            self.add(req, now)

    def _await_received(self, now: float) -> None:
        """Wait for the requests received by `now` to be submitted, for at most half of
        PACE_SLACK_S past `now` (the other half is the step's own host time)."""
        until = now + PACE_SLACK_S / 2
        while any(stamp <= now for stamp in list(self._receiving.values())):
            left = until - self.stamp()
            if left <= 0:
                return
            self._sleep(min(left, 0.0002))

    def _report_finished(self) -> None:
        sched = self.scheduler
        if len(sched.finished) > self._num_seen:
            for req in sched.finished[self._num_seen :]:
                self._emitted.pop(req, None)
                if self.on_finish is not None:
                    self.on_finish(req)
            self._num_seen = len(sched.finished)

    # ---- iterations ----
    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def step(self) -> bool:
        """Run one iteration (or land the step in flight); False when there is nothing to do."""
        sched = self.scheduler
        if self._inflight is not None and (not sched.has_work() or sched.needs_sync()):
            self._land()  # nothing to overlap with, or the next plan may preempt: tokens first
            return True
        if not sched.has_work():
            return False
        virtual, stats = self.virtual, self.stats
        start = self._now if virtual else self.now()
        t_sched = _perf_counter()
        plan = sched.schedule(start)
        stats.schedule_s += _perf_counter() - t_sched
        if not plan.scheduled:
            if self._inflight is not None:
                self._land()  # the step in flight may end requests whose pages or slots the plan needs
                return True
            raise RuntimeError(
                f"scheduler made no progress at t={start:.3f}s with {len(sched.policy)} waiting and "
                f"{len(sched.running)} running; this is a bug"
            )
        requests = sched.requests_of(plan)
        batched = self._record(plan)
        if self.pipelined:
            launched = self._launch_virtual(plan, start) if self.virtual else self.executor.launch(plan)
            if self._inflight is not None:
                self._land(covered=True)
            t_post = time.perf_counter()
            sched.advance(plan, self.now() if virtual else self._clock() - self._t0)
            stats.postprocess_s += time.perf_counter() - t_post
            self._inflight = (plan, launched, batched, stats.iterations, requests)
            return True
        out = self.executor.execute(plan)
        duration = out.duration_s
        if virtual:
            self._now += duration
            end = self._now
        elif self.paced:
            end = start + duration
            delay = end - (self._clock() - self._t0)
            if delay > 0:
                self._sleep(delay)
            self._now = end
        else:
            end = self._clock() - self._t0
        self.last_end = end
        stats.busy_s += duration
        t_post = _perf_counter()
        done = sched.postprocess(plan, out.token_ids, end, out.errors)
        stats.postprocess_s += _perf_counter() - t_post
        self._finished(plan, batched, done, stats.iterations, end, requests)
        return True

    def _record(self, plan: Schedule) -> int:
        """The iteration's counters, as the plan leaves the scheduler; returns its batched tokens."""
        stats, sched = self.stats, self.scheduler
        alloc = sched.allocator
        scheduled = plan.scheduled
        batched = 0
        for s in scheduled:  # plan.num_batched_tokens, without its list
            batched += s.num_new_tokens
        num_scheduled = len(scheduled)
        stats.iterations += 1
        stats.occupied_slot_iterations += num_scheduled
        stats.batched_tokens += batched
        used = alloc.num_used_pages
        stats.pages_used_sum += used
        if used > stats.pages_used_peak:
            stats.pages_used_peak = used
        stats.kv_util_sum += alloc.token_utilization(used)
        sums, pool = stats.kv_share_sums, self._pool_slots
        token, reserved, internal, external, free = sched.kv_breakdown()
        sums[0] += token / pool
        sums[1] += reserved / pool
        sums[2] += internal / pool
        sums[3] += external / pool
        sums[4] += free / pool
        if num_scheduled > stats.batch_peak:
            stats.batch_peak = num_scheduled
        return batched

    def _finished(self, plan, batched, done, iteration, end, requests) -> None:
        if done:
            finish_iteration = self.stats.finish_iteration
            for req in done:
                finish_iteration[req.request_id] = iteration
        if self.on_token is not None and self._emit_tokens(requests, end) and self.tick is not None:
            self.tick()
        if self.on_step is not None:
            self.on_step(plan, end, batched, requests)
        bar = self._bar
        if bar is not None:
            finished = len(self.scheduler.finished)
            if finished != self._num_done_reported:
                bar.update(finished - self._num_done_reported)
                self._num_done_reported = finished

    def _emit_tokens(self, requests: list[Request], now: float) -> bool:
        """Report the requests' new tokens; True if there were any."""
        real = not self.executor.virtual_clock
        emitted = self._emitted
        any_new = False
        for req in requests:
            have = len(req.output_token_ids) if real else req.num_generated
            sent = emitted.get(req, 0)
            if have > sent:
                for k in range(sent, have):
                    self.on_token(req, req.output_token_ids[k] if real else None, now)
                emitted[req] = have
                any_new = True
        return any_new

    def _launch_virtual(self, plan: Schedule, start: float) -> "_VirtualLaunch":
        """A pipelined executor on a virtual clock: the step runs from its launch (`start`, when
        the loop planned it) or the end of the step launched before it, whichever is later, for
        its `duration_s`, as the engine's device queue runs launched steps one after another.
        The loop lands the previous step (its clock moves to that step's end) and plans the next
        one while this one runs: a request arriving during step t is planned after t ends, into
        step t + 2, as on the pipelined engine.

        The loop collects the step in flight only after this launch: from `start` (where it
        collected the one before) it commits, plans and launches for `launch_s` of host time
        (`StepOutput.launch_s`), so the step in flight ends no earlier than that. The longer of
        the two sets its end, as on the engine, where a small step is over before the host is
        and a prefill's packing outlasts a decode step. Either way this step's device work
        starts no earlier than its launch returns: with nothing in flight (the first step, or
        the first after an idle loop) nothing hides that host time, and the step begins after it."""
        out = self.executor.execute(plan)
        if out.launch_s and self._inflight is not None:
            prev = self._inflight[1]
            prev.end = max(prev.end, start + out.launch_s)
            self._virtual_end = max(self._virtual_end, prev.end)
        begin = max(start + out.launch_s, self._virtual_end)
        self._virtual_end = begin + out.duration_s
        return _VirtualLaunch(out, begin, self._virtual_end)

    def _land(self, covered: bool = False) -> None:
        """Pipelined: read the step in flight's tokens and commit them. `covered`: the next step
        was launched first. On a virtual clock a step collected with nothing launched behind it
        ends at its `StepOutput.drain_s` share: its duration holds the next launch's host time
        it would hide (a tiny model's decode is over long before the host is), and on the engine
        the loop instead collects it as soon as its device work is done."""
        plan, launched, batched, iteration, requests = self._inflight
        self._inflight = None
        if self.virtual:
            out = launched.out
            if not covered and out.drain_s is not None:
                launched.end = min(launched.end, launched.begin + out.drain_s)
                self._virtual_end = launched.end  # nothing was launched after it
            self._now = now = max(self._now, launched.end)
            self.stats.busy_s += launched.end - launched.begin
            self.last_end = now
            self._commit(plan, out, now, batched, iteration, requests)
            return
        out = self.executor.collect(launched)
        now = self._clock() - self._t0
        # the step's share of the wall clock: from its launch, or from the last step's end
        self.stats.busy_s += now - max(launched.start - self._t0, self.last_end)
        self.last_end = now
        self._commit(plan, out, now, batched, iteration, requests)

    def _commit(self, plan, out, now, batched, iteration, requests) -> None:
        t_post = time.perf_counter()
        done = self.scheduler.commit(plan, out.token_ids, now, out.errors)
        self.stats.postprocess_s += time.perf_counter() - t_post
        self._finished(plan, batched, done, iteration, now, requests)

    # ---- driving ----
    def turn(self) -> bool:
        """One turn of `run`: a boundary, then one iteration; False when idle."""
        self.boundary()
        return self.step()

    def run(self, stop: threading.Event, intake: Optional[Callable[[float], None]] = None) -> None:
        """Serve submissions until `stop` is set; blocks while idle, wakes on `submit`. With
        `intake(timeout_s)` (submissions that come from elsewhere, e.g. another process's pipe),
        it is called before each turn with 0, and while idle in place of the wait: it submits
        what has come, waiting up to timeout_s for something to."""
        while not stop.is_set():
            if intake is not None:
                intake(0.0)
            if self.turn():
                continue
            # cleared before the inbox is checked again, so a submission in between is not missed
            self._wake.clear()
            if self._inbox or self._cancels:
                continue
            if intake is not None:
                intake(IDLE_WAIT_S)
            else:
                self._wake.wait(IDLE_WAIT_S)
        if self._inflight is not None:
            self._land()
        self.boundary()

    def abort_all(self, pending: Optional[list[Request]] = None) -> None:
        """End everything unfinished (aborted); `pending` requests that had not arrived end as
        `not_arrived`, with no finish time."""
        if self._inflight is not None:
            self._land()
        now = max(self.now(), self.stamp())  # paced: past every arrival stamped so far
        while self._inbox:
            self.add(self._inbox.popleft(), now)
        if self.scheduler.has_work():
            self.scheduler.abort_all(now)
        for req in pending or ():
            self.requests.append(req)
            self.scheduler.not_arrived(req)
        self._report_finished()

    def result(self, interrupted: bool = False) -> RunResult:
        """The run so far, for summary.json and requests.jsonl."""
        if self._bar is not None:
            self._bar.update(len(self.scheduler.finished) - self._num_done_reported)
            self._num_done_reported = len(self.scheduler.finished)
        sched = self.scheduler
        return RunResult(
            requests=list(self.requests),
            stats=self.stats,
            num_slots=sched.max_num_seqs,
            makespan_s=self.last_end,
            preemptions=sched.num_preemptions,
            wall_s=self._clock() - self._wall0,
            extra=sched.cache_stats(),
            tbt_s=sched.tbt_s,
            interrupted=interrupted,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _VirtualLaunch:
    """`EngineLoop._launch_virtual`'s handle: the step's output and its span on the virtual clock."""

    __slots__ = ("out", "begin", "end")

    def __init__(self, out: StepOutput, begin: float, end: float):
        self.out, self.begin, self.end = out, begin, end


def _progress_bar(total: Optional[int]):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="serving", mininterval=0.5, leave=False)
