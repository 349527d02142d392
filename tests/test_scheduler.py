"""Scheduler semantics: exact unit-cost iteration counts, invariants under binding limits, rejections."""

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CheckingExecutor, ContentCheckingExecutor, assert_every_request_ends_once, make_requests
from cbjax.cache import ALLOCATIONS
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.core.executor import SyncExecutor
from cbjax.report.metrics import summarize
from cbjax.core.request import FinishReason, Request, SamplingParams, Status
from cbjax.scheduler import POLICIES, Scheduler
from cbjax.scheduler.policy import FCFSPolicy
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
    # arrival, prompt, output, prompt tokens shared with its group, group, priority, client
    st.tuples(
        st.floats(0, 8), st.integers(1, 40), st.integers(1, 30), st.integers(0, 40), st.integers(0, 2),
        st.integers(0, 3), st.sampled_from("abc"),
    ),
    min_size=6,
    max_size=30,
)


def shared_prefix_ids(i, prompt_len, shared, group):
    """The first `shared` tokens are the group's; the rest are the request's own."""
    return [group * 1000 + t if t < shared else 10_000 * (i + 1) + t for t in range(prompt_len)]


@settings(max_examples=400, deadline=None)
@given(
    reqs=workloads,
    policy=st.sampled_from(sorted(POLICIES)),
    allocation=st.sampled_from(ALLOCATIONS),
    num_slots=st.integers(1, 6),
    budget=st.integers(6, 120),
    num_pages=st.integers(6, 30),
    page_size=st.sampled_from([1, 2, 4, 8, 16]),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
    num_swap_pages=st.sampled_from([0, 8, None]),
    tokens=st.booleans(),
)
def test_invariants_under_binding_limits(
    reqs, policy, allocation, num_slots, budget, num_pages, page_size, chunked, prefix_caching, preemption,
    num_swap_pages, tokens,
):  # fmt: skip
    # Every policy (with its preemption on where it has one), both preemption modes, prefix
    # caching, and a cache model that checks each request reads back exactly its own tokens.
    budget = max(budget, num_slots)
    prefix_caching = prefix_caching and allocation == "paged"  # reservations share no pages
    sched = Scheduler(
        SchedulerConfig(
            name=policy, max_num_seqs=num_slots, max_num_batched_tokens=budget, chunked_prefill=chunked,
            preemption=preemption, priority_preempt=True, mlfq_base_quantum=2,
        ),
        CacheConfig(
            num_pages=num_pages, page_size=page_size, allocation=allocation, prefix_caching=prefix_caching,
            num_swap_pages=num_swap_pages,
        ),
        max_model_len=64,
    )  # fmt: skip
    requests = make_requests([r[2] for r in reqs], [r[1] for r in reqs], [r[0] for r in reqs])
    for i, (req, (_, prompt, _, shared, group, priority, client)) in enumerate(zip(requests, reqs)):
        req.prompt_token_ids = shared_prefix_ids(i, prompt, shared, group)
        req.priority, req.client_id = priority, client
    executor = ContentCheckingExecutor(sched, tokens=tokens)
    result = serve(requests, sched, executor)
    assert_every_request_ends_once(sched, requests, result, max_model_len=64)
    # no host copy left, and cached pages only with prefix caching on
    assert prefix_caching or sched.allocator.num_cached_pages == 0
    assert sched.swap_used == 0 and not executor.host
    stats = result.extra
    assert stats["swap_preemptions"] <= result.preemptions
    assert preemption == "swap" or stats["swap_preemptions"] == 0
    assert prefix_caching or stats["prefix_cache_hit_tokens"] == 0
    assert 0.0 <= stats["prefix_cache_hit_rate"] < 1.0


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
    class Scripted(SyncExecutor):
        def execute(self, plan):
            from cbjax.core.executor import StepOutput

            return StepOutput(token_ids=[7 if r.request_id == "a" else 9 for r in plan.scheduled])

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
    # a run cut short: a request that never arrived was not submitted, and counts neither way
    late = make_requests([1])[0]
    late.status, late.finish_reason = Status.FINISHED, FinishReason.NOT_ARRIVED
    result.requests.append(late)
    assert summarize(result, slo_ttft_s=2.0, slo_tpot_s=1.0)["slo_attainment"] == pytest.approx(1 / 3)


def test_prefix_cache_hit_rate_by_hand():
    # 1 slot, so each request runs alone after the previous one; pages of 4 tokens. P is a
    # 20-token prefix (5 pages). A = P + 6 own tokens (26), B = P + 6 others (26), C = A, and
    # D = 10 unrelated tokens. After A, its 6 full prompt pages (tokens 0..23) are cached.
    # B matches P's 5 pages (20 tokens); its 6th page differs. C matches 6 pages (24 tokens):
    # (26 - 1) // 4 = 6 leaves its last 2 tokens to prefill. D matches nothing.
    # hit rate = (0 + 20 + 24 + 0) / (26 + 26 + 26 + 10) = 44 / 88 = 0.5.
    prefix = list(range(20))
    prompts = [prefix + [100 + i for i in range(6)], prefix + [200 + i for i in range(6)], None, list(range(300, 310))]
    prompts[2] = list(prompts[0])
    reqs = make_requests([2] * 4, prompt_lens=[len(p) for p in prompts])
    for req, ids in zip(reqs, prompts):
        req.prompt_token_ids = ids
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, **LOOSE), CacheConfig(num_pages=64, page_size=4, prefix_caching=True), 1000
    )
    executor = ContentCheckingExecutor(sched, tokens=False)
    result = serve(reqs, sched, executor)
    s = summarize(result)
    assert s["prefix_cache_hit_rate"] == pytest.approx(44 / 88)
    assert s["prefix_cache_hit_tokens"] == 44
    # prefill tokens 26 + 6 + 2 + 10, plus one decode each
    assert result.stats.batched_tokens == 26 + 6 + 2 + 10 + 4
    assert all(r.num_generated == 2 for r in reqs)
    # every prompt page is back, and the 6 + 1 + 0 + 2 distinct full prompt pages stay cached
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert sched.allocator.num_cached_pages == 6 + 1 + 2


def test_length_only_requests_share_nothing_under_prefix_caching():
    # no token ids and no synthetic prompt to draw them from: no page of theirs is known, so
    # the second (alone in the slot after the first) matches nothing and prefills its 16 tokens
    reqs = make_requests([2, 2], prompt_lens=[16, 16])
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, **LOOSE), CacheConfig(num_pages=64, page_size=4, prefix_caching=True), 1000
    )
    result = serve(reqs, sched, CheckingExecutor(sched))
    assert [(r.finish_reason, r.num_generated) for r in reqs] == [(FinishReason.LENGTH, 2)] * 2
    assert result.stats.batched_tokens == 2 * (16 + 1)
    assert summarize(result)["prefix_cache_hit_tokens"] == 0 and sched.allocator.num_cached_pages == 0


def test_synthetic_prompts_are_hashed_without_keeping_their_ids():
    # one seed draws the same 16 ids twice: the second request (alone after the first) finds
    # the first's 3 full pages of 4 (the page of its last token is prefilled), yet neither
    # keeps its drawn ids, so a long simulated trace does not hold every prompt in memory
    reqs = make_requests([2, 2], prompt_lens=[16, 16])
    for req in reqs:
        req.synthetic_prompt = (7, 512)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, **LOOSE), CacheConfig(num_pages=64, page_size=4, prefix_caching=True), 1000
    )
    result = serve(reqs, sched, CheckingExecutor(sched))
    assert summarize(result)["prefix_cache_hit_tokens"] == 12
    assert [r.prompt_token_ids for r in reqs] == [None, None]


@pytest.mark.parametrize(
    "preemption,prefix_caching,num_swap_pages,batched,swaps,hit_tokens",
    [
        ("recompute", False, None, 30, 0, 0),
        ("recompute", True, None, 22, 0, 8),  # readmission finds its own 2 prompt pages
        ("swap", False, None, 22, 1, 0),
        ("swap", False, 1, 30, 0, 0),  # 2 pages do not fit 1 host page: recompute instead
    ],
)
def test_preemption_modes_by_hand(preemption, prefix_caching, num_swap_pages, batched, swaps, hit_tokens):
    # 5 usable pages of 4 tokens. A and B: 8-token prompts, 4 tokens out, admitted at t=0.
    # it 1: both prefill (16 tokens, 4 pages). it 2: A takes the last page to decode; B cannot
    # grow and is preempted. it 3, 4: A decodes and finishes; B's readmission needs 3 pages
    # and waits. it 5: B is readmitted with 1 generated token: a recompute prefills 9 tokens;
    # a prefix-cache hit (its 2 full prompt pages, still cached) or a swap-in leaves 1 to
    # process. it 6, 7: B decodes. Batched: 16 + 3 (A) + 9 or 1 + 2 (B) = 30 or 22.
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, preemption=preemption, **LOOSE),
        CacheConfig(num_pages=6, page_size=4, prefix_caching=prefix_caching, num_swap_pages=num_swap_pages),
        1000,
    )
    a, b = make_requests([4, 4], prompt_lens=[8, 8])
    a.prompt_token_ids, b.prompt_token_ids = list(range(8)), list(range(10, 18))
    executor = ContentCheckingExecutor(sched, tokens=False)
    result = serve([a, b], sched, executor)
    assert (a.num_preemptions, b.num_preemptions, result.preemptions) == (0, 1, 1)
    assert (a.finish_s, b.finish_s) == (4, 7)
    assert result.stats.batched_tokens == batched
    assert result.extra["swap_preemptions"] == swaps
    assert result.extra["swapped_out_pages"] == 2 * swaps
    assert result.extra["prefix_cache_hit_tokens"] == hit_tokens
    assert result.extra["prefix_cache_hit_rate"] == 0.0  # first admissions found nothing
    assert not executor.host and sched.swap_used == 0


class EvictLatestPolicy(FCFSPolicy):
    """A head that lacks room evicts the latest admitted request, even one admitted (swapped
    in) earlier in the same plan, while another stays running so every plan makes progress."""

    def preempt_for(self, waiting, scheduler):
        return max(scheduler.running, key=lambda r: r.admit_seq) if len(scheduler.running) > 1 else None


@settings(max_examples=60, deadline=None)
@given(reqs=workloads, num_slots=st.integers(2, 4), num_pages=st.integers(8, 24), page_size=st.sampled_from([2, 4]))
def test_a_swap_in_cancelled_by_the_same_plan_keeps_the_host_copy(reqs, num_slots, num_pages, page_size):
    cfg = SchedulerConfig(max_num_seqs=num_slots, max_num_batched_tokens=64, preemption="swap", chunked_prefill=True)
    cache = CacheConfig(num_pages=num_pages, page_size=page_size, prefix_caching=True)
    sched = Scheduler(cfg, cache, 64, policy=EvictLatestPolicy(cfg))
    requests = make_requests([r[2] for r in reqs], [r[1] for r in reqs], [0.0] * len(reqs))
    for i, (req, r) in enumerate(zip(requests, reqs)):
        req.prompt_token_ids = shared_prefix_ids(i, r[1], r[3], r[4])
    executor = ContentCheckingExecutor(sched)
    serve(requests, sched, executor, max_iterations=5000)
    served_or_rejected = (FinishReason.LENGTH, FinishReason.EOS, FinishReason.MAX_MODEL_LEN, FinishReason.REJECTED)
    assert all(r.finish_reason in served_or_rejected for r in requests)
    assert sched.swap_used == 0 and not executor.host


# ---- pipelined serving: postprocess split into advance (at launch) and commit (tokens) ----


def _pipelined_scheduler(num_slots=2, num_pages=64):
    cfg = SchedulerConfig(max_num_seqs=num_slots, max_num_batched_tokens=64)
    return Scheduler(cfg, CacheConfig(num_pages=num_pages, page_size=4), 1000, eos_token_id=2, vocab_size=100)


def _req(rid, prompt, max_tokens):
    return Request(rid, 0.0, len(prompt), list(prompt), SamplingParams(max_tokens=max_tokens))


def test_advance_then_commit_by_hand_a_late_eos_and_an_early_slot():
    sched = _pipelined_scheduler()
    a, b, c = _req("a", [5, 6, 7], 3), _req("b", [8, 9, 10], 5), _req("c", [11, 12], 2)
    for req in (a, b, c):
        sched.add(req, 0.0)
    p1 = sched.schedule(0.0)
    assert ids(p1.prefills) == ids([a, b]) and not sched.needs_sync()
    sched.advance(p1, 0.0)  # both prefills yield their first token, not on the host yet
    assert (a.num_generated, b.num_generated) == (1, 1) and a.output_token_ids == [] and a.first_token_s is None
    p2 = sched.schedule(0.1)  # planned before p1's tokens are read
    assert ids(p2.decodes) == ids([a, b])
    assert sched.commit(p1, [10, 11], 0.2) == []
    assert (a.output_token_ids, b.output_token_ids, a.first_token_s) == ([10], [11], 0.2)
    sched.advance(p2, 0.2)
    p3 = sched.schedule(0.3)
    assert ids(p3.decodes) == ids([a, b])
    # b's second token is EOS: it ends at commit, after p3 (which holds it) was planned
    assert sched.commit(p2, [12, 2], 0.4) == [b]
    assert (b.finish_reason, b.finish_s, b.output_token_ids) == (FinishReason.EOS, 0.4, [11, 2])
    assert sched.running == [a] and sched.slots[1] is None
    sched.advance(p3, 0.4)  # b's row in p3 is wasted: skipped; a reaches max_tokens=3 and ends
    assert b.num_generated == 2 and a.num_generated == 3
    assert a.is_finished and a.finish_reason is None and a not in sched.finished
    assert sched.running == [] and sched.slots == [None, None]
    p4 = sched.schedule(0.5)  # a's slot and pages serve c before a's last token is read
    assert ids(p4.prefills) == ids([c]) and c.slot == 0
    assert sched.commit(p3, [13, 77], 0.6) == [a]
    assert (a.output_token_ids, a.finish_reason, a.finish_s, a.last_token_s) == ([10, 12, 13], FinishReason.LENGTH, 0.6, 0.6)
    assert b.output_token_ids == [11, 2]  # its wasted row's token is dropped
    with pytest.raises(RuntimeError, match="not the one advanced last"):
        sched.commit(p3, [0], 0.7)
    sched.advance(p4, 0.7)
    with pytest.raises(RuntimeError, match="previous step is not committed"):
        sched.advance(p4, 0.7)
    assert sched.commit(p4, [3], 0.8) == [] and c.output_token_ids == [3]
    assert sched.tbt_s == pytest.approx([0.2, 0.2, 0.2])  # a: 0.2 -> 0.4 -> 0.6; b: 0.2 -> 0.4
    sched.allocator.check_invariants()


def test_a_plan_that_may_preempt_waits_for_the_commit():
    # 9 usable pages of 4 tokens: two requests at 16 tokens hold 8 and need 2 more at 17
    sched = _pipelined_scheduler(num_pages=10)
    a, b = _req("a", list(range(3, 19)), 8), _req("b", list(range(3, 19)), 8)
    for req in (a, b):
        sched.add(req, 0.0)
    p1 = sched.schedule(0.0)
    assert ids(p1.prefills) == ids([a, b]) and len(sched.allocator.page_tables["a"]) == 4
    sched.advance(p1, 0.0)
    assert sched.needs_sync()  # the decodes at 17 tokens need 2 pages, 1 is free
    with pytest.raises(RuntimeError, match="preemption with a step's tokens uncommitted"):
        sched.schedule(0.1)


def ids(items):
    """Request ids of requests or plan entries."""
    return [x.request_id for x in items]


def test_plan_entries_are_immutable_and_written_field_by_field():
    from cbjax.core.plan import ScheduledRequest

    sched = Scheduler(SchedulerConfig(max_num_seqs=2), CacheConfig(num_pages=16, page_size=4), 64)
    req = Request("a", 0.0, 6, sampling=SamplingParams(max_tokens=2, ignore_eos=True), target_output_len=2)
    sched.add(req, 0.0)
    plan = sched.schedule(0.0)
    # 6 prompt tokens on pages of 4: the two lowest pages after the null page 0; knobs sent once
    assert plan.scheduled == [ScheduledRequest(
        request_id="a", slot=0, num_computed=0, num_new_tokens=6, is_decode=False, token_ids=None,
        feed_previous=False, page_table=(1, 2), sampling=req.sampling, yields=True,
    )]  # fmt: skip
    entry = plan.scheduled[0]
    with pytest.raises(AttributeError):
        entry.slot = 1
    assert entry._replace(slot=1).slot == 1 and entry.slot == 0
    sched.postprocess(plan, None, 1.0)
    # the decode of position 6 stays on page 2: no page-table row, no knobs
    assert sched.schedule(1.0).scheduled == [ScheduledRequest("a", 0, 6, 1, True)]


def test_step_results_runs_on_the_parts_it_is_given():
    from cbjax.cache import make_allocator
    from cbjax.scheduler.output import Draft, PlanWriter
    from cbjax.scheduler.results import StepResults
    from cbjax.scheduler.running import RunningSet

    allocator = make_allocator(num_pages=16, page_size=4)
    writer = PlanWriter(2, allocator)
    running_set = RunningSet(2, allocator, writer)
    policy = FCFSPolicy(SchedulerConfig())
    results = StepResults(running_set, writer, policy, allocator, None, token_budget=64, max_model_len=64,
                          eos_token_ids=frozenset({7}))  # fmt: skip
    req = Request("a", 0.0, 3, sampling=SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3])
    req.max_output_len = 4
    allocator.allocate("a", 3, 6, [])
    running_set.admit(req, 0.0)
    req.num_new_tokens = 3
    draft = Draft()
    draft.prefills.append(req)
    plan = writer.write(draft, 0.0)
    results.advance(plan, 0.0)
    assert results.commit(plan, [7], 0.5) == [req]  # the EOS id ends it
    assert req.finish_reason is FinishReason.EOS and req.output_token_ids == [7]
    assert running_set.running == [] and running_set.num_free_slots == 2 and allocator.num_used_pages == 0
