"""Subprocess body of tests/test_host_tier_engine.py's tensor-parallel case: serve multi-turn
sessions on the JAX engine at executor.mesh.tensor=2 with the host KV tier on and off, and print
each run's tokens and tier counters as JSON.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax starts).
"""

import dataclasses
import json

from tier_sessions import fresh, random_sessions
from tp_engine import BUCKETS, CACHE, MODEL, SCHED
from cbjax.config import ExecutorConfig, MeshConfig
from cbjax.engine.offline import serve
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler
from cbjax.sim.cost import UnitCost
from cbjax.sim.costed import CostTimed


def run(host_pages: int) -> dict:
    cache = dataclasses.replace(CACHE, num_pages=12, host_pages=host_pages)
    exec_cfg = ExecutorConfig(name="jax", token_buckets=BUCKETS, mesh=MeshConfig(2), compilation_cache_dir=None)
    ex = JaxExecutor(MODEL, cache, SCHED, exec_cfg, progress=False)
    ex.warmup(sampling=False)
    sched = Scheduler(SCHED, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
    reqs = [fresh(r) for r in random_sessions(4, 3, seed=1, vocab=MODEL.vocab_size, first=(4, 12), new=(2, 8), out=(1, 6))]
    serve(reqs, sched, CostTimed(ex, UnitCost()))
    tier = sched.tier
    return {
        "tokens": {r.request_id: r.output_token_ids for r in reqs},
        "host_hit_tokens": tier.tokens_hit_host if tier else 0,
        "pages_loaded": ex._host_tier.num_loaded if ex._host_tier else 0,
        "cache_shards": len(ex.cache.k.sharding.device_set),
        "compiles_after_warmup": ex.metrics()["compiles_after_warmup"],
    }


if __name__ == "__main__":
    print(json.dumps({"on": run(24), "off": run(0)}))
