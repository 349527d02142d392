"""Replicas sharing one host in the simulator (`cluster.host_share`, cbjax/cluster/host.py), by
hand: an iteration that starts while k replicas are busy takes max(1, k x host_share) times
its cost; a share of 1/2 or less leaves two replicas as independent as separate hosts."""

import dataclasses

import pytest

from conftest import make_requests
from cbjax.cluster import ClusterSim
from cbjax.cluster.engine import ClusterEngine
from cbjax.cluster.host import host_stretch
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, RunConfig, SchedulerConfig
from cbjax.plan import StepOutput
from cbjax.run import build_executor
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


def test_stretch_is_the_busy_replicas_share_of_the_host_beyond_one():
    assert host_stretch(1, 0.75) == 1.0 and host_stretch(2, 0.75) == 1.5 and host_stretch(3, 0.5) == 1.5
    assert host_stretch(2, 0.5) == 1.0 and host_stretch(4, 1.0) == 4.0


def test_two_busy_replicas_on_one_host_by_hand():
    reqs, result, inner = serve(0.75)
    # unit cost; 0 on replica 0 alone: [0, 1) -> token 1. 1 on replica 1 at 0.5 beside busy
    # replica 0: [0.5, 2.0). 2 joins replica 0 at 1.0, both busy: [1.0, 2.5) (0's token 2, 2's
    # token 1). Replica 1 at 2.0: [2.0, 3.5). Replica 0 at 2.5: [2.5, 4.0) ends 0 and 2. Replica
    # 1 at 3.5: replica 0 has no work left but runs until 4.0, so still x1.5: [3.5, 5.0).
    assert [r.first_token_s for r in reqs] == [1.0, 2.0, 2.5]
    assert [r.finish_s for r in reqs] == [4.0, 5.0, 4.0]
    assert result.makespan_s == 5.0 and result.stats.iterations == 3 + 3
    # the cost model sees each replica's own timeline, the sharing's delay taken out: replica
    # 1's iterations follow one another there (no idle gap for a wake-up cost)
    assert inner[0].starts == [0.0, 1.0, 2.0] and inner[1].starts == [0.5, 1.5, 2.5]


@pytest.mark.parametrize("host_share", [None, 0.5])
def test_half_a_host_each_is_as_fast_as_a_host_each(host_share):
    reqs, result, _ = serve(host_share)
    # as tests/test_cluster.py's overlap by hand: nothing slows
    assert [r.first_token_s for r in reqs] == [1.0, 1.5, 2.0]
    assert [r.finish_s for r in reqs] == [3.0, 3.5, 3.0] and result.makespan_s == 3.5


def test_host_share_errors_name_the_key():
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"cluster\.host_share must be in \(0, 1\]"):
            ClusterConfig(replicas=2, host_share=bad)
    engine = dataclasses.replace(config(host_share=0.5), executor=ExecutorConfig(name="jax"))
    with pytest.raises(ValueError, match=r"cluster\.host_share=0\.5: models a shared host in the simulator"):
        ClusterEngine(engine, build_executor)
