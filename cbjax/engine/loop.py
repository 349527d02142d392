"""The serving loop as a class: each iteration is schedule -> execute -> postprocess.

`EngineLoop` owns one scheduler, one executor and the loop's clock (`cbjax.engine.clock`), and
runs one iteration per `step`. Drivers feed it: the offline `serve`, the clusters
(`cbjax.engine.drive`), and the online server (`cbjax.engine.online`) through its thread-safe
`intake`. With a pipelined executor (`executor.pipelined`) a step launches before the previous
one's tokens are read: `Scheduler.advance` at launch, `Scheduler.commit` when the tokens come.

On a virtual clock, the steps of a decode stretch that start before the next event run as
one plan (`cbjax.engine.stretch`), with the results of the same steps run one at a time.

Callbacks run on the loop's thread:
- `on_step(plan, end_s, num_batched_tokens, requests)`: after each iteration's postprocess,
  with the plan's requests in plan order;
- `on_token(request, token_id, now)`: each token as it is committed (`token_id` None when the
  executor simulates tokens);
- `on_finish(request)`: each request once, as it ends (rejections and aborts included);
- `tick()`: every loop turn (e.g. to flush a log), and as soon as a step's tokens went to
  `on_token`: a hand-off of tokens waits for no more of the loop's own work.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from cbjax.core.executor import Executor
from cbjax.core.plan import Schedule
from cbjax.core.request import FinishReason, Request
from cbjax.engine.clock import make_clock
from cbjax.engine.intake import Intake
from cbjax.engine.stats import ProgressBar, StatsRecorder, TokenReporter
from cbjax.engine.stretch import Ahead, catch_up, run_stretch
from cbjax.scheduler.core import Scheduler

_perf_counter = time.perf_counter
_INF = float("inf")


class EngineLoop:
    """One scheduler and one executor on one clock; one iteration per `step`."""

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
        stretches: bool = True,
    ):
        self.scheduler, self.executor = scheduler, executor
        self.clock = make_clock(executor, pace, clock, sleep)
        self.intake = Intake(self.clock)
        # a speculating scheduler plans from the accepted drafts: each step runs to completion
        self.pipelined = executor.pipelined and self.clock.pipelines and not scheduler.speculating
        # decode stretches (`run_stretch`): a virtual clock, one step at a time, no token callback
        self.stretches = stretches and not self.pipelined and on_token is None and self.clock.stretches
        self._simulated = False  # the last step's tokens were simulated (None)
        scheduler.plan_token_ids = executor.reads_token_ids
        self.on_step, self.on_finish, self.tick = on_step, on_finish, tick
        self.tokens = TokenReporter(on_token, not executor.virtual_clock) if on_token is not None else None
        self.recorder = StatsRecorder(scheduler)
        self.stats = self.recorder.stats
        self.requests: list[Request] = []  # every request that entered, in order of entry
        self._bar = ProgressBar(total) if progress else None
        self._num_seen = 0  # scheduler.finished[:_num_seen] went to on_finish
        self._inflight = None  # pipelined: (plan, clock handle, batched tokens, iteration, requests)
        self.ahead: Optional[Ahead] = None  # a stretch's steps priced, not run (`cbjax.engine.stretch`)

    def now(self) -> float:
        return self.clock.now()

    # ---- intake ----
    def add(self, req: Request, now: Optional[float] = None) -> None:
        """Hand an arrived request to the scheduler (on the loop's thread)."""
        now = self.clock.now() if now is None else now
        if self.ahead is not None:
            catch_up(self, now)  # what began before the arrival runs first
        self.requests.append(req)
        if not self.intake.open:
            self.scheduler.reject(req, "server is shutting down", now)
            return
        self.scheduler.add(req, now)

    def boundary(self) -> None:
        """Between iterations: report finished requests, take submissions and cancellations."""
        intake = self.intake
        intake.take(self.add, self.has_work)
        while intake.cancels:
            request_id, reason, finish_reason = intake.cancels.popleft()
            if self._inflight is not None:
                self._land()  # the step in flight holds the request's slot
            self.ahead = None  # priced on what the abort changes
            self.scheduler.abort(request_id, self.clock.now(), reason, finish_reason)
        self._report_finished()
        if self.tick is not None:
            self.tick()

    def _report_finished(self) -> None:
        finished = self.scheduler.finished
        if len(finished) > self._num_seen:
            for req in finished[self._num_seen :]:
                if self.tokens is not None:
                    self.tokens.forget(req)
                if self.on_finish is not None:
                    self.on_finish(req)
            self._num_seen = len(finished)

    # ---- iterations ----
    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def step(self, until: float = _INF, max_steps: Optional[int] = None, ahead: bool = False) -> bool:
        """Run one iteration (or land the step in flight); False when there is nothing to do.
        On a virtual clock with no token callback, the steps of a decode stretch that start
        before `until` (at most `max_steps`) run as one (`run_stretch`, with `ahead`)."""
        sched, stats = self.scheduler, self.stats
        if self._inflight is not None and (not sched.has_work() or sched.needs_sync()):
            self._land()  # nothing to overlap with, or the next plan may preempt: tokens first
            return True
        if not sched.has_work():
            return False
        start = self.clock.now()
        if self.stretches and self._simulated and until > start and run_stretch(self, start, until, max_steps, ahead):
            return True
        self.ahead = None
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
        batched = self.recorder.planned(plan)
        if self.pipelined:
            handle = self.clock.launch(self.executor, plan, start)
            if plan.host_copies is not None:
                sched.loaded(plan, *self.clock.load_times(self.executor))
            if self._inflight is not None:
                self._land(covered=True)
            t_post = _perf_counter()
            sched.advance(plan, self.clock.stamp())
            stats.postprocess_s += _perf_counter() - t_post
            self._inflight = (plan, handle, batched, stats.iterations, requests)
            return True
        out, busy, end = self.clock.run(self.executor, plan, start)
        if plan.host_copies is not None:
            sched.loaded(plan, *self.clock.load_times(self.executor))
        self._simulated = out.token_ids is None  # a stretch needs tokens that are simulated
        stats.busy_s += busy
        t_post = _perf_counter()
        if out.num_accepted is None:
            done = sched.postprocess(plan, out.token_ids, end, out.errors)
        else:
            done = sched.postprocess(plan, out.token_ids, end, out.errors, num_accepted=out.num_accepted,
                                     accepted_ids=out.accepted_ids)  # fmt: skip
        stats.postprocess_s += _perf_counter() - t_post
        self._finished(plan, batched, done, stats.iterations, end, requests)
        return True

    def _land(self, covered: bool = False) -> None:
        """Pipelined: read the step in flight's tokens and commit them. `covered`: the next step
        was launched first."""
        plan, handle, batched, iteration, requests = self._inflight
        self._inflight = None
        out, busy, _ = self.clock.collect(self.executor, handle, covered)
        now = self.clock.now()
        self.stats.busy_s += busy
        t_post = _perf_counter()
        done = self.scheduler.commit(plan, out.token_ids, now, out.errors)
        self.stats.postprocess_s += _perf_counter() - t_post
        self._finished(plan, batched, done, iteration, now, requests)

    def finished_steps(self, plan, batched, done, ends, requests) -> None:
        """A decode stretch's steps (`run_stretch`) are done: report them as one."""
        self._finished(plan, batched, done, self.stats.iterations, ends, requests)

    def _finished(self, plan, batched, done, iteration, end, requests) -> None:
        if done:
            self.recorder.ended(done, iteration)
        if self.tokens is not None and self.tokens.report(requests, end) and self.tick is not None:
            self.tick()
        if self.on_step is not None:
            self.on_step(plan, end, batched, requests)
        if self._bar is not None:
            self._bar.update(len(self.scheduler.finished))

    # ---- the end ----
    def settle(self) -> None:
        """Land the step in flight, if any, and report what ended."""
        if self._inflight is not None:
            self._land()
        self.boundary()

    def abort_all(self, pending: Optional[list[Request]] = None, error: Optional[str] = None) -> None:
        """End everything unfinished (aborted, with `error` as its reason if given); `pending`
        requests that had not arrived end as `not_arrived`, with no finish time."""
        if self._inflight is not None:
            self._land()
        self._end_all(FinishReason.ABORTED, error)
        for req in pending or ():
            self.requests.append(req)
            self.scheduler.not_arrived(req)
        self._report_finished()

    def fail_all(self, error: str) -> None:
        """The executor is lost (a step raised, its process died): drop the step in flight
        unread and end everything unfinished with fate `error`, `error` its reason."""
        self._inflight = None
        self._end_all(FinishReason.ERROR, error)
        self._report_finished()

    def _end_all(self, reason: FinishReason, error: Optional[str]) -> None:
        self.ahead = None  # steps priced ahead never ran
        now = max(self.clock.now(), self.clock.stamp())  # paced: past every arrival stamped so far
        while self.intake.inbox:
            self.add(self.intake.inbox.popleft(), now)
        if self.scheduler.has_work():
            self.scheduler.abort_all(now, reason, error)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(len(self.scheduler.finished))
            self._bar.close()
            self._bar = None

