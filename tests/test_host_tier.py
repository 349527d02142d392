"""The host KV tier in the scheduler and the simulator: a hand-computed case, the tier's own
rules (inclusive copies, pinned loads, one pool with swap, eviction policies), both tiers'
invariants over a long run, and bad configs failing with the field's name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tier_sessions import HAND_DEVICE_PAGES, HAND_HOST_PAGES, HAND_ORDER, HAND_PAGE_SIZE, fresh, hand_sessions
from cbjax.cache.eviction import HostEviction, LruEviction, make_host_eviction
from cbjax.cache.host_tier import HostTier
from cbjax.config import CacheConfig, HardwareConfig, SchedulerConfig
from cbjax.core.plan import Schedule
from cbjax.core.request import Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.report.metrics import request_row, summarize
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost

HAND_SCHED = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
HAND_CACHE = CacheConfig(num_pages=HAND_DEVICE_PAGES, page_size=HAND_PAGE_SIZE, host_pages=HAND_HOST_PAGES)

# Worked by hand: 6 device pages, 8 host pages, both LRU. A turn takes its prompt's pages at
# admission (cached ones shared, then free ones, then the least recently cached evicted), one
# more for its decode, and at its end frees its partial last page and caches its full ones,
# last first. Xn is session X's page n; "evicts" stores the page to host memory unless noted.
#   A0: 2 pages, +1; ends: cached A2 A1
#   A1: A1 A2 on the device (8 tokens), +1 (A3), +1; ends: cached A3 A2 A1
#   B0: 2 pages, +1; ends: cached A3 A2 A1 B2 B1, 1 page free
#   B1: B1 B2 on the device, +1 (B3) from the free page; its decode evicts A3. Host: A3
#   C0: evicts A2, then A1. Host: A3 A2 A1
#   C1: C1 C2 on the device; its decode evicts B3. Host: A3 A2 A1 B3
#   A2: loads A1 A2 A3 (12 tokens); evicts B2 B1 C3, its decode C2. Host: 8 pages, full
#   B2: loads B1 B2 B3 (12); evicts C1 (dropping A1), A4 (dropping A2), A3 (in host memory:
#       no copy); its decode evicts A2 (dropping C3)
#   C2: loads C1 C2 (8; C3 was dropped); evicts A1 (dropping B1), B4 (dropping B2), B3 (in
#       host memory); its decode evicts B2 (dropping A4)
# 16 device evictions, 14 stores, 8 loads, 6 pages dropped from the tier.
HAND_DEVICE_HITS = {"A0": 0, "A1": 8, "B0": 0, "B1": 8, "C0": 0, "C1": 8, "A2": 0, "B2": 0, "C2": 0}
HAND_HOST_HITS = {"A0": 0, "A1": 0, "B0": 0, "B1": 0, "C0": 0, "C1": 0, "A2": 12, "B2": 12, "C2": 8}
HAND_COUNTS = {
    "kv_host_pages_stored": 14, "kv_host_pages_loaded": 8, "kv_host_evictions": 6, "prefix_cache_evictions": 16,
    "kv_host_pages_peak": 8, "prefix_hit_tokens_device": 24, "prefix_hit_tokens_host": 32,
}  # fmt: skip


def hand_summary(sched, result):
    summary = summarize(result)
    return {k: summary[k] for k in HAND_COUNTS}


def test_the_hand_computed_case_in_the_simulator():
    sched = Scheduler(HAND_SCHED, HAND_CACHE, 128)
    reqs = hand_sessions()
    result = serve(reqs, sched, SimExecutor(UnitCost()))
    assert [r.request_id for r in reqs] == list(HAND_ORDER)
    assert all(r.num_generated == 2 and r.scheduled_s == r.arrival_s for r in reqs)  # each ran alone
    assert {r.request_id: r.prefix_hit_tokens_device for r in reqs} == HAND_DEVICE_HITS
    assert {r.request_id: r.prefix_hit_tokens_host for r in reqs} == HAND_HOST_HITS
    assert hand_summary(sched, result) == HAND_COUNTS
    assert sched.tier.num_used == HAND_HOST_PAGES and sched.allocator.num_used_pages == 0
    summary = summarize(result)
    assert summary["prefix_hit_rate_device"] == 24 / 108 and summary["prefix_hit_rate_host"] == 32 / 108
    row = request_row(reqs[6])
    assert (row["prefix_hit_tokens_device"], row["prefix_hit_tokens_host"], row["kv_load_s"]) == (0, 12, 0.0)


def test_policies_see_each_tiers_cached_pages_through_their_view():
    sched = Scheduler(HAND_SCHED, HAND_CACHE, 128)
    reqs = hand_sessions()
    serve(reqs[:6], sched, SimExecutor(UnitCost()))  # A0 .. C1, as in the hand-computed case
    a2, b2 = fresh(reqs[6]), fresh(reqs[7])
    # the device holds B1, B2 (B1's pages) and C's; A's three pages and B3 went to host memory
    assert sched.view.cached_pages(a2) == (0, 3) and sched.view.cached_pages(b2) == (2, 1)
    assert sched.view.num_host_pages_free == HAND_HOST_PAGES - 4


def test_without_a_tier_rows_and_summary_keep_their_keys():
    sched = Scheduler(HAND_SCHED, dataclasses.replace(HAND_CACHE, host_pages=0), 128)
    reqs = hand_sessions()
    result = serve(reqs, sched, SimExecutor(UnitCost()))
    summary = summarize(result)
    assert sched.tier is None and "prefix_hit_rate_host" not in summary and "kv_host_pages_stored" not in summary
    assert "prefix_hit_tokens_host" not in request_row(reqs[6])
    # without the tier A2, B2 and C2 recompute what it would have loaded
    assert summary["prefix_cache_hit_tokens"] == 24


def test_loads_cost_bandwidth_and_copy_calls_on_the_roofline_and_fill_kv_load_s():
    from cbjax.config import ModelConfig, OverheadConfig
    from cbjax.sim.cost import RooflineCost

    model = ModelConfig(max_model_len=128)  # tiny: 2 layers, 512 K/V bytes a token, 2048 a page of 4
    # a page: 2048 bytes over 1 GB/s, and a copy call per layer and K or V of 1e-4 s
    page_s = 2048 / 1e9 + 4 * 1e-4
    sched = Scheduler(HAND_SCHED, HAND_CACHE, 128)
    reqs = hand_sessions()
    serve(reqs, sched, SimExecutor(RooflineCost(model, HardwareConfig(host_bw=1e9), OverheadConfig(copy_latency_s=1e-4))))
    loads = {r.request_id: r.kv_load_s for r in reqs if r.kv_load_s}
    assert loads == pytest.approx({"A2": 3 * page_s, "B2": 3 * page_s, "C2": 2 * page_s})


def plan_with(store=(), load=(), prefetch=(), page_size=4, rows=()):
    from cbjax.core.plan import HostCopies

    plan = Schedule(4, list(rows), page_size=page_size)
    plan.host_copies = HostCopies(tuple(store), tuple(load), tuple(prefetch))
    return plan


def test_the_roofline_prices_each_direction_and_runs_prefetches_beside_the_step():
    from cbjax.config import ModelConfig, OverheadConfig
    from cbjax.sim.cost import RooflineCost, WithOverhead

    # a page's 2048 bytes take 1 s; its copy calls (2 layers, K and V) 4 x 0.125 s
    stack = OverheadConfig(copy_latency_s=0.125)
    cost = RooflineCost(ModelConfig(), HardwareConfig(host_bw=2048.0), stack)
    plan = plan_with(store=[(1, 0), (2, 1)], load=[("r", (3,), (4,))], prefetch=[("w", (5, 6, 7), (8, 9, 10))])
    t = cost(plan)
    assert (t.copy_s, t.load_s, t.prefetch_s) == (3.0 + 1.5, 1.5, 4.5)
    assert t.total_s == t.device_s + t.host_s + 4.5  # the prefetch is not in the step
    bare = RooflineCost(ModelConfig(), HardwareConfig(host_bw=2048.0))(plan)
    assert (bare.copy_s, bare.load_s, bare.prefetch_s) == (3.0, 1.0, 3.0)
    # a stack over another model (the profiled one) adds its calls the same way
    over = WithOverhead(RooflineCost(ModelConfig(), HardwareConfig(host_bw=2048.0)), ModelConfig(), stack)(plan)
    assert (over.copy_s, over.load_s, over.prefetch_s) == (4.5, 1.5, 4.5)


def test_a_row_reading_a_prefetched_page_waits_for_its_copy_on_the_timeline():
    from cbjax.core.plan import ScheduledRequest
    from cbjax.core.timing import StepTime
    from cbjax.sim.timeline import Timeline

    class Priced:
        name, history = "priced", 0

        def __call__(self, plan, ctx=None):
            c = plan.host_copies
            return StepTime(1.0, prefetch_s=5.0 if c is not None and c.prefetch else 0.0)

    timeline = Timeline(Priced())
    assert timeline.run(plan_with(prefetch=[("w", (0,), (7,))]), 0.0) == (1.0, 1.0)  # runs beside the copy
    other = ScheduledRequest("x", 0, 0, 1, False, page_table=(3,))
    assert timeline.run(Schedule(4, [other], page_size=4), 1.0) == (1.0, 2.0)  # reads no prefetched page
    reader = ScheduledRequest("w", 1, 0, 1, False, page_table=(7, 8))
    assert timeline.run(Schedule(4, [reader], page_size=4), 2.0) == (1.0, 6.0)  # begins when the copy ends at 5
    again = ScheduledRequest("y", 2, 0, 1, False, page_table=(7,))
    assert timeline.run(Schedule(4, [again], page_size=4), 6.0) == (1.0, 7.0)  # the copy is long over


class Recorder(LruEviction):
    name = "recorder"


class NotAPolicy:
    pass


def tier(num_pages=3, eviction="lru", swap_used=lambda: 0):
    return HostTier(num_pages, 4, eviction, swap_used=swap_used)


def test_the_tier_is_inclusive_and_keeps_pinned_pages():
    t = tier(num_pages=2)
    t.stored(5, 105)
    t.stored(6, 106)
    t.flush(Schedule(4, step_id=1))
    assert t.match([105, 106, 107], 0) == [0, 1] and t.match([105, 106], 1) == [1]
    t.pin([0])  # a load of this plan reads host page 0 (hash 105)
    t.stored(7, 107)  # full: the least recent droppable page goes, 0 being pinned
    assert t.match([105], 0) == [0] and t.match([106], 0) == [] and t.num_dropped == 1
    t.stored(9, 105)  # already in host memory: no copy
    plan = Schedule(4, step_id=2)
    t.flush(plan)
    assert plan.host_copies.store == ((7, 1),) and t.num_stored == 3
    t.check_invariants()


def test_a_load_whose_device_page_is_evicted_in_its_own_plan_is_dropped_and_not_stored():
    t = tier()
    t.stored(5, 105)
    t.flush(Schedule(4, step_id=1))
    req = Request("r", 0.0, 8)
    t.pin([0])
    t.load(req, [0], [9])
    assert t.loading("r")
    t.stored(9, 105)  # the page the load writes is evicted before the plan runs
    plan = Schedule(4, step_id=2)
    t.flush(plan)
    assert plan.host_copies is None and t.num_loaded == 0 and t.num_stored == 1
    t.check_invariants()


def test_swap_outs_take_the_shared_pool_first():
    swapped = [0]
    t = tier(num_pages=3, swap_used=lambda: swapped[0])
    for page in range(3):
        t.stored(page + 1, 100 + page)
    t.flush(Schedule(4, step_id=1))
    swapped[0] = 2  # two host pages go to a swap-out
    t.flush(Schedule(4, step_id=2))
    assert t.num_used == 1 and t.match([102], 0) == [2]  # the two least recent were dropped
    t.stored(9, 109)  # room for one more only by dropping the last
    assert t.num_used == 1 and t.match([109], 0) != []
    t.flush(Schedule(4, step_id=3))
    t.check_invariants()


def test_session_eviction_keeps_the_pages_of_sessions_whose_next_turn_is_expected():
    t = tier(num_pages=2, eviction="session")
    t.tag([1], "a")
    t.tag([2], "b")
    t.stored(1, 101)  # a's page is the least recent
    t.stored(2, 102)
    t.turn_ended(Request("a0", 0.0, 8, session_id="a", more_turns=True))
    t.turn_ended(Request("b0", 0.0, 8, session_id="b", more_turns=False))
    t.stored(3, 103)
    assert t.match([101], 0) != [] and t.match([102], 0) == []  # b's went although more recent
    lru = tier(num_pages=2)
    for page in (1, 2, 3):
        lru.stored(page, 100 + page)
    assert lru.match([101], 0) == []


def test_a_rejected_turn_ends_the_wait_for_its_session_under_session_eviction():
    # 6 device pages and 3 host pages of 4 tokens, one request at a time. A0 ends expecting a
    # next turn, which is rejected (40 tokens, max_model_len 32): A is expected no more. C0
    # evicts A's pages (host: A2 A1), D0 evicts B0's (B2, then B1, which drops the least
    # recent page of a session not expected: A2). B0's continuation finds both B pages.
    def req(name, t, ids, session=None, more=False):
        sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        return Request(name, t, len(ids), prompt_token_ids=list(ids), sampling=sampling, session_id=session,
                       turn=int(name[1]) if session else 0, more_turns=more)  # fmt: skip

    a, b = list(range(100, 108)), list(range(200, 208))
    reqs = [
        req("A0", 0.0, a, "A", True), req("A1", 10.0, a + list(range(108, 140)), "A"), req("B0", 20.0, b),
        req("C0", 30.0, range(300, 316)), req("D0", 40.0, range(400, 408)), req("B1", 50.0, b + [208, 209, 210, 211]),
    ]  # fmt: skip
    cache = CacheConfig(num_pages=7, page_size=4, host_pages=3, host_eviction="session")
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), cache, 32)
    serve(reqs, sched, SimExecutor(UnitCost()))
    assert reqs[1].finish_reason.value == "rejected"
    assert not sched.tier.eviction.view.expected("A")
    assert (reqs[5].prefix_hit_tokens_device, reqs[5].prefix_hit_tokens_host) == (0, 8)


def test_a_turn_served_by_another_replica_ends_the_wait_for_its_session_here():
    from cbjax.cluster import ClusterSim
    from cbjax.config import ClusterConfig, RunConfig

    # round robin sends each session's turns to alternate replicas (A0 to 0, A1 to 1, ...);
    # every session's last turn ends the run, so no replica expects a turn of any session
    cache = dataclasses.replace(HAND_CACHE, host_eviction="session")
    cfg = RunConfig(cluster=ClusterConfig(replicas=2), scheduler=HAND_SCHED, cache=cache, progress=False)
    cluster = ClusterSim(cfg, lambda c: SimExecutor(UnitCost()))
    reqs = hand_sessions()
    cluster.serve(reqs)
    assert [cluster.row_extras(r)["replica"] for r in reqs] == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    views = [replica.scheduler.tier.eviction.view for replica in cluster.replicas]
    assert [[s for s in "ABC" if view.expected(s)] for view in views] == [[], []]


def test_under_prefill_decode_disaggregation_rows_carry_their_prefills_hits():
    from cbjax.cluster import ClusterSim
    from cbjax.config import ClusterConfig, RunConfig

    # The prefill replica serves each turn's one-token copy alone, in the hand-computed case's
    # order, with no decode page. Host (LRU, pins touch before the allocation evicts):
    #   A0, A1 (A1 A2 on the device, +A3), B0, B1 likewise; C0 evicts A3 A2; C1 A1
    #   A2: loads A1 A2 A3 (12 tokens); evicts B3 B2 B1 C3. Host: A1 A2 A3 B3 B2 B1 C3
    #   B2: loads B1 B2 B3 (12); evicts C2, C1 (dropping A1), A4 (dropping A2), A3 (kept)
    #   C2: loads C1 C2 C3 (12)
    cfg = RunConfig(cluster=ClusterConfig(prefill_replicas=1, decode_replicas=1), scheduler=HAND_SCHED,
                    cache=HAND_CACHE, progress=False)  # fmt: skip
    reqs = hand_sessions()
    result = ClusterSim(cfg, lambda c: SimExecutor(UnitCost())).serve(reqs)
    rows = {r.request_id: request_row(r) for r in reqs}
    assert {k: row.get("prefix_hit_tokens_device") for k, row in rows.items()} == HAND_DEVICE_HITS
    assert {k: row.get("prefix_hit_tokens_host") for k, row in rows.items()} == {**HAND_HOST_HITS, "C2": 12}
    assert all(row.get("kv_load_s") == 0.0 for row in rows.values())  # a unit step copies in no time
    summary = summarize(result)
    assert (summary["prefix_hit_tokens_device"], summary["prefix_hit_tokens_host"]) == (24, 36)


def test_a_host_eviction_class_from_the_users_code():
    view = object()
    assert isinstance(make_host_eviction(f"{__name__}:Recorder", view), Recorder)
    with pytest.raises(ValueError, match="cache.host_eviction"):
        make_host_eviction(f"{__name__}:NotAPolicy", view)
    with pytest.raises(ValueError, match="cache.host_eviction"):
        make_host_eviction("fifo", view)
    assert issubclass(Recorder, HostEviction)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"host_pages": -1}, "cache.host_pages"),
        ({"host_pages": 1.5}, "cache.host_pages"),
        ({"host_pages": 8, "host_eviction": "no module:X"}, "cache.host_eviction"),
        ({"host_prefetch": True}, "cache.host_prefetch"),
        ({"host_pages": 8, "prefix_caching": False}, "cache.host_pages"),
    ],
)
def test_a_bad_tier_config_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        CacheConfig(**kwargs)


def test_an_unknown_host_eviction_names_its_field_and_the_choices():
    from cbjax.app.choices import check_choices
    from cbjax.config import RunConfig

    with pytest.raises(ValueError, match=r"cache\.host_eviction: unknown value 'fifo'; choose one of lru, session"):
        check_choices(RunConfig(cache=CacheConfig(host_pages=8, host_eviction="fifo")))
    with pytest.raises(ValueError, match=r"cache\.host_eviction: .*is not a subclass of cbjax\.cache\.HostEviction"):
        Scheduler(HAND_SCHED, dataclasses.replace(HAND_CACHE, host_eviction=f"{__name__}:NotAPolicy"), 128)


def test_the_swap_share_of_a_tiers_pool():
    assert CacheConfig(num_pages=64, host_pages=16).swap_capacity == 16
    assert CacheConfig(num_pages=64, host_pages=16, num_swap_pages=4).swap_capacity == 4
    assert CacheConfig(num_pages=64, host_pages=16, num_swap_pages=40).swap_capacity == 16
    assert CacheConfig(num_pages=64).swap_capacity == 64


def long_run_requests(num_sessions, seed=0):
    """Sessions of 1 to 12 turns, pauses between them (think time, or a tool call's long tail),
    over a pool small enough that requests preempt each other and tiers overflow."""
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(num_sessions):
        t0 = float(rng.uniform(0, 400))
        ids = rng.integers(0, 512, int(rng.integers(4, 40))).tolist()
        num_turns = int(rng.integers(1, 13))
        for t in range(num_turns):
            if t:
                ids = ids + rng.integers(0, 512, int(rng.integers(2, 16))).tolist()
                t0 += float(rng.choice([rng.exponential(2.0), rng.pareto(1.5) * 5.0]))
            reqs.append(Request(
                f"s{s}t{t}", t0, len(ids), prompt_token_ids=list(ids),
                sampling=SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True),
                session_id=f"s{s}", turn=t, more_turns=t < num_turns - 1,
            ))  # fmt: skip
    return reqs


def test_both_tiers_invariants_hold_after_every_step_of_a_long_run():
    reqs = sorted(long_run_requests(900), key=lambda r: r.arrival_s)[:5000]
    assert len(reqs) == 5000
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption="swap", chunked_prefill=True),
        CacheConfig(num_pages=80, page_size=4, host_pages=64, num_swap_pages=32, host_eviction="session",
                    host_prefetch=True),
        256,
    )  # fmt: skip
    steps = [0]

    def check(plan, end, batched, requests):
        steps[0] += 1
        sched.allocator.check_invariants()
        sched.tier.check_invariants()
        assert sched.tier.num_used + sched.waiting.swap_used <= sched.tier.num_pages or not sched.tier.num_used

    result = serve(reqs, sched, SimExecutor(UnitCost()), on_step=check, stretches=False)
    summary = summarize(result)
    assert steps[0] == result.stats.iterations > 5000
    assert summary["num_finished"] == 5000
    assert summary["swap_preemptions"] > 0
    assert summary["kv_host_pages_loaded"] > summary["kv_host_pages_prefetched"] > 0
    assert summary["kv_host_evictions"] > 0
    assert sched.allocator.num_used_pages == 0  # the device holds nothing but cached pages
    # the host pool holds exactly the tier's cached pages: every swapped-out copy went back
    assert sched.tier.num_used + sched.waiting.swap_used == len(sched.tier._page_of) > 0
    assert not sched.tier._prefetched
