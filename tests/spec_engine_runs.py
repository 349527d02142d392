"""Subprocess body of tests/test_spec_engine.py: serve its workload with speculation on a single
engine, under tensor parallelism, and on a 1 prefill + 1 decode cluster (replicas in this
process), and print each run's tokens and counters as JSON.

Usage: spec_engine_runs.py RUN...; a run is LAYOUT:METHOD, LAYOUT single | tp2 | pd, METHOD
none | ngram (k 3) | model (a draft model equal to the target, k 2). The target is
`one_layer_target`, so the draft model predicts it exactly.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax starts).
"""

import json
import sys

from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, MeshConfig, RunConfig, SchedulerConfig, SpecConfig
from cbjax.engine.offline import serve
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler
from test_spec_engine import workload
from test_spec_executor import DRAFT, MODEL, first_layer_of, one_layer_target

BUCKETS = [32]  # one program per layout keeps the test short
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunked_prefill=True)
CACHE = CacheConfig(num_pages=200, page_size=4)
SPECS = {
    "none": SpecConfig(),
    "ngram": SpecConfig(method="ngram", num_tokens=3),
    "model": SpecConfig(method="draft", num_tokens=2, draft_model="tiny_draft"),
}


def config(spec: SpecConfig, tensor: int = 1, cluster: ClusterConfig | None = None) -> RunConfig:
    executor = ExecutorConfig(name="jax", token_buckets=BUCKETS, mesh=MeshConfig(tensor), compilation_cache_dir=None)
    return RunConfig(model=MODEL, scheduler=SCHED, cache=CACHE, executor=executor, spec=spec, cluster=cluster or ClusterConfig(),
                     progress=False)  # fmt: skip


def executor(rcfg: RunConfig, devices=None) -> JaxExecutor:
    """As `cbjax.app.run.build_executor` builds it, with the test's target and draft weights."""
    draft = first_layer_of(one_layer_target()) if rcfg.spec.draft_model else None
    return JaxExecutor(
        rcfg.model, rcfg.cache, rcfg.scheduler, rcfg.executor, llama=one_layer_target(), devices=devices,
        progress=False, spec=rcfg.spec, draft_model=DRAFT if draft is not None else None, draft_llama=draft,
    )  # fmt: skip


def counts(requests) -> dict:
    return {
        "tokens": {r.request_id: r.output_token_ids for r in requests},
        "proposed": sum(r.spec_proposed for r in requests),
        "accepted": sum(r.spec_accepted for r in requests),
    }


def single(spec: SpecConfig, tensor: int) -> dict:
    cfg = config(spec, tensor)
    ex = executor(cfg)
    ex.warmup(sampling=False)
    sched = Scheduler(SCHED, CACHE, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size, spec=spec)
    result = serve(workload(), sched, ex)
    m = ex.metrics()
    return {**counts(result.requests), "compiles_after_warmup": [m["compiles_after_warmup"]],
            "mesh_tensor": [m["mesh_tensor"]]}  # fmt: skip


def prefill_decode(spec: SpecConfig) -> dict:
    from cbjax.cluster.engine import ClusterEngine
    from cbjax.cluster.pools import replica_configs
    from cbjax.runtime.mesh import replica_devices

    cfg = config(spec, cluster=ClusterConfig(backend="inline", prefill_replicas=1, decode_replicas=1))
    devices = iter(replica_devices([rcfg.executor.mesh.tensor for _, rcfg in replica_configs(cfg)]))
    engine = ClusterEngine(cfg, lambda rcfg: executor(rcfg, next(devices)))
    result = engine.serve(workload())
    metrics = [r.executor.metrics() for r in engine.replicas]
    return {**counts(result.requests), "compiles_after_warmup": [m["compiles_after_warmup"] for m in metrics],
            "kv_transfers": engine.summary_fields(result)["kv_transfers"]}  # fmt: skip


def main(name: str) -> dict:
    layout, _, method = name.partition(":")
    spec = SPECS[method]
    if layout == "pd":
        return prefill_decode(spec)
    return single(spec, 2 if layout == "tp2" else 1)


if __name__ == "__main__":
    print(json.dumps({name: main(name) for name in sys.argv[1:]}))
