"""An engine cluster on the simulator's clock makes the simulator's decisions: on the same
arrivals, with the real engine's replicas timed by the same cost model (`CostTimed`), every
request goes to the same replica (its prefill and decode replicas under P/D) as in the
simulated cluster, for every built-in router; and, its tokens ending requests where the
simulator's lengths do, every time of every request is the simulator's too."""

from __future__ import annotations

import dataclasses

import pytest

from tp_engine import BUCKETS, CACHE, MODEL, SCHED
from cbjax.cluster import ClusterSim
from cbjax.cluster.router import ROUTER_CLASSES
from cbjax.config import ClusterConfig, ExecutorConfig, LengthConfig, RunConfig, WorkloadConfig
from cbjax.runtime.executor import JaxExecutor
from cbjax.sim import SimExecutor, make_cost_model
from cbjax.sim.costed import CostTimed
from cbjax.workload import build_workload

PLACES = ("replica", "prefill_replica", "decode_replica")


def config(cluster: dict) -> RunConfig:
    workload = WorkloadConfig(
        name="shared_prefix", num_requests=24, arrival="poisson", rate=400.0,
        prompt_len=LengthConfig(dist="uniform", low=2, high=12), output_len=LengthConfig(dist="uniform", low=1, high=12),
    )  # fmt: skip
    shared = dataclasses.replace(workload.shared_prefix, num_groups=3, prefix_len=8)
    return RunConfig(
        model=MODEL, scheduler=SCHED, cache=dataclasses.replace(CACHE, prefix_caching=True),
        executor=ExecutorConfig(name="sim", cost_model="roofline"), cluster=ClusterConfig(**cluster),
        workload=dataclasses.replace(workload, shared_prefix=shared), progress=False,
    )  # fmt: skip


def serve(cfg: RunConfig, engine: bool) -> dict:
    def make(rcfg):
        cost = make_cost_model("unit", rcfg.model, rcfg.hardware)  # steps of 1 s: the arrivals queue and batch
        if not engine:
            return SimExecutor(cost)
        ex = JaxExecutor(rcfg.model, rcfg.cache, rcfg.scheduler, ExecutorConfig(name="jax", token_buckets=BUCKETS),
                         progress=False)  # fmt: skip
        ex.warmup(sampling=False, kv_transfer=True)
        return CostTimed(ex, cost)

    cluster = ClusterSim(cfg, make)
    requests = build_workload(cfg.workload, cfg.seed)
    cluster.serve(requests)
    return {
        r.request_id: {
            **{k: v for k, v in cluster.row_extras(r).items() if k in PLACES},
            "times": (r.scheduled_s, r.first_token_s, r.finish_s), "fate": r.finish_reason, "tokens": r.num_generated,
        }
        for r in requests
    }  # fmt: skip


CASES = [dict(replicas=3, router=name) for name in sorted(ROUTER_CLASSES)] + [
    dict(prefill_replicas=1, decode_replicas=2, router="least_loaded"),
    dict(prefill_replicas=2, decode_replicas=1, router="prefix_affinity"),
]


@pytest.mark.parametrize("cluster", CASES, ids=lambda c: c.get("router") + ("_pd" if "prefill_replicas" in c else ""))
def test_the_engine_cluster_on_the_simulators_clock_makes_its_decisions(cluster):
    cfg = config(cluster)
    simulated, engine = serve(cfg, engine=False), serve(cfg, engine=True)
    assert engine == simulated
    places = [row.get("replica", row.get("decode_replica")) for row in simulated.values()]
    assert len(set(places)) > 1  # the router really chose among replicas
    assert all(row["fate"].value in ("length", "eos") for row in simulated.values())
