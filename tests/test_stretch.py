"""Decode stretches (cbjax.scheduler.stretch, cbjax.engine.loop.run_stretch): several steps of
the same decodes run as one plan must give exactly the results of the same steps run one at a time,
to the last bit: every request's times and fate, every counter, every token gap, every
service-log entry; and the stretch's pricing must equal pricing the steps one by one."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cbjax.cluster import ClusterSim
from cbjax.config import (
    CacheConfig, ClusterConfig, ExecutorConfig, HardwareConfig, LengthConfig, ModelConfig, OverheadConfig, PauseConfig,
    RunConfig, SchedulerConfig, WorkloadConfig,
)  # fmt: skip
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request, SamplingParams
from cbjax.engine.loop import EngineLoop
from cbjax.engine.offline import serve
from cbjax.report.metrics import request_row, summarize
from cbjax.report.service import ServiceLog
from cbjax.scheduler.core import Scheduler
from cbjax.sim import SimExecutor, make_cost_model
from cbjax.sim.timeline import Timeline, shifted
from cbjax.workload import build_workload

LLAMA = ModelConfig(name="llama", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    head_dim=128, ffn_dim=14336, max_model_len=4096)  # fmt: skip


def cache(**kw) -> CacheConfig:
    """A pool without prefix caching unless a case turns it on (its own case covers it)."""
    return CacheConfig(**{"prefix_caching": False, **kw})


def config(**kw) -> RunConfig:
    base = dict(
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
        cache=cache(page_size=16, num_pages=400),
        workload=WorkloadConfig(
            num_requests=120, arrival="poisson", rate=6.0, prompt_len=LengthConfig(dist="uniform", low=16, high=600),
            output_len=LengthConfig(dist="uniform", low=1, high=300),
        ),
        executor=ExecutorConfig(name="sim", cost_model="roofline"),
        model=LLAMA,
        hardware=HardwareConfig(),
        progress=False,
    )
    base.update(kw)
    return RunConfig(**base)


def everything(requests, result, log: ServiceLog) -> dict:
    """Every output of a run that a stretch could change."""
    return {
        "rows": [request_row(r) for r in sorted(requests, key=lambda r: r.request_id)],
        "summary": {k: v for k, v in summarize(result).items() if k not in ("wall_s", "scheduler_host_s")},
        "tbt": list(result.tbt_s),
        "stats": {k: v for k, v in dataclasses.asdict(result.stats).items() if k not in ("schedule_s", "postprocess_s")},
        # a cluster's replicas share one log, each writing its own steps: which replica writes
        # first may differ, so the log is compared as a set of (time, entry); every figure
        # drawn from it sums whole numbers of tokens, whatever the order
        "service": (
            sorted(zip(log.end_s, log.batch, log.batched_tokens)),
            sorted((log.end_s[it], client, p, g) for it, client, p, g in log.events),
        ),
        "makespan": result.makespan_s,
    }


def pages_taken(sched: Scheduler) -> list[int]:
    """Every page the scheduler's allocator hands out, in order, from now on."""
    alloc, taken = sched.allocator, []
    real = alloc._take

    def take(n, after=None, owner=None):
        pages = real(n, after, owner)
        taken.extend(pages)
        return pages

    alloc._take = take
    return taken


def run_single(cfg: RunConfig, stretches: bool, counter: list, grown: list | None = None, evicted: list | None = None):
    """One run; `stretches` False: every plan comes from the planner (no stretch writes any).
    `evicted` gets the cached pages each stretch of several steps evicted."""
    requests = build_workload(cfg.workload, cfg.seed)
    sched = Scheduler(cfg.scheduler, cfg.cache, cfg.model.max_model_len)
    if not stretches:
        sched.stretch = None
    real = sched.schedule_stretch

    def counted(now, num_steps):
        counter.append(num_steps)
        before = sched.allocator.num_evictions
        plan = real(now, num_steps)
        if evicted is not None and num_steps > 1:
            evicted.append(sched.allocator.num_evictions - before)
        if grown is not None:
            grown.extend(g for g in sched.stretch.growth if g[0] > 0)  # pages an inner step took
        return plan

    sched.schedule_stretch = counted
    taken = pages_taken(sched)
    cost = make_cost_model(cfg.executor.cost_model, cfg.model, cfg.hardware, overhead=cfg.overhead)
    log = ServiceLog()
    result = serve(requests, sched, SimExecutor(cost), on_step=log.on_step, stretches=stretches)
    hit_rate = sched.prefix.hit_rate if sched.prefix is not None else None
    return {**everything(requests, result, log), "pages": taken, "hit_rate": hit_rate}


CASES = {
    "fcfs": {},
    "mlfq": dict(scheduler=SchedulerConfig(name="mlfq", max_num_seqs=16, max_num_batched_tokens=2048)),
    "vtc": dict(scheduler=SchedulerConfig(name="vtc", max_num_seqs=16, max_num_batched_tokens=2048)),
    "priority_swap": dict(
        scheduler=SchedulerConfig(name="priority", max_num_seqs=16, max_num_batched_tokens=2048, preemption="swap"),
        cache=cache(page_size=16, num_pages=120, num_swap_pages=400),
    ),
    "chunked_small_pool": dict(
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, chunked_prefill=True),
        cache=cache(page_size=16, num_pages=120),
    ),
    # a chunk leaves each prompt's last token alone: that row is planned as a decode, yet it
    # yields the request's first token, which a stretch's inner steps never do
    "prefill_tail": dict(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=39, chunked_prefill=True),
        workload=WorkloadConfig(num_requests=6, arrival="poisson", rate=0.2, prompt_len=LengthConfig(value=40),
                                output_len=LengthConfig(value=12)),
    ),
    "prefix_caching": dict(cache=cache(page_size=16, num_pages=400, prefix_caching=True),
                           workload=WorkloadConfig(name="shared_prefix", num_requests=120, arrival="poisson", rate=6.0)),
    "reserve_pow2": dict(cache=cache(page_size=16, num_pages=2000, allocation="reserve_pow2")),
    "reserve_oracle_sjf": dict(scheduler=SchedulerConfig(name="sjf", max_num_seqs=16, max_num_batched_tokens=2048),
                               cache=cache(page_size=16, num_pages=700, allocation="reserve_oracle")),
    # a host tier: stretches end at page boundaries, evicted pages are stored on the host and
    # later requests load them back (with prefetch: while they wait)
    "host_tier": dict(cache=cache(page_size=4, num_pages=200, prefix_caching=True, host_pages=400),
                      workload=WorkloadConfig(name="shared_prefix", num_requests=120, arrival="poisson", rate=6.0)),
    "host_tier_session_prefetch": dict(
        cache=cache(page_size=4, num_pages=200, prefix_caching=True, host_pages=400, host_eviction="session", host_prefetch=True),
        workload=WorkloadConfig(name="sessions", num_sessions=12, arrival="poisson", rate=3.0, turns=LengthConfig(dist="fixed", value=3),
                                prompt_len=LengthConfig(dist="uniform", low=8, high=100), output_len=LengthConfig(dist="uniform", low=4, high=80),
                                pause=PauseConfig(dist="fixed", value=0.3)),
    ),
    "unit_cost": dict(executor=ExecutorConfig(name="sim", cost_model="unit")),
    "page_overhead": dict(overhead=OverheadConfig(name="test", step_s=2e-3, seq_s=1e-4, page_s=1e-6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stretch_gives_the_results_of_its_steps_one_by_one(case):
    cfg = config(**CASES[case])
    stretched, single = [], []
    out = run_single(cfg, True, stretched)
    assert out == run_single(cfg, False, single)
    assert not single and stretched and max(stretched) > 2, case  # stretches ran, and only where asked
    if case.startswith("host_tier"):  # the tier stored pages, and later turns loaded them back
        assert out["summary"]["prefix_hit_tokens_host"] > 0 and out["summary"]["kv_host_pages_stored"] > 0
    if case.endswith("prefetch"):
        assert out["summary"]["kv_host_pages_prefetched"] > 0


@pytest.mark.parametrize("num_pages", [400, 90])
def test_a_stretch_takes_new_pages_as_its_steps_one_by_one_would(num_pages):
    """Stretches run across page boundaries, the same pages taken in the same order; with a
    small pool, also up to the step whose page the pool lacks."""
    cfg = config(cache=cache(page_size=4, num_pages=num_pages))
    stretched, grown = [], []
    assert run_single(cfg, True, stretched, grown) == run_single(cfg, False, [])
    assert grown and max(stretched) > 4  # inner steps of stretches took pages


# Prefix caching: a stretch's new pages evict cached ones as the planner's steps would, and a
# session's turn that another follows learns the ids of the pages it fills (they register).
PREFIX_CASES = {
    "evicting": dict(cache=cache(page_size=4, num_pages=90, prefix_caching=True)),
    # stretches of last turns take pages, those with a turn another follows do not (with seed
    # 36 one of the latter follows one of the former)
    "sessions": dict(
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, chunked_prefill=True),
        cache=cache(page_size=8, num_pages=400, prefix_caching=True), seed=36,
        workload=WorkloadConfig(name="sessions", num_sessions=10, arrival="poisson", rate=2.0,
                                turns=LengthConfig(dist="fixed", value=3), prompt_len=LengthConfig(dist="uniform", low=8, high=100),
                                output_len=LengthConfig(dist="uniform", low=4, high=80), pause=PauseConfig(dist="fixed", value=0.3)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PREFIX_CASES))
def test_a_stretch_under_prefix_caching_gives_the_results_of_its_steps_one_by_one(case):
    cfg = config(**PREFIX_CASES[case])
    stretched, grown, evicted = [], [], []
    out = run_single(cfg, True, stretched, grown, evicted)
    assert out == run_single(cfg, False, [])
    assert grown and max(stretched) > 4, case  # inner steps of stretches took pages
    if case == "evicting":
        assert sum(evicted) > 0  # and evicted cached pages for them
    else:
        assert out["hit_rate"] > 0  # later turns found the pages turns before them filled


def test_a_stretch_leaves_no_page_to_register_for_its_last_step():
    """Two turns of one seeded stream, each followed by another (so their generated tokens are
    known), fill the page of the same tokens two steps apart, the later one first in running
    order. Each step registers what it filled: the earlier filler's page holds the hash, and
    the other's page goes free when it ends. A stretch that skipped those registrations to its
    last step would give the hash to the first in running order and free the other page."""

    def requests():
        turns = [Request(rid, 0.0, prompt, synthetic_prompt=(5, 1000), more_turns=True, target_output_len=20,
                         sampling=SamplingParams(max_tokens=20, ignore_eos=True)) for rid, prompt in (("a", 9), ("b", 10))]
        later = [Request(rid, t, prompt, synthetic_prompt=(seed, 1000), target_output_len=4,
                         sampling=SamplingParams(max_tokens=4, ignore_eos=True)) for rid, t, prompt, seed in (("c", 50.0, 16, 5), ("d", 60.0, 40, 6))]
        return turns + later  # fmt: skip

    def run(stretches: bool) -> dict:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                          cache(page_size=4, num_pages=40, prefix_caching=True), 4096)  # fmt: skip
        if not stretches:
            sched.stretch = None
        taken, counter = pages_taken(sched), []
        real = sched.schedule_stretch
        sched.schedule_stretch = lambda now, num_steps: counter.append(num_steps) or real(now, num_steps)
        log, reqs = ServiceLog(), requests()
        result = serve(reqs, sched, SimExecutor(make_cost_model("unit", LLAMA, HardwareConfig())), on_step=log.on_step,
                       stretches=stretches)  # fmt: skip
        return {**everything(reqs, result, log), "pages": taken, "stretched": bool(counter)}

    stretched, single = run(True), run(False)
    assert stretched.pop("stretched") and not single.pop("stretched")
    assert stretched == single


# least_kv reads each replica's free pages, which steps priced ahead take as they begin (under
# prefix caching, evicting cached pages); prefix_affinity routes on its own index
@pytest.mark.parametrize("cluster", [dict(replicas=3, router="least_loaded"), dict(replicas=3, router="least_kv"),
                                     dict(prefill_replicas=1, decode_replicas=2), dict(replicas=3, router="prefix_affinity")])  # fmt: skip
def test_a_clusters_stretches_give_the_results_of_their_steps_one_by_one(cluster):
    cfg = config(cluster=ClusterConfig(**cluster), workload=dataclasses.replace(config().workload, rate=12.0))
    if cluster.get("router") == "prefix_affinity":
        cfg = config(cluster=ClusterConfig(**cluster), cache=cache(page_size=16, num_pages=150, prefix_caching=True),
                     workload=WorkloadConfig(name="shared_prefix", num_requests=120, arrival="poisson", rate=12.0))  # fmt: skip
    out = {}
    for stretches in (True, False):
        sim = ClusterSim.__new__(ClusterSim)
        ClusterSim.__init__(sim, cfg, lambda rcfg: SimExecutor(make_cost_model("roofline", rcfg.model, rcfg.hardware)))
        # the same cluster, its loops told to run their steps one at a time or not
        for replica in sim.replicas:
            replica.loop.stretches = stretches and replica.loop.stretches
            if not stretches:
                replica.loop.scheduler.stretch = None
        requests = build_workload(cfg.workload, cfg.seed)
        result = sim.serve(requests)
        out[stretches] = everything(requests, result, sim.service_log)
    assert out[True] == out[False]


def random_config(rng: random.Random) -> RunConfig:
    """A small run drawn from the knobs a stretch meets: page size, pool size, policy, budget,
    chunking, preemption, prefix caching, shared prefixes and sessions."""
    sched = SchedulerConfig(name=rng.choice(["fcfs", "priority", "mlfq", "vtc"]), max_num_seqs=rng.choice([4, 16]),
                            max_num_batched_tokens=rng.choice([256, 2048]), chunked_prefill=rng.random() < 0.5,
                            preemption=rng.choice(["recompute", "swap"]))
    pool = cache(page_size=rng.choice([4, 8, 16]), num_pages=rng.choice([60, 90, 150, 400]),
                 prefix_caching=rng.random() < 0.7, num_swap_pages=200)
    workload = rng.choice([
        config().workload,
        WorkloadConfig(name="shared_prefix", num_requests=60, arrival="poisson", rate=rng.choice([2.0, 12.0])),
        WorkloadConfig(name="sessions", num_sessions=10, arrival="poisson", rate=2.0, turns=LengthConfig(dist="fixed", value=3),
                       prompt_len=LengthConfig(dist="uniform", low=8, high=100), output_len=LengthConfig(dist="uniform", low=4, high=80),
                       pause=PauseConfig(dist="fixed", value=0.3)),
    ])  # fmt: skip
    return config(scheduler=sched, cache=pool, workload=workload, seed=rng.randrange(1000))


def test_random_configurations_run_stretched_as_one_by_one():
    rng = random.Random(1)
    for _ in range(40):
        cfg = random_config(rng)
        assert run_single(cfg, True, []) == run_single(cfg, False, []), cfg


def test_the_roofline_prices_a_stretch_as_its_steps_one_by_one():
    cost = make_cost_model("roofline", LLAMA, HardwareConfig())
    rows = [ScheduledRequest(str(i), i, ctx, 1, True, None, False, None, None, True) for i, ctx in enumerate((5, 700, 33))]
    plan = Schedule(num_slots=4, scheduled=rows, page_size=16)
    ctx = Timeline(cost)._context(plan, 0.0, 0)
    one_by_one = [cost(shifted(plan, j)).total_s for j in range(40)]
    assert cost.stretch_s(plan, ctx, 0.0, float("inf"), 40) == one_by_one
    assert cost.stretch_s(plan, ctx, 0.0, float("inf"), 7) == one_by_one[:7]
    # a long stretch priced whole takes the array path: the same floats
    long = [cost(shifted(plan, j)).total_s for j in range(300)]
    assert cost.stretch_s(plan, ctx, 0.0, float("inf"), 300) == long
    assert all(type(d) is float for d in cost.stretch_s(plan, ctx, 0.0, float("inf"), 300))
    # only the steps that begin before `until`: step 17 begins where the clock's sum of the
    # first 17 ends, so an `until` there keeps steps 0-16
    ends, t = [], 0.0
    for d in one_by_one:
        t = t + d
        ends.append(t)
    assert cost.stretch_s(plan, ctx, 0.0, ends[16], 40) == one_by_one[:17]
    assert cost.stretch_s(plan, ctx, 0.0, ends[16] + 1e-9, 40) == one_by_one[:18]
    assert cost.stretch_s(plan, ctx, 1.0, 1.0, 40) == []
    # a stack whose host time follows the pages read prices step by step (None)
    paged = make_cost_model("roofline", LLAMA, HardwareConfig(), overhead=OverheadConfig(name="t", page_s=1e-6))
    assert paged.stretch_s(plan, Timeline(paged)._context(plan, 0.0, 0), 0.0, float("inf"), 40) is None


def test_a_loop_runs_no_stretch_for_a_token_callback_or_a_pipelined_or_paced_clock():
    sched = Scheduler(SchedulerConfig(), CacheConfig(), 1024)
    cost = make_cost_model("unit", LLAMA, HardwareConfig())
    assert EngineLoop(sched, SimExecutor(cost)).stretches
    assert not EngineLoop(sched, SimExecutor(cost), on_token=lambda *a: None).stretches
    assert not EngineLoop(sched, SimExecutor(cost, pipelined=True)).stretches
    assert not EngineLoop(sched, SimExecutor(cost), pace="realtime").stretches
    assert not EngineLoop(sched, SimExecutor(cost), stretches=False).stretches


