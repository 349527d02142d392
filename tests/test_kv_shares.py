"""Orca-style reservations and the five KV pool shares: hand-computed cases and invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CheckingExecutor, assert_every_request_ends_once, make_requests
from cbjax.cache import make_allocator
from cbjax.cache import ALLOCATIONS
from cbjax.cache.page_hash import ROOT_HASH, chain_hashes
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.report.metrics import KV_SHARES, summarize
from cbjax.scheduler import Scheduler

RESERVATIONS = [a for a in ALLOCATIONS if a != "paged"]


def test_first_fit_runs_merge_on_free_and_strand_pages():
    alloc = make_allocator(num_pages=11, page_size=4, allocation="reserve_oracle")  # pages 1..10
    assert alloc.allocate("a", 9, 12) == [1, 2, 3]
    assert alloc.allocate("b", 1, 12) == [4, 5, 6]
    assert alloc.allocate("c", 12, 12) == [7, 8, 9]
    alloc.free("b")
    assert alloc.free_runs() == [3, 1]  # pages 4-6 and page 10
    assert alloc.num_free_pages == 4 and not alloc.can_allocate(13, 13)  # 4 free, no run of 4
    # a waiting request needing 4 pages can use neither run: all 4 free pages are stranded
    assert alloc.slot_breakdown([("a", 12), ("c", 12)], min_waiting_pages=4) == (21, 3, 0, 16, 0)
    assert alloc.slot_breakdown([("a", 12), ("c", 12)], min_waiting_pages=3) == (21, 3, 0, 4, 12)
    assert alloc.allocate("d", 2, 8) == [4, 5]  # first fit: the lowest run that holds it
    alloc.free("a")
    alloc.free("c")
    assert alloc.free_runs() == [3, 5]  # 1-3 and 6-10 (page 6 merged with 7-9 and 10), d between
    alloc.free("d")
    assert alloc.free_runs() == [10]
    alloc.check_invariants()


def test_a_shared_prefix_page_counts_once_as_token_states():
    alloc = make_allocator(num_pages=9, page_size=4, prefix_caching=True)  # 8 usable pages
    ids = list(range(8))
    alloc.allocate("a", 8, 8)
    alloc.register("a", chain_hashes(ROOT_HASH, ids, 4), 2)
    cached = alloc.match(chain_hashes(ROOT_HASH, ids[:5], 4))
    assert alloc.allocate("b", 6, 6, cached) == [1, 3]  # shares a's first page
    # distinct tokens 4 + 4 + 2; b's second page has 2 slots it never fills; 5 pages free
    assert alloc.slot_breakdown([("a", 8), ("b", 6)], 0) == (10, 0, 2, 0, 20)


def test_reservation_never_grows_past_itself():
    alloc = make_allocator(num_pages=20, page_size=4, allocation="reserve_max")
    alloc.allocate("r", 3, 8)
    alloc.append("r", 8)
    assert not alloc.can_append("r", 9)
    with pytest.raises(ValueError, match="request r: 9 tokens outgrow its reservation of 2 pages"):
        alloc.append("r", 9)


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 40)), max_size=100),
    allocation=st.sampled_from(RESERVATIONS),
    fit=st.sampled_from(["first_fit", "buddy"]),
)
def test_runs_never_overlap_and_all_return(ops, allocation, fit):
    alloc = make_allocator(num_pages=25, page_size=4, allocation=allocation, fit=fit)
    for take, rid, n in ops:
        rid = str(rid)
        if take and rid not in alloc.page_tables and alloc.can_allocate(1, n):
            table = alloc.allocate(rid, 1, n)
            assert len(table) == alloc.admission_pages(1, n) >= alloc.pages_for(n)
        elif not take and rid in alloc.page_tables:
            alloc.free(rid)
        pages = [p for t in alloc.page_tables.values() for p in t]
        assert len(pages) == len(set(pages)) and 0 not in pages
        alloc.check_invariants()
    for rid in list(alloc.page_tables):
        alloc.free(rid)
    assert alloc.free_runs() == [24] and alloc.num_free_pages == 24


@pytest.mark.parametrize(
    "allocation, reserved, internal",
    [("paged", 0.0, 0.0), ("reserve_oracle", 0.1, 0.0), ("reserve_pow2", 0.1, 0.1), ("reserve_max", 0.1, 0.5)],
)
def test_shares_of_one_request_by_hand(allocation, reserved, internal):
    # page_size 1, 10 usable slots; prompt 2, output 3: it stores 2, 3, 4 tokens in its three
    # iterations and will store 4 at the end (the last token's K/V is never written).
    # Reservations: max = 2 + max_tokens 8 - 1 = 9, pow2 = 2 + 4 - 1 = 5, oracle = 4 slots,
    # the slots still to fill being 2, 1, 0 (paged pages of one slot hold nothing in advance).
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(num_pages=11, page_size=1, allocation=allocation, prefix_caching=False),
        max_model_len=100,
    )
    reqs = make_requests([3], prompt_lens=[2], max_tokens=8)
    s = summarize(serve(reqs, sched, CheckingExecutor(sched)))
    assert s["kv_share_token_states"] == pytest.approx((2 + 3 + 4) / 3 / 10)
    assert s["kv_share_reserved"] == pytest.approx(reserved)
    assert s["kv_share_internal_frag"] == pytest.approx(internal)
    assert s["kv_share_external_frag"] == 0.0
    assert s["kv_share_free"] == pytest.approx(1 - 0.3 - reserved - internal)


def test_paged_page_tail_is_reserved_until_the_final_page():
    # page_size 4; prompt 5, output 2 (final 6 tokens): stores 5 then 6 tokens in 2 pages.
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(num_pages=5, page_size=4), 100
    )
    s = summarize(serve(make_requests([2], prompt_lens=[5]), sched, CheckingExecutor(sched)))
    pool = 16
    assert s["kv_share_token_states"] == pytest.approx((5 + 6) / 2 / pool)
    assert s["kv_share_reserved"] == pytest.approx((1 + 0) / 2 / pool)
    assert s["kv_share_internal_frag"] == pytest.approx(2 / pool)


class ShareCheckingExecutor(CheckingExecutor):
    """Also checks each step's five-way split of the pool."""

    def execute(self, plan):
        sched = self.scheduler
        parts = sched.kv_breakdown()
        alloc = sched.allocator
        assert all(p >= 0 for p in parts), parts
        assert sum(parts) == alloc.num_usable_pages * alloc.page_size
        token, _, internal, external, _ = parts
        if alloc.prefix_caching:  # a shared page's tokens count once
            assert token <= min(alloc.num_stored_tokens, alloc.num_used_pages * alloc.page_size)
        else:
            assert token == alloc.num_stored_tokens
        if not alloc.reserve:
            assert external == 0
        if sched.allocation == "paged" or (sched.allocation == "reserve_oracle" and not alloc.buddy):
            assert internal < max(1, len(sched.running)) * alloc.page_size  # page tails only
        return super().execute(plan)


@settings(max_examples=120, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.floats(0, 20), st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=25),
    allocation=st.sampled_from(ALLOCATIONS),
    policy=st.sampled_from(["fcfs", "static"]),
    num_pages=st.integers(8, 40),
    page_size=st.sampled_from([1, 2, 4, 8]),
    chunked=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
    max_tokens=st.sampled_from([None, 40]),
    fit=st.sampled_from(["first_fit", "buddy"]),
    prefix_caching=st.booleans(),
)
def test_the_five_shares_sum_to_one_on_random_workloads(
    reqs, allocation, policy, num_pages, page_size, chunked, preemption, max_tokens, fit, prefix_caching
):
    prefix_caching = prefix_caching and allocation == "paged"
    sched = Scheduler(
        SchedulerConfig(
            name=policy, max_num_seqs=5, max_num_batched_tokens=48, chunked_prefill=chunked, preemption=preemption
        ),
        CacheConfig(
            num_pages=num_pages, page_size=page_size, allocation=allocation, reservation_fit=fit,
            prefix_caching=prefix_caching,
        ),
        max_model_len=64,
    )  # fmt: skip
    requests = make_requests([r[2] for r in reqs], [r[1] for r in reqs], [r[0] for r in reqs], max_tokens)
    for req in requests:
        req.prompt_token_ids = list(range(req.prompt_len))  # prompts share their prefixes
    result = serve(requests, sched, ShareCheckingExecutor(sched))
    assert_every_request_ends_once(sched, requests, result, max_model_len=64)
    s = summarize(result)
    assert sum(s[k] for k in KV_SHARES) == pytest.approx(1.0)
    assert all(0.0 <= s[k] <= 1.0 for k in KV_SHARES)
    if allocation == "paged":
        assert s["kv_share_external_frag"] == 0.0


def test_reservations_reject_prefix_caching_naming_both_keys():
    with pytest.raises(ValueError, match="cache.allocation=reserve_pow2.*cache.prefix_caching"):
        CacheConfig(allocation="reserve_pow2", prefix_caching=True)


def test_buddy_rounds_to_powers_of_two_at_aligned_places():
    alloc = make_allocator(num_pages=17, page_size=4, allocation="reserve_oracle", fit="buddy")  # pages 1..16
    assert alloc.allocate("a", 4, 4) == [1]
    assert alloc.allocate("b", 5, 12) == [5, 6, 7, 8]  # 3 pages round to 4, placed at 1 + 4k
    assert alloc.allocate("c", 5, 8) == [3, 4]  # 2 pages at 1 + 2k: page 2 alone is too small
    assert alloc.allocate("d", 1, 1) == [2]
    assert not alloc.can_allocate(1, 40)  # 10 pages round to 16: 8 free pages, no place
    assert alloc.allocate("e", 1, 20) == list(range(9, 17))  # 5 pages round to 8, at 9
    for rid in "abcde":
        alloc.free(rid)
        alloc.check_invariants()
    assert alloc.free_runs() == [16]
