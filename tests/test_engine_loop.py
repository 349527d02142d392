"""EngineLoop: online intake (submit, cancel, close_admission), the loop on its own thread,
token callbacks, and the simulator paced to the wall clock."""

from __future__ import annotations

import threading

import pytest

from conftest import CheckingExecutor
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine import PACE_SLACK_S, EngineLoop, serve
from cbjax.executor import Executor
from cbjax.request import FinishReason, Request, SamplingParams
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
        loop.submit(r)
    loop.boundary()
    assert loop.step()  # a runs (one slot), b and c wait
    assert sched.running == [a] and sched.allocator.num_used_pages > 0
    loop.cancel("a")
    loop.cancel("b", reason="client disconnected")
    loop.cancel("nobody")  # unknown ids are ignored
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
            loop.submit(r)
        loop.boundary()
        loop.step()
        loop.cancel("2")
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
    loop.close_admission()
    r = request("late")
    loop.submit(r)
    loop.boundary()
    assert r.finish_reason is FinishReason.REJECTED and "shutting down" in r.reject_reason
    assert loop.result().requests == [r]


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
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    reqs = [request(str(i), out=i + 1) for i in range(5)]
    for r in reqs:
        loop.submit(r)
    assert done.wait(30)
    stop.set()
    thread.join(30)
    assert tokens == {str(i): i + 1 for i in range(5)}
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert len(loop.result().requests) == 5


class Cost:
    """A fixed step cost: 10 ms, plus 1 ms per scheduled request."""

    def __call__(self, plan):
        return 0.010 + 0.001 * plan.num_scheduled


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
    result = serve([a, b], scheduler(slots=2), SimExecutor(lambda plan: 1.0, pipelined=pipelined))
    assert [r.finish_reason for r in result.requests] == [FinishReason.LENGTH, FinishReason.LENGTH]
    lag = 1.0 if pipelined else 0.0
    assert (a.first_token_s, a.finish_s) == (1.0, 3.0)
    assert (b.first_token_s, b.finish_s) == (2.0 + lag, 4.0 + lag)
