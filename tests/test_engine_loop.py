"""EngineLoop: online intake (submit, cancel, close_admission), the loop on its own thread,
token callbacks, and the simulator paced to the wall clock."""

from __future__ import annotations

import threading

import pytest

from conftest import CheckingExecutor
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.core.timing import StepTime
from cbjax.engine.clock import PACE_SLACK_S
from cbjax.engine.loop import EngineLoop
from cbjax.engine.online import run_online
from cbjax.engine.offline import run_result, serve
from cbjax.core.executor import Executor
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost

LOOSE = dict(max_num_batched_tokens=4096)


def scheduler(slots=2, num_pages=64, name="fcfs"):
    return Scheduler(SchedulerConfig(name=name, max_num_seqs=slots, **LOOSE), CacheConfig(num_pages=num_pages, page_size=4), 1000)


def request(rid, prompt=6, out=5):
    return Request(rid, 0.0, prompt, sampling=SamplingParams(max_tokens=out, ignore_eos=True), target_output_len=out)


def test_cancel_frees_a_running_and_a_waiting_request_before_the_next_plan():
    sched = scheduler(slots=1)
    ended = []
    loop = EngineLoop(sched, CheckingExecutor(sched), on_finish=ended.append)
    a, b, c = request("a"), request("b"), request("c", out=2)
    for r in (a, b, c):
        loop.intake.submit(r)
    loop.boundary()
    assert loop.step()  # a runs (one slot), b and c wait
    assert sched.running == [a] and sched.allocator.num_used_pages > 0
    loop.intake.cancel("a", "cancelled", FinishReason.ABORTED)
    loop.intake.cancel("b", "client disconnected", FinishReason.ABORTED)
    loop.intake.cancel("nobody", "cancelled", FinishReason.ABORTED)  # unknown ids are ignored
    loop.boundary()
    assert [r.request_id for r in ended] == ["a", "b"]
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORTED, FinishReason.ABORTED)
    assert b.error == "client disconnected" and a.finish_s is not None
    assert sched.running == [] and sched.allocator.num_used_pages == 0 and sched.slots == [None]
    assert [r.request_id for r in sched.policy] == ["c"]
    while loop.step():
        loop.boundary()
    loop.boundary()
    assert c.finish_reason is FinishReason.LENGTH and c.num_generated == 2
    assert [r.request_id for r in ended] == ["a", "b", "c"]


def test_cancel_under_every_policy_removes_the_waiting_request_only():
    for name in ("fcfs", "priority", "sjf", "mlfq", "vtc", "static"):
        sched = scheduler(slots=1, name=name)
        loop = EngineLoop(sched, CheckingExecutor(sched))
        reqs = [request(str(i)) for i in range(4)]
        for r in reqs:
            loop.intake.submit(r)
        loop.boundary()
        loop.step()
        loop.intake.cancel("2", "cancelled", FinishReason.ABORTED)
        loop.boundary()
        assert reqs[2].finish_reason is FinishReason.ABORTED, name
        assert sorted(r.request_id for r in sched.policy) == ["1", "3"], name
        while loop.step():
            loop.boundary()
        loop.boundary()
        assert [r.finish_reason for r in reqs] == [FinishReason.LENGTH] * 2 + [FinishReason.ABORTED, FinishReason.LENGTH], name


def test_closed_admission_rejects_later_submissions_with_a_reason():
    sched = scheduler()
    loop = EngineLoop(sched, CheckingExecutor(sched))
    loop.intake.close_admission()
    r = request("late")
    loop.intake.submit(r)
    loop.boundary()
    assert r.finish_reason is FinishReason.REJECTED and "shutting down" in r.reject_reason
    assert run_result(loop).requests == [r]


def test_run_on_a_thread_serves_submissions_and_reports_every_token():
    sched = scheduler(slots=2)
    tokens: dict[str, int] = {}
    done = threading.Event()
    ended = []

    def on_token(req, token_id, now):
        assert token_id is None  # the simulator materialises no ids
        tokens[req.request_id] = tokens.get(req.request_id, 0) + 1

    def on_finish(req):
        ended.append(req)
        if len(ended) == 5:
            done.set()

    loop = EngineLoop(sched, SimExecutor(UnitCost()), on_token=on_token, on_finish=on_finish)
    stop = threading.Event()
    thread = threading.Thread(target=run_online, args=(loop, stop))
    thread.start()
    reqs = [request(str(i), out=i + 1) for i in range(5)]
    for r in reqs:
        loop.intake.submit(r)
    assert done.wait(30)
    stop.set()
    thread.join(30)
    assert tokens == {str(i): i + 1 for i in range(5)}
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert len(run_result(loop).requests) == 5


def turn(loop) -> bool:
    """One turn of the online driver: a boundary, then one iteration; False when idle."""
    loop.boundary()
    return loop.step()


class Cost:
    """A fixed step cost: 10 ms, plus 1 ms per scheduled request."""

    name, history = "test", 0

    def __call__(self, plan, ctx=None):
        return StepTime(0.010 + 0.001 * plan.num_scheduled)


class FakeClock:
    """A wall clock that moves only when the loop sleeps, plus `lag_s` per reading taken while
    a step is being planned (a slow host)."""

    def __init__(self, lag_s: float = 0.0):
        self.t, self.lag_s, self.slept = 0.0, lag_s, []

    def __call__(self) -> float:
        self.t += self.lag_s
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def paced_and_offline(lag_s=0.0):
    def run(pace, clock):
        reqs = [request(str(i), prompt=4 + 3 * i, out=2 + i) for i in range(6)]
        kw = dict(clock=clock, sleep=clock.sleep) if clock else {}
        return reqs, serve(reqs, scheduler(slots=3), SimExecutor(Cost()), pace=pace, **kw)

    clock = FakeClock(lag_s)
    return run("none", None), run("realtime", clock), clock


def test_realtime_pacing_releases_tokens_at_the_simulated_times():
    (offline, off), (paced, on), clock = paced_and_offline()
    for a, b in zip(offline, paced):
        assert (a.first_token_s, a.finish_s) == (b.first_token_s, b.finish_s)
    assert on.makespan_s == off.makespan_s > 0
    # the loop slept each step's simulated duration, back to back
    assert sum(clock.slept) == pytest.approx(off.makespan_s) and on.wall_s == pytest.approx(off.makespan_s)


def test_a_host_slower_than_the_slack_slips_to_the_wall_clock():
    (offline, off), (paced, on), _ = paced_and_offline(lag_s=PACE_SLACK_S)
    assert on.makespan_s > off.makespan_s  # the delay shows in the latencies, never hidden
    assert all(b.finish_s >= a.finish_s for a, b in zip(offline, paced))


def test_every_executor_satisfies_the_protocol():
    sched = scheduler()
    assert isinstance(SimExecutor(UnitCost()), Executor)
    assert isinstance(CheckingExecutor(sched), Executor)


class SubmittingClock(FakeClock):
    """A fake wall clock whose sleeps let the world go on: each submission falling inside a
    sleep is made at its own wall time, as the server's thread would make it."""

    def __init__(self, loop_of, arrivals: list[tuple[float, Request]]):
        super().__init__()
        self.loop_of, self.todo = loop_of, sorted(arrivals, key=lambda a: a[0])

    def sleep(self, s: float) -> None:
        end = self.t + s
        while self.todo and self.todo[0][0] <= end:
            at, req = self.todo.pop(0)
            self.t = max(self.t, at)
            self.loop_of().intake.submit(req)
        self.slept.append(s)
        self.t = end


def test_paced_online_arrivals_get_the_offline_schedule_and_ttft():
    # arrivals idle and mid-step, several in one step, one within PACE_SLACK_S of a step's end
    times = [0.0, 0.004, 0.0105, 0.013, 0.0131, 0.029, 0.0335, 0.2, 0.2007, 0.5]
    offline = [request(str(i), prompt=4 + 3 * i, out=2 + i % 4) for i in range(len(times))]
    for r, t in zip(offline, times):
        r.arrival_s = t
    serve(offline, scheduler(slots=3), SimExecutor(Cost()))

    online = [request(str(i), prompt=4 + 3 * i, out=2 + i % 4) for i in range(len(times))]
    loop = None
    clock = SubmittingClock(lambda: loop, list(zip(times, online)))
    loop = EngineLoop(scheduler(slots=3), SimExecutor(Cost()), pace="realtime", clock=clock, sleep=clock.sleep)
    loop.clock.restart()
    while clock.todo or loop.has_work() or loop.intake.inbox:
        if not turn(loop) and clock.todo:
            clock.sleep(clock.todo[0][0] - clock.t)  # idle until the next submission
    loop.boundary()
    for a, b in zip(offline, online):
        assert b.arrival_s == pytest.approx(a.arrival_s, abs=1e-12), a.request_id  # stamped when submitted
        # scheduled in the first iteration that starts at or after its arrival, as offline
        assert b.scheduled_s == pytest.approx(a.scheduled_s, abs=1e-9) and b.scheduled_s >= b.arrival_s, a.request_id
        assert b.first_token_s - b.arrival_s == pytest.approx(a.first_token_s - a.arrival_s, abs=1e-9), a.request_id
        assert b.finish_s == pytest.approx(a.finish_s, abs=1e-9), a.request_id


def test_paced_idle_loop_starts_at_the_arrival_stamped_at_receipt():
    # The server stamps a request as it is received and submits it once parsed: an idle loop
    # that comes to it within PACE_SLACK_S starts its step at the arrival, as offline does;
    # later than that, at the wall clock (an honest delay).
    for parse_s, start in ((0.002, 1.0), (PACE_SLACK_S + 0.002, 1.0 + PACE_SLACK_S + 0.002)):
        clock = FakeClock()
        loop = EngineLoop(scheduler(), SimExecutor(Cost()), pace="realtime", clock=clock, sleep=clock.sleep)
        loop.clock.restart()
        clock.sleep(1.0 + parse_s)
        r = request("r", out=1)
        loop.intake.submit(r, arrival_s=1.0)
        assert turn(loop)
        assert r.arrival_s == 1.0 and r.scheduled_s == pytest.approx(start)
        assert r.first_token_s == pytest.approx(start + 0.010 + 0.001)  # Cost: one request scheduled


class ActingClock(FakeClock):
    """A fake wall clock whose sleeps run the actions due by their end, each at its time."""

    def __init__(self, actions: list[tuple[float, object]]):
        super().__init__()
        self.todo = sorted(actions, key=lambda a: a[0])

    def sleep(self, s: float) -> None:
        end = self.t + s
        while self.todo and self.todo[0][0] <= end:
            at, act = self.todo.pop(0)
            self.t = max(self.t, at)
            act()
        self.slept.append(s)
        self.t = end


@pytest.mark.parametrize("parse_s, admitted_at", [(0.0025, 0.022), (0.010, 0.033)])
def test_paced_boundary_waits_briefly_for_a_request_received_before_it(parse_s, admitted_at):
    # `a` runs alone: 11 ms steps (Cost), boundaries at 0.011, 0.022, 0.033. `b` reaches the
    # server at 0.020 and is submitted once parsed, `parse_s` later. Offline, arriving at
    # 0.020, it is scheduled at 0.022; paced, the boundary at 0.022 waits for a request
    # received before it (up to half of PACE_SLACK_S), else it takes the next boundary.
    a, b = request("a", out=8), request("b", out=2)
    loop = None

    def submit_b():
        loop.intake.submit(b, arrival_s=0.020)
        loop.intake.received("b")

    clock = ActingClock([(0.020, lambda: loop.intake.receive("b")), (0.020 + parse_s, submit_b)])
    loop = EngineLoop(scheduler(slots=2), SimExecutor(Cost()), pace="realtime", clock=clock, sleep=clock.sleep)
    loop.clock.restart()
    loop.intake.submit(a)
    while turn(loop) or clock.todo:
        pass
    assert b.arrival_s == 0.020 and b.scheduled_s == pytest.approx(admitted_at)
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert not loop.intake.receiving


class Fixed:
    """Every step 1 s."""

    name, history = "fixed", 0

    def __call__(self, plan, ctx=None):
        return StepTime(1.0)


def _timed(rid, arrival, prompt=4, out=3):
    return Request(rid, arrival, prompt, sampling=SamplingParams(max_tokens=out, ignore_eos=True), target_output_len=out)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_pipelined_simulator_plans_a_step_ahead_as_the_engine_does_by_hand(pipelined):
    # every step takes 1 s. a arrives at 0 and b at 0.5, during step 1 (a's prefill, [0, 1]).
    # One step at a time: step 2 ([1, 2]) holds b's prefill and a's decode: b's first token at 2.
    # Pipelined: step 2 (a's decode) was planned at 0, while step 1 ran; b is planned after
    # step 1 lands, into step 3 ([2, 3]): its first token at 3. a's tokens land at 1, 2, 3 either
    # way (3 tokens); b's 3 tokens end at 4 one step at a time, at 5 pipelined.
    a, b = _timed("a", 0.0), _timed("b", 0.5)
    result = serve([a, b], scheduler(slots=2), SimExecutor(Fixed(), pipelined=pipelined))
    assert [r.finish_reason for r in result.requests] == [FinishReason.LENGTH, FinishReason.LENGTH]
    lag = 1.0 if pipelined else 0.0
    assert (a.first_token_s, a.finish_s) == (1.0, 3.0)
    assert (b.first_token_s, b.finish_s) == (2.0 + lag, 4.0 + lag)


@pytest.mark.parametrize(
    "launch, a_first, a_end, b_scheduled, b_first, b_end", [(0.5, 1.5, 3.5, 1.5, 3.5, 5.5), (1.5, 2.5, 5.0, 2.5, 5.0, 7.0)]
)
def test_a_pipelined_launch_delays_the_step_in_flight_only_if_it_outlasts_it_by_hand(
    launch, a_first, a_end, b_scheduled, b_first, b_end
):
    # As above, pipelined, every step 1 s, but the loop's host time before it can collect the
    # step in flight, when it launches a plan holding a prefill, is `launch` from where it
    # collected the last step; a step's device work starts no earlier than its own launch ends.
    # Step 1 (a's prefill) is launched at 0 with nothing in flight: it runs [L, L + 1] (L the
    # launch). Step 2 (a's decode, planned at 0, no launch time) runs [L + 1, L + 2]. Step 3 (b's
    # prefill and a's last decode) is planned at L + 1, where step 1 was collected, while step 2
    # runs: step 2 is collected at max(L + 2, 2L + 1) and step 3 runs from there, then b's two
    # decodes. L = 0.5 hides behind step 2 (collected at 2.5; step 3 [2.5, 3.5], b's decodes
    # [3.5, 4.5], [4.5, 5.5]); L = 1.5 outlasts it (step 1 [1.5, 2.5], step 2 collected at 4.0,
    # step 3 [4, 5], b's decodes [5, 6], [6, 7]).
    class Cost(Fixed):
        def __call__(self, plan, ctx=None):
            return StepTime(1.0, launch_s=launch if plan.prefills else 0.0)

    a, b = _timed("a", 0.0), _timed("b", 0.5)
    serve([a, b], scheduler(slots=2), SimExecutor(Cost(), pipelined=True))
    assert (a.first_token_s, a.finish_s) == (a_first, a_end)
    assert (b.scheduled_s, b.first_token_s, b.finish_s) == (b_scheduled, b_first, b_end)
    # one step at a time, nothing is in flight at a launch: the launch time is not charged
    a, b = _timed("a", 0.0), _timed("b", 0.5)
    serve([a, b], scheduler(slots=2), SimExecutor(Cost(), pipelined=False))
    assert (a.first_token_s, a.finish_s, b.first_token_s, b.finish_s) == (1.0, 3.0, 2.0, 4.0)


@pytest.mark.parametrize("drain, a_end, b_first, b_end", [(None, 3.0, 4.0, 5.0), (0.25, 2.25, 3.5, 3.75),
                                                         (5.0, 3.0, 4.0, 5.0)])  # fmt: skip
def test_a_step_collected_with_nothing_behind_it_ends_at_its_drain_by_hand(drain, a_end, b_first, b_end):
    # Pipelined, every step 1 s, no launch time. a's prefill runs [0, 1], its decodes [1, 2] and
    # [2, 3]; its last decode is collected with nothing launched behind it, so it ends at its
    # drain, 2 + 0.25 (never later than its duration: a drain of 5 leaves it at 3). b arrives at
    # 2.5: its prefill is planned at the later of that and a's end, and runs a second; its decode
    # runs the next second, drained too. Without a drain (None) a's end stays at 3: b's prefill
    # waits for it.
    class Cost(Fixed):
        def __call__(self, plan, ctx=None):
            return StepTime(1.0, drain_s=drain)
    a, b = _timed("a", 0.0), _timed("b", 2.5, out=2)
    serve([a, b], scheduler(slots=2), SimExecutor(Cost(), pipelined=True))
    assert (a.first_token_s, a.finish_s) == (1.0, a_end)
    assert (b.first_token_s, b.finish_s) == (b_first, b_end)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_step_hands_its_tokens_off_before_the_loop_plans_on(pipelined):
    # steps alone, no boundary between them: each step's token is followed by a tick at once
    # (the server's hand-off), not left for the next boundary
    events = []
    loop = EngineLoop(scheduler(), SimExecutor(UnitCost(), pipelined=pipelined),
                      on_token=lambda req, token_id, now: events.append("token"),
                      tick=lambda: events.append("tick"))  # fmt: skip
    loop.add(request("a", out=3))
    while loop.step():
        pass
    assert events == ["token", "tick"] * 3
