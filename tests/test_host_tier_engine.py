"""The host KV tier on the JAX engine: pages really go to host memory and back, a request whose
prefix came from the host yields exactly the tokens it yields with the tier off (under recompute
and swap preemption, with prefetch, in pinned host memory, at TP 2 and on a 2-replica cluster),
and the hand-computed case gives the simulator's counts exactly.

The engine runs on the simulator's clock (`CostTimed`, one second a step), so sessions whose
turns arrive rounds apart take no wall time to wait for.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_host_tier import HAND_CACHE, HAND_COUNTS, HAND_DEVICE_HITS, HAND_HOST_HITS, HAND_SCHED, hand_summary
from tier_sessions import fresh, hand_sessions, random_sessions
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, ModelConfig, RunConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.report.metrics import summarize
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler
from cbjax.sim.cost import UnitCost
from cbjax.sim.costed import CostTimed

HERE = Path(__file__).resolve().parent
MODEL = ModelConfig(max_model_len=128)
BUCKETS = [4, 16, 64]
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
# 15 usable pages of 4 tokens for 5 sessions of up to ~50 tokens: turns preempt each other, and
# between rounds the device keeps only some sessions' pages; the rest come back from the host.
CACHE = CacheConfig(num_pages=16, page_size=4)
TIER = {"host_pages": 32}


def engine_run(reqs, sched_cfg, cache, pinned=None):
    ex = JaxExecutor(MODEL, cache, sched_cfg, ExecutorConfig(name="jax", token_buckets=BUCKETS), progress=False)
    if pinned is not None and ex._host_tier is not None:
        ex._host_tier.pinned = pinned
    ex.warmup(sampling=False)
    sched = Scheduler(sched_cfg, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
    reqs = [fresh(r) for r in reqs]
    result = serve(reqs, sched, CostTimed(ex, UnitCost()))
    assert all(r.num_generated == r.sampling.max_tokens for r in reqs)
    return reqs, result, sched, ex


@pytest.fixture(scope="module")
def sessions():
    return random_sessions(5, 3, seed=3, vocab=MODEL.vocab_size)


@pytest.fixture(scope="module")
def tier_off(sessions):
    return {
        mode: {r.request_id: r.output_token_ids for r in engine_run(sessions, dataclasses.replace(SCHED, preemption=mode), CACHE)[0]}
        for mode in ("recompute", "swap")
    }  # fmt: skip


@pytest.mark.parametrize(
    "preemption, cache_kw, pinned",
    [
        ("recompute", {}, None),
        ("swap", {}, None),
        ("recompute", {"host_prefetch": True, "host_eviction": "session"}, None),
        ("recompute", {}, True),  # the pinned_host path, which a GPU takes, on the CPU's own host memory
    ],
    ids=["recompute", "swap", "prefetch_session", "pinned_host"],
)
def test_prefixes_from_the_host_give_the_tokens_of_the_tier_off(sessions, tier_off, preemption, cache_kw, pinned):
    cache = dataclasses.replace(CACHE, **TIER, **cache_kw)
    reqs, result, sched, ex = engine_run(sessions, dataclasses.replace(SCHED, preemption=preemption), cache, pinned)
    summary = summarize(result)
    assert {r.request_id: r.output_token_ids for r in reqs} == tier_off[preemption]
    assert summary["prefix_hit_tokens_host"] > 0 and ex._host_tier.num_loaded == summary["kv_host_pages_loaded"] > 0
    assert ex._host_tier.num_stored == summary["kv_host_pages_stored"] > 0
    assert sum(r.prefix_hit_tokens_host > 0 for r in reqs if r.turn) >= 2  # later turns found their prefix there
    assert summary["preemptions"] > 0
    if preemption == "swap":
        assert summary["swap_preemptions"] > 0
    if cache_kw.get("host_prefetch"):
        assert summary["kv_host_pages_prefetched"] > 0
    if not pinned:  # the batched copies use the swap programs compiled at warmup
        assert ex.metrics()["compiles_after_warmup"] == 0


def test_the_hand_computed_case_on_the_engine():
    reqs, result, sched, ex = engine_run(hand_sessions(), HAND_SCHED, HAND_CACHE)
    assert {r.request_id: r.prefix_hit_tokens_device for r in reqs} == HAND_DEVICE_HITS
    assert {r.request_id: r.prefix_hit_tokens_host for r in reqs} == HAND_HOST_HITS
    assert hand_summary(sched, result) == HAND_COUNTS
    assert (ex._host_tier.num_stored, ex._host_tier.num_loaded) == (14, 8)  # the engine's own count of copies
    off, _, _, _ = engine_run(hand_sessions(), HAND_SCHED, dataclasses.replace(HAND_CACHE, host_pages=0))
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in off]


def test_the_pipelined_engine_on_the_wall_clock_loads_and_times_its_loads():
    """The hand-computed case's requests 0.2 s apart on the wall clock, the engine launching each
    step before it reads the last one's tokens: the same tokens as with the tier off, and each
    request that loaded host pages has its measured load seconds."""

    def wall_run(cache):
        ex = JaxExecutor(MODEL, cache, HAND_SCHED, ExecutorConfig(name="jax", token_buckets=BUCKETS), progress=False)
        ex.warmup(sampling=False)
        assert ex.pipelined
        sched = Scheduler(HAND_SCHED, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
        reqs = [fresh(r) for r in hand_sessions()]
        for r in reqs:
            r.arrival_s /= 50.0
        serve(reqs, sched, ex)
        return reqs

    on, off = wall_run(HAND_CACHE), wall_run(dataclasses.replace(HAND_CACHE, host_pages=0))
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    loaded = [r for r in on if r.prefix_hit_tokens_host]
    assert loaded and all(r.kv_load_s > 0 for r in loaded)
    assert all(r.kv_load_s == 0.0 for r in on if not r.prefix_hit_tokens_host)


def test_a_two_replica_engine_cluster_gives_the_tokens_of_the_tier_off(sessions):
    from cbjax.cluster import ClusterSim

    def serve_cluster(cache):
        cfg = RunConfig(
            model=MODEL, scheduler=SCHED, cache=cache, executor=ExecutorConfig(name="sim", cost_model="unit"),
            cluster=ClusterConfig(replicas=2, router="prefix_affinity"), progress=False,
        )  # fmt: skip

        def make(rcfg):
            ex = JaxExecutor(rcfg.model, rcfg.cache, rcfg.scheduler, ExecutorConfig(name="jax", token_buckets=BUCKETS),
                             progress=False)  # fmt: skip
            ex.warmup(sampling=False)
            return CostTimed(ex, UnitCost())

        cluster = ClusterSim(cfg, make)
        reqs = [fresh(r) for r in sessions]
        result = cluster.serve(reqs)
        return {r.request_id: r.output_token_ids for r in reqs}, result

    off, _ = serve_cluster(CACHE)
    on, result = serve_cluster(dataclasses.replace(CACHE, **TIER))
    assert on == off
    assert result.extra["prefix_hit_tokens_host"] > 0 and result.extra["kv_host_pages_loaded"] > 0


def test_tensor_parallel_2_gives_the_tokens_of_the_tier_off(env_cpu):
    env = dict(env_cpu)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, str(HERE / "tier_tp_engine.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert runs["on"]["tokens"] == runs["off"]["tokens"]
    assert runs["on"]["host_hit_tokens"] > 0 and runs["on"]["pages_loaded"] > 0
    assert runs["on"]["cache_shards"] == 2 and runs["on"]["compiles_after_warmup"] == 0
