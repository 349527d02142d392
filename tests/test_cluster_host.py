"""Replicas sharing one host in the simulator (`cluster.host_share`, cbjax/cluster/host.py), by
hand: the simulator runs the engine driver's turns, each stepping every busy replica once and
lasting max(longest iteration, host_share x their sum); arrivals wait for the next turn."""

import dataclasses

import pytest

from conftest import make_requests
from cbjax.cluster import ClusterSim
from cbjax.cluster.engine import ClusterEngine
from cbjax.cluster.host import turn_length
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, RunConfig, SchedulerConfig
from cbjax.core.plan import StepOutput
from cbjax.app.run import build_executor
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost


def config(**cluster):
    return RunConfig(
        cluster=ClusterConfig(replicas=2, **cluster),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
        cache=CacheConfig(num_pages=256),
        progress=False,
    )


class Starts(SimExecutor):
    """Unit cost; keeps the start time each plan had when it reached the cost model."""

    def __init__(self):
        super().__init__(UnitCost())
        self.starts = []

    def execute(self, plan):
        self.starts.append(plan.start_s)
        return StepOutput(token_ids=None, duration_s=1.0)


def serve(host_share):
    inner = []
    cluster = ClusterSim(config(host_share=host_share), lambda c: inner.append(Starts()) or inner[-1])
    reqs = make_requests([3, 3, 2], arrivals=[0.0, 0.5, 1.0])
    for i, r in enumerate(reqs):
        r.synthetic_prompt = (i, 512)  # seeded ids: the cluster hashes prompts
    result = cluster.serve(reqs)
    assert [cluster.row_extras(r)["replica"] for r in reqs] == [0, 1, 0]  # round robin
    return reqs, result, inner


def test_a_turn_is_the_replicas_demand_on_the_host_but_no_shorter_than_its_longest_iteration():
    assert turn_length([1.0, 1.0], 0.75) == 1.5 and turn_length([1.0], 0.75) == 1.0
    assert turn_length([2.0, 0.5], 0.75) == 2.0  # the longest iteration binds
    assert turn_length([2.0, 1.0], 1.0) == 3.0  # the whole host: one after the other
    assert turn_length([1.0, 1.0], 0.5) == 1.0 and turn_length([0.0, 0.0], 0.9) == 0.0
    assert turn_length([], 0.75) == 0.0
    # above 1: two busy replicas slow each other beyond taking turns; one alone is not slowed
    assert turn_length([1.0, 1.0], 1.25) == 2.5 and turn_length([1.0, 0.0], 1.25) == 1.0


def test_two_busy_replicas_on_one_host_by_hand():
    reqs, result, inner = serve(0.75)
    # unit cost, pipelined loops (a token lands when the next step launches, a turn later).
    # Turn at 0: request 0 on replica 0 alone: its prefill [0, 1); the turn lasts 1.
    # Turn at 1: requests 1 (arrived 0.5, waited for the turn) and 2 enter. Replica 0 launches
    #   0's decode with 2's prefill and lands 0's token 1 (at 1); replica 1 launches 1's
    #   prefill. Two unit iterations: 0.75 x 2 = 1.5, so both end at 2.5.
    # Turn at 2.5: replica 0 launches 0's and 2's last decodes, lands 0's token 2 and 2's
    #   token 1; replica 1 launches 1's decode, lands 1's token 1 (all at 2.5); 1.5 again.
    # Turn at 4: replica 0 only lands (0 and 2 end at 4); replica 1 launches 1's last decode
    #   alone: 1. Turn at 5: replica 1 lands it (1 ends at 5).
    assert [r.first_token_s for r in reqs] == [1.0, 2.5, 2.5]
    assert [r.finish_s for r in reqs] == [4.0, 5.0, 4.0]
    assert result.makespan_s == 5.0 and result.stats.iterations == 3 + 3
    # the cost model sees each replica's own timeline, the sharing's delay taken out: each
    # replica's iterations follow one another there (no idle gap for a wake-up cost)
    assert inner[0].starts == [0.0, 1.0, 2.0] and inner[1].starts == [1.0, 2.0, 3.0]


def test_a_share_above_one_slows_shared_turns_only():
    reqs, result, _ = serve(1.25)
    # the same turns: the two shared ones last 2.5 (at 1 and 3.5), the lone ones 1 (at 0 and 6)
    assert [r.first_token_s for r in reqs] == [1.0, 3.5, 3.5]
    assert [r.finish_s for r in reqs] == [6.0, 7.0, 6.0] and result.makespan_s == 7.0


def test_half_a_host_each_ends_every_turn_with_its_longest_iteration():
    reqs, result, _ = serve(0.5)
    # the same turns as above, each lasting 1: nothing slows but the wait for a turn
    assert [r.first_token_s for r in reqs] == [1.0, 2.0, 2.0]
    assert [r.finish_s for r in reqs] == [3.0, 4.0, 3.0] and result.makespan_s == 4.0


def test_host_share_errors_name_the_key():
    for bad in (0.0, 2.5, float("nan")):
        with pytest.raises(ValueError, match=r"cluster\.host_share must be in \(0, 2\]"):
            ClusterConfig(replicas=2, host_share=bad)
    blocking = dataclasses.replace(config(host_share=0.5), executor=ExecutorConfig(async_scheduling=False))
    with pytest.raises(ValueError, match=r"cluster\.host_share=0\.5: .*executor\.async_scheduling=true"):
        ClusterSim(blocking, lambda c: Starts())
    engine = dataclasses.replace(config(host_share=0.5), executor=ExecutorConfig(name="jax"))
    with pytest.raises(ValueError, match=r"cluster\.host_share=0\.5: models a shared host in the simulator"):
        ClusterEngine(engine, build_executor)
