"""Subprocess body of tests/test_cluster_engine.py: serve tp_engine's workload on a single
engine replica and on engine clusters (colocated replicas, P/D pools), and print each run's
tokens and counters as JSON.

Usage: cluster_engine.py [--cache=DIR] RUN...; a run is "single" or a LAYOUTS key, with its
replicas' executors in child processes (`cluster.backend=processes`), or prefixed "inline_"
(all in this process), "ray_" (local Ray actors), "stop_" (child processes, stopped after a
few driver turns). DIR: the executors' persistent compilation cache (shared by the runs' processes).

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax starts).
"""

import json
import os
import sys

from cbjax.config import ClusterConfig, ExecutorConfig, MeshConfig, RunConfig
from cbjax.engine.offline import serve
from cbjax.app.run import build_executor, cluster_executors
from cbjax.scheduler import Scheduler
from tp_engine import BUCKETS, CACHE, MODEL, SCHED, workload

CACHE_DIR = None  # --cache=DIR

LAYOUTS = {  # name -> the cluster group and executor.mesh.tensor of the run
    "2x1": (dict(replicas=2), 1),
    "2x2": (dict(replicas=2), 2),
    "pd_1_1": (dict(prefill_replicas=1, decode_replicas=1), 1),
    "pd_2_1": (dict(prefill_replicas=1, decode_replicas=1, prefill_tensor=2, decode_tensor=1), 1),
}


def config(cluster: dict, tensor: int, backend: str = "processes") -> RunConfig:
    executor = ExecutorConfig(name="jax", token_buckets=BUCKETS, mesh=MeshConfig(tensor), compilation_cache_dir=CACHE_DIR)
    cluster = ClusterConfig(backend=backend, **cluster)
    return RunConfig(model=MODEL, scheduler=SCHED, cache=CACHE, executor=executor, cluster=cluster, progress=False)


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
    """name: a LAYOUTS key, prefixed as the module's docstring says."""
    from cbjax.cluster.engine import ClusterEngine

    backend, _, layout = name.partition("_") if name.startswith(("inline_", "ray_", "stop_")) else ("processes", "", name)
    stop = StopAfter(6) if backend == "stop" else None
    backend = "processes" if backend == "stop" else backend
    cfg = config(*LAYOUTS[layout], backend=backend)
    if backend == "inline":
        return report(ClusterEngine(cfg, cluster_executors(cfg)), stop)
    if backend == "ray":
        from cbjax.cluster.ray_actors import RayReplicas

        replicas = RayReplicas(build_executor, num_cpus=2)
    else:
        from cbjax.cluster.processes import ProcessReplicas

        replicas = ProcessReplicas(build_executor, cfg)
    try:
        return report(ClusterEngine(cfg, replicas), stop)
    finally:
        replicas.shutdown()


def report(engine, stop=None) -> dict:
    result = engine.serve(workload(), stop=stop)
    inline = engine.cfg.cluster.backend == "inline"
    metrics = [r.executor.metrics() for r in engine.replicas]
    summary = engine.summary_fields(result)
    return {
        "tokens": {r.request_id: r.output_token_ids for r in result.requests},
        "fates": sorted({r.finish_reason.value for r in result.requests}),
        "fate": {r.request_id: r.finish_reason.value for r in result.requests},
        "interrupted": result.interrupted,
        # every page back in its pool: a prefill's held pages were released after their copy
        "pages_leaked": [r.scheduler.allocator.num_usable_pages - r.scheduler.allocator.num_free_pages for r in engine.replicas],
        "summary_compiles_after_warmup": summary["compiles_after_warmup"],
        "replica_failure": summary["replica_failure"],
        "rows": {r.request_id: engine.row_extras(r) for r in result.requests},
        "compiles_after_warmup": [m["compiles_after_warmup"] for m in metrics],
        "mesh_tensor": [m["mesh_tensor"] for m in metrics],
        # inline: each replica's devices, from where its KV cache lives
        "devices": [sorted(d.id for d in r.executor.cache.k.sharding.device_set) for r in engine.replicas] if inline else None,
        "pids": None if inline else [r.executor.pid for r in engine.replicas],
        "driver_pid": os.getpid(),
        "requests": [r.num_routed for r in engine.replicas],
        "kv_transfers": summary["kv_transfers"],
    }


if __name__ == "__main__":
    runs = sys.argv[1:]
    if runs and runs[0].startswith("--cache="):
        CACHE_DIR = runs.pop(0).removeprefix("--cache=")
    print(json.dumps({name: single() if name == "single" else cluster(name) for name in runs}))
