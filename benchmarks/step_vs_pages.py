"""Diagnostic: does one model step's time grow with the KV page pool (cache.num_pages)? It should not.

    python benchmarks/step_vs_pages.py [--layers 2] [--pages 64 4096] [--buckets 1 32] [--calls 6]

Builds the JaxExecutor for a random model in SmolLM-135M's shape (hidden 576, 9/3 heads,
head_dim 64, ffn 1536, vocab 49,152, tied; `--layers` layers), compiles the step for each
token bucket, counts the copies and fusions in the compiled program whose result is as large
as the whole K or V cache or one layer of it (an in-place scatter shows as one per layer and
tensor; more are slices or copies of the page pool), and times the step on an empty (all-padding) batch, median of `--calls` after
one untimed call. A step reads only the pages its rows hold, so its time should not depend on
the pool's size; passes over the pool make it grow with num_pages (and num_layers).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time

import jax

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.report import markdown_table
from cbjax.runtime.executor import JaxExecutor, to_device
from cbjax.runtime.step import model_step


def cache_sized_ops(hlo: str, cache_shape: tuple[int, ...]) -> int:
    """Copies and fusions in `hlo` whose f32 result is as large as the whole K (or V) cache or as
    one layer of it: each is a pass over the page pool (a materialized slice or a copy)."""
    sizes = {math.prod(cache_shape), math.prod(cache_shape[1:])}
    count = 0
    for match in re.finditer(r"= f32\[([\d,]*)\]\{[^}]*\} (copy|fusion)\(", hlo):
        count += math.prod(int(x) for x in match.group(1).split(",") if x) in sizes
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    model = ModelConfig(
        name="smollm_shape", vocab_size=49152, d_model=576, num_layers=args.layers, num_heads=9, num_kv_heads=3,
        head_dim=64, ffn_dim=1536, max_model_len=2048, tie_embeddings=True,
    )  # fmt: skip
    buckets = sorted(set(args.buckets) | {args.slots * 2})
    rows = []
    for pages in args.pages:
        ex = JaxExecutor(model, CacheConfig(num_pages=pages), SchedulerConfig(max_num_seqs=args.slots, max_num_batched_tokens=buckets[-1]),
                         ExecutorConfig(name="jax", token_buckets=buckets))  # fmt: skip
        for bucket in args.buckets:
            host = ex.packer.empty(bucket)
            compiled = model_step.lower(ex.weights, ex.cache, to_device(host), graphdef=ex.graphdef,
                                        attention=ex.attention, matmul=ex.matmul).compile()  # fmt: skip
            copies = cache_sized_ops(compiled.as_text(), ex.cache.k.shape)
            times = []
            for i in range(args.calls + 1):
                t0 = time.perf_counter()
                greedy, _, ex.cache = compiled(ex.weights, ex.cache, to_device(host))
                jax.block_until_ready(greedy)
                if i:
                    times.append(time.perf_counter() - t0)
            cache_mb = 2 * ex.cache.k.size * ex.cache.k.dtype.itemsize / 2**20
            rows.append((pages, f"{cache_mb:.0f}", bucket, copies, f"{1e3 * statistics.median(times):.1f}"))
    print(f"SmolLM-135M shape with {args.layers} layers, {args.slots} slots, attention {ex.attention}; "
          f"empty batches, medians of {args.calls}")  # fmt: skip
    print(markdown_table(["cache.num_pages", "K+V cache MB", "token bucket", "cache-sized copies/fusions in the program",
                          "ms/step"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
