"""Scheduler semantics: exact unit-cost iteration counts, invariants under binding limits, rejections."""

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CheckingExecutor, make_requests
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine import serve
from cbjax.metrics import summarize
from cbjax.request import FinishReason, Request, SamplingParams
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor, UnitCost

LOOSE = dict(max_num_batched_tokens=1_000_000)
BIG_CACHE = CacheConfig(num_pages=1024, page_size=16)  # never binds in these tests


def list_schedule_finish_times(lengths, num_slots):
    """Hand oracle: assign each request, in order, to the slot that frees first."""
    free_at = [0] * num_slots
    finish = []
    for length in lengths:
        start = heapq.heappop(free_at)
        finish.append(start + length)
        heapq.heappush(free_at, start + length)
    return finish


def static_iterations(lengths, num_slots):
    return sum(max(lengths[i : i + num_slots]) for i in range(0, len(lengths), num_slots))


def run(policy, lengths, num_slots, cache=BIG_CACHE, **sched_kw):
    sched = Scheduler(SchedulerConfig(name=policy, max_num_seqs=num_slots, **(sched_kw or LOOSE)), cache, 100_000)
    reqs = make_requests(lengths)
    result = serve(reqs, sched, CheckingExecutor(sched))
    return result, sched


def test_seeds_example_5_50_10_100_on_4_slots_with_more_queued():
    # The seeds' batch A=5, B=50, C=10, D=100 on 4 slots, then E..H queued behind it.
    lengths = [5, 50, 10, 100, 20, 30, 40, 7]
    cont, _ = run("fcfs", lengths, 4)
    stat, _ = run("static", lengths, 4)
    finish = {r.request_id: r.finish_s for r in cont.requests}
    # E joins when A ends at 5 (ends 25), F when C ends at 10 (40), G at 25 (65), H at 40 (47).
    assert finish == {"0": 5, "1": 50, "2": 10, "3": 100, "4": 25, "5": 40, "6": 65, "7": 47}
    assert cont.stats.iterations == 100
    # Static: the first batch runs 100 iterations (the bubble), the second max(20,30,40,7)=40.
    assert stat.stats.iterations == 140
    assert {r.request_id: r.finish_s for r in stat.requests}["4"] == 120
    s_cont, s_stat = summarize(cont), summarize(stat)
    assert s_cont["slot_utilization"] == pytest.approx(sum(lengths) / (4 * 100))
    assert s_stat["slot_utilization"] == pytest.approx(sum(lengths) / (4 * 140))
    # the seeds' measure: requests completed within N iterations
    assert summarize(cont, window_iterations=50)["finished_in_window"] == 6
    assert summarize(stat, window_iterations=50)["finished_in_window"] == 3


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    num_slots=st.integers(1, 8),
)
def test_unit_iterations_match_list_scheduling_and_group_sums(lengths, num_slots):
    cont, _ = run("fcfs", lengths, num_slots)
    assert cont.stats.iterations == max(list_schedule_finish_times(lengths, num_slots))
    assert [r.finish_s for r in cont.requests] == list_schedule_finish_times(lengths, num_slots)
    stat, _ = run("static", lengths, num_slots)
    assert stat.stats.iterations == static_iterations(lengths, num_slots)
    for res in (cont, stat):
        assert all(r.num_generated == lengths[i] for i, r in enumerate(res.requests))
        # TTFT is one iteration after the request's admission, under unit cost
        assert all(r.first_token_s == r.scheduled_s + 1 for r in res.requests)


workloads = st.lists(
    st.tuples(st.floats(0, 30), st.integers(1, 60), st.integers(1, 30)),  # arrival, prompt, output
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=workloads,
    policy=st.sampled_from(["fcfs", "static"]),
    allocation=st.sampled_from(["paged", "reserve_max"]),
    num_slots=st.integers(1, 6),
    budget=st.integers(6, 120),
    num_pages=st.integers(6, 40),
    page_size=st.sampled_from([1, 4, 16]),
    chunked=st.booleans(),
)
def test_invariants_under_binding_limits(reqs, policy, allocation, num_slots, budget, num_pages, page_size, chunked):
    budget = max(budget, num_slots)
    sched = Scheduler(
        SchedulerConfig(name=policy, max_num_seqs=num_slots, max_num_batched_tokens=budget, chunked_prefill=chunked),
        CacheConfig(num_pages=num_pages, page_size=page_size, allocation=allocation),
        max_model_len=64,
    )
    requests = make_requests([o for _, _, o in reqs], [p for _, p, _ in reqs], [a for a, _, _ in reqs])
    result = serve(requests, sched, CheckingExecutor(sched))
    # every request ends exactly once, with a fate
    assert len(sched.finished) == len(requests)
    assert {id(r) for r in sched.finished} == {id(r) for r in requests}
    for r in requests:
        assert r.finish_reason is not None
        if r.finish_reason is FinishReason.REJECTED:
            assert r.reject_reason
        else:
            # no token lost or repeated across preemptions
            assert r.num_generated == min(r.target_output_len, 64 - r.prompt_len)
            assert r.first_token_s <= r.finish_s
    # every page back on the free list after the run
    sched.allocator.check_invariants()
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert result.preemptions == sum(r.num_preemptions for r in requests)


def test_preemption_by_recompute_keeps_every_token():
    # 2 pages of 4 tokens: two requests that each grow to 8 tokens cannot both stay resident.
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), CacheConfig(num_pages=3, page_size=4), 64
    )
    reqs = make_requests([5, 5], prompt_lens=[3, 3])
    result = serve(reqs, sched, CheckingExecutor(sched))
    assert result.preemptions >= 1
    assert [r.num_generated for r in reqs] == [5, 5]
    # the latest admitted request is the victim, as in vLLM
    assert reqs[1].num_preemptions >= 1 and reqs[0].num_preemptions == 0


def test_static_forms_next_batch_only_when_all_finished():
    sched = Scheduler(SchedulerConfig(name="static", max_num_seqs=2, **LOOSE), BIG_CACHE, 1000)
    reqs = make_requests([1, 3, 1])
    serve(reqs, sched, CheckingExecutor(sched))
    assert reqs[2].scheduled_s == 3  # not at 1, when request 0's slot went idle


def test_token_budget_limits_admission():
    # prompts of 10 with a budget of 25: two prefills fit per iteration, not three
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=25), BIG_CACHE, 1000)
    reqs = make_requests([4, 4, 4], prompt_lens=[10, 10, 10])
    serve(reqs, sched, CheckingExecutor(sched))
    assert [r.scheduled_s for r in reqs] == [0, 0, 1]


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("prompt_len", 0, "empty prompt"),
        ("prompt_len", 200, "max_model_len is 100"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("input_error", "trace.csv line 3: bad", "line 3"),
    ],
)
def test_bad_requests_are_rejected_with_a_reason_and_the_run_goes_on(field, value, reason):
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, **LOOSE), BIG_CACHE, max_model_len=100)
    reqs = make_requests([3, 3, 3])
    bad = reqs[1]
    if field == "max_tokens":
        bad.sampling = SamplingParams(max_tokens=value)
    else:
        setattr(bad, field, value)
    serve(reqs, sched, CheckingExecutor(sched))
    assert bad.finish_reason is FinishReason.REJECTED and reason in bad.reject_reason
    assert [r.finish_reason for r in (reqs[0], reqs[2])] == [FinishReason.LENGTH] * 2


def test_requests_that_cannot_fit_alone_are_rejected():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), CacheConfig(num_pages=4, page_size=4), 1000)
    reqs = make_requests([2, 2, 30], prompt_lens=[20, 4, 4])
    serve(reqs, sched, CheckingExecutor(sched))
    assert "max_num_batched_tokens=16" in reqs[0].reject_reason
    assert reqs[1].finish_reason is FinishReason.LENGTH
    assert "KV pages" in reqs[2].reject_reason


def test_target_shorter_than_max_tokens_finishes_as_eos():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, **LOOSE), BIG_CACHE, 1000)
    reqs = make_requests([3, 10], max_tokens=10)
    serve(reqs, sched, SimExecutor(UnitCost()))
    assert [r.finish_reason for r in reqs] == [FinishReason.EOS, FinishReason.LENGTH]


def test_real_tokens_stop_on_eos_and_stop_ids():
    class Scripted:
        virtual_clock = True

        def validate(self, req):
            return None

        def warmup(self):
            pass

        def execute(self, plan):
            from cbjax.executor import StepOutput

            return StepOutput(token_ids=[7 if r.request_id == "a" else 9 for r in plan.requests], duration_s=1.0)

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, **LOOSE), BIG_CACHE, 1000, eos_token_id=9)
    a = Request("a", 0.0, 4, prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=5, stop_token_ids=(7,)))
    b = Request("b", 0.0, 4, prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=5))
    serve([a, b], sched, Scripted())
    assert (a.finish_reason, a.output_token_ids) == (FinishReason.STOP, [7])
    assert (b.finish_reason, b.output_token_ids) == (FinishReason.EOS, [9])


def test_nan_free_latencies_and_ttft_under_staggered_arrivals():
    reqs = make_requests([2, 2], arrivals=[0.0, 0.5])
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, **LOOSE), BIG_CACHE, 1000)
    result = serve(reqs, sched, SimExecutor(UnitCost()))
    s = summarize(result)
    # request 1 arrives mid-iteration, waits for the slot (free at t=2), runs 2..4
    assert reqs[1].scheduled_s == 2 and reqs[1].finish_s == 4
    assert s["ttft_s_p50"] == pytest.approx((1 + 2.5) / 2)
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in s.values())


def test_recomputed_request_longer_than_the_budget_prefills_in_chunks():
    # Found by hypothesis: request 1 (9 prompt tokens) is preempted after generating, so its
    # recompute (9 + generated tokens) exceeds the budget of 10 and must be chunked.
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10), CacheConfig(num_pages=6, page_size=4), 64
    )
    reqs = make_requests([5, 5], prompt_lens=[1, 9])
    result = serve(reqs, sched, CheckingExecutor(sched))
    assert result.preemptions >= 1
    assert [r.num_generated for r in reqs] == [5, 5]
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_chunked_prefill_by_hand():
    # Budget 6 on 2 slots. A (prompt 10, 3 out) and B (prompt 4, 2 out) arrive at t=0.
    # it 1: A's first chunk, 6 tokens. it 2: A's last 4 tokens (first token out), then B's first
    # 2. it 3: A decodes, then B's last 2 tokens (B's first token). it 4: both decode and end.
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6, chunked_prefill=True), BIG_CACHE, 1000
    )
    a, b = make_requests([3, 2], prompt_lens=[10, 4])
    result = serve([a, b], sched, CheckingExecutor(sched))
    assert result.stats.iterations == 4
    assert (a.first_token_s, a.finish_s, b.first_token_s, b.finish_s) == (2, 4, 3, 4)
    assert result.stats.batched_tokens == 6 + 6 + 3 + 2
    # without chunking, A's prompt can never fit the budget
    plain = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6), BIG_CACHE, 1000)
    a2, b2 = make_requests([3, 2], prompt_lens=[10, 4])
    serve([a2, b2], plain, CheckingExecutor(plain))
    assert "max_num_batched_tokens=6" in a2.reject_reason and b2.finish_s == 2


def test_slo_goodput_and_attainment_by_hand():
    # Unit cost, 1 slot: request 0 runs 0..3 (TTFT 1, TPOT 1), request 1 runs 3..5 (TTFT 4),
    # request 2 is rejected. With ttft <= 2: only request 0 meets it.
    reqs = make_requests([3, 2, 2], prompt_lens=[4, 4, 0])
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, **LOOSE), BIG_CACHE, 1000)
    result = serve(reqs, sched, SimExecutor(UnitCost()))
    s = summarize(result, slo_ttft_s=2.0, slo_tpot_s=1.0)
    assert s["makespan_s"] == 5
    assert s["goodput_req_s"] == pytest.approx(1 / 5)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert summarize(result, slo_tpot_s=0.5)["slo_attainment"] == 0.0
    assert summarize(result)["slo_attainment"] == pytest.approx(2 / 3)
