"""Subprocess body of tests/test_cluster_engine.py: serve tp_engine's workload on a single
engine replica and on engine clusters (colocated replicas, P/D pools) in one process, and
print each run's tokens and counters as JSON.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax starts).
"""

import json
import sys

from cbjax.config import ClusterConfig, ExecutorConfig, MeshConfig, RunConfig
from cbjax.engine.offline import serve
from cbjax.app.run import build_executor, cluster_executors
from cbjax.scheduler import Scheduler
from tp_engine import BUCKETS, CACHE, MODEL, SCHED, workload

LAYOUTS = {  # name -> the cluster group and executor.mesh.tensor of the run
    "2x1": (dict(replicas=2), 1),
    "2x2": (dict(replicas=2), 2),
    "pd_1_1": (dict(prefill_replicas=1, decode_replicas=1), 1),
    "pd_2_1": (dict(prefill_replicas=1, decode_replicas=1, prefill_tensor=2, decode_tensor=1), 1),
}


def config(cluster: dict, tensor: int) -> RunConfig:
    executor = ExecutorConfig(name="jax", token_buckets=BUCKETS, mesh=MeshConfig(tensor), compilation_cache_dir=None)
    return RunConfig(
        model=MODEL, scheduler=SCHED, cache=CACHE, executor=executor, cluster=ClusterConfig(**cluster), progress=False
    )


def single() -> dict:
    cfg = config({}, 1)
    ex = build_executor(cfg)
    ex.sampling = False
    sched = Scheduler(SCHED, CACHE, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
    ex.warmup()
    result = serve(workload(), sched, ex)
    return {"tokens": {r.request_id: r.output_token_ids for r in result.requests}}


class StopAfter:
    """A stop flag set from its `turns`-th check on (the driver checks once per turn)."""

    def __init__(self, turns: int):
        self.turns = turns

    def is_set(self) -> bool:
        self.turns -= 1
        return self.turns < 0


def cluster(name: str) -> dict:
    """name: a LAYOUTS key; "ray_" + one: its replicas' executors in local Ray actors;
    "stop_" + one: stopped after a few driver turns."""
    from cbjax.cluster.engine import ClusterEngine

    on_ray = name.startswith("ray_")
    stop = StopAfter(6) if name.startswith("stop_") else None
    cfg = config(*LAYOUTS[name.removeprefix("ray_").removeprefix("stop_")])
    if not on_ray:
        return report(ClusterEngine(cfg, cluster_executors(cfg)), on_ray, stop)
    from cbjax.cluster.ray_actors import RayReplicas

    replicas = RayReplicas(build_executor, num_cpus=2)
    try:
        return report(ClusterEngine(cfg, replicas), on_ray)
    finally:
        replicas.shutdown()


def report(engine, on_ray: bool, stop=None) -> dict:
    result = engine.serve(workload(), stop=stop)
    metrics = [r.executor.metrics() for r in engine.replicas]
    return {
        "tokens": {r.request_id: r.output_token_ids for r in result.requests},
        "fates": sorted({r.finish_reason.value for r in result.requests}),
        "fate": {r.request_id: r.finish_reason.value for r in result.requests},
        "interrupted": result.interrupted,
        # every page back in its pool: a prefill's held pages were released after their copy
        "pages_leaked": [r.scheduler.allocator.num_usable_pages - r.scheduler.allocator.num_free_pages for r in engine.replicas],
        "summary_compiles_after_warmup": engine.summary_fields(result)["compiles_after_warmup"],
        "rows": {r.request_id: engine.row_extras(r) for r in result.requests},
        "compiles_after_warmup": [m["compiles_after_warmup"] for m in metrics],
        # each replica's devices, from where its KV cache lives (in this process)
        "devices": None if on_ray else [sorted(d.id for d in r.executor.cache.k.sharding.device_set) for r in engine.replicas],
        "pids": [ray_pid(r.executor) for r in engine.replicas] if on_ray else None,
        "requests": [r.num_routed for r in engine.replicas],
        "kv_transfers": engine.summary_fields(result)["kv_transfers"],
    }


def ray_pid(executor) -> int:
    import ray

    return ray.get(executor.actor.pid.remote())


if __name__ == "__main__":
    print(json.dumps({name: single() if name == "single" else cluster(name) for name in sys.argv[1:]}))
