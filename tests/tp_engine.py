"""Subprocess body of tests/test_tensor_parallel.py: serve one workload on the JAX engine at
each `executor.mesh.tensor` given on the command line and print every run's tokens as JSON.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax starts).
"""

import dataclasses
import json
import sys

import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, MeshConfig, ModelConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.core.request import Request, SamplingParams
from cbjax.runtime.executor import JaxExecutor
from cbjax.runtime.hlo import all_reduce_traffic
from cbjax.scheduler import Scheduler

# 16 heads in 8 GQA groups of 2, ffn 128: every TP size up to 8 divides them, and each shard
# must hold whole groups (a kv head beside its two query heads in the fused qkv kernel).
MODEL = ModelConfig(num_heads=16, num_kv_heads=8, head_dim=4, d_model=64, ffn_dim=128, max_model_len=64)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunked_prefill=True)
CACHE = CacheConfig(num_pages=64, page_size=4)
BUCKETS = [32]  # one program per TP size keeps the test short


def workload(seed: int = 0) -> list[Request]:
    """Staggered arrivals, so later prompts prefill (in chunks) beside running decodes."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(6):
        prompt = rng.integers(0, MODEL.vocab_size, rng.integers(3, 40)).tolist()
        sampling = SamplingParams(max_tokens=int(rng.integers(4, 10)), ignore_eos=True)
        reqs.append(Request(str(i), 1e-4 * i, len(prompt), prompt_token_ids=prompt, sampling=sampling))
    return reqs


def run(spec: str) -> dict:
    """spec: "N" (executor.mesh.tensor=N), or "N:swap": a pool of 14 pages with swap preemption."""
    tensor, _, mode = spec.partition(":")
    sched_cfg, cache = SCHED, CACHE
    if mode == "swap":
        sched_cfg = dataclasses.replace(SCHED, preemption="swap")
        cache = dataclasses.replace(CACHE, num_pages=14)
    exec_cfg = ExecutorConfig(name="jax", token_buckets=BUCKETS, mesh=MeshConfig(int(tensor)), compilation_cache_dir=None)
    ex = JaxExecutor(MODEL, cache, sched_cfg, exec_cfg)
    ex.progress = False
    ex.sampling = False
    sched = Scheduler(sched_cfg, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
    ex.warmup()
    result = serve(workload(), sched, ex)
    m = ex.metrics()
    return {
        "tokens": {r.request_id: r.output_token_ids for r in result.requests},
        "pages_swapped_out": ex._swap.num_out_pages,
        "compiles_after_warmup": m["compiles_after_warmup"],
        "mixed_iterations": m["mixed_iterations"],
        "mesh_tensor": m["mesh_tensor"],
        "cache_shards": len(ex.cache.k.sharding.device_set),
        # token bucket -> [all-reduce ops per step, bytes], from the compiled program
        "all_reduce": {b: all_reduce_traffic(c.as_text()) for b, c in ex._compiled.items()},
    }


if __name__ == "__main__":
    print(json.dumps({spec: run(spec) for spec in sys.argv[1:]}))
