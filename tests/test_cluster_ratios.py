"""experiments/cluster_ratios.py's separation check, on the simulator: its lone-replica arm
really sends every request to the first replica, and the check reads the makespans' ratio."""

from __future__ import annotations

import dataclasses
import sys

from conftest import REPO
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, RunConfig, SchedulerConfig, WorkloadConfig

sys.path.insert(0, str(REPO / "experiments"))
import cluster_ratios  # noqa: E402

from cbjax.app.run import run_single  # noqa: E402


def colocated() -> RunConfig:
    return RunConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        cache=CacheConfig(page_size=4, num_pages=128, prefix_caching=False),
        executor=ExecutorConfig(name="sim", cost_model="unit"),
        workload=WorkloadConfig(num_requests=16),
        cluster=ClusterConfig(replicas=2, router="round_robin"),
        progress=False,
    )


def test_the_lone_replica_arm_routes_every_request_to_the_first_replica():
    cfg = colocated()
    one = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, router="cluster_ratios:FirstReplica"))
    assert [r["requests"] for r in run_single(one, verbose=False)["replicas"]] == [16, 0]
    assert [r["requests"] for r in run_single(cfg, verbose=False)["replicas"]] == [8, 8]


def test_the_check_reads_split_over_lone_makespans(monkeypatch):
    spans = {"round_robin": 3.0, "cluster_ratios:FirstReplica": 4.0}
    monkeypatch.setattr(cluster_ratios, "run_single", lambda cfg, verbose: {"makespan_s": spans[cfg.cluster.router]})
    sep = cluster_ratios.separation(colocated(), 3)
    assert sep["split_over_one_makespan"] == [0.75, 0.75, 0.75] and sep["median"] == 0.75
    assert cluster_ratios.separation(colocated(), 0) == {"split_over_one_makespan": [], "median": None}
