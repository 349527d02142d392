"""Diagnostic: does one model step's time grow with the KV page pool (cache.num_pages)? It should not.

    python benchmarks/step_vs_pages.py --attention pallas|ragged|native [--pages 64 4096] [--rounds 15]

Builds the JaxExecutor for a random model (the tiny one by default; `--smollm` for SmolLM-135M's
shape) at each pool size, compiles its step for one token bucket, counts the copies and fusions
in the compiled program whose result is as large as the whole K or V cache or one layer of it (a
pass over the page pool: a materialized layer slice or a copy), and times the step on an empty
(all-padding) batch: `--rounds` rounds over the pool sizes, in turn forward and backward, after
an untimed call; each round the mean of `--calls` steps back to back, medians over the rounds
reported. A step reads only the pages its rows hold, so its time should not depend on the pool's
size. `--attention pallas` runs the Pallas kernel interpreted on CPU and compiled on a GPU or
TPU. The last line reads `pages A -> B: X.XXx`, the median step time at the largest pool over
that at the smallest.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's cbjax, not an installed one
from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.runtime.executor import JaxExecutor, to_device  # noqa: E402
from cbjax.runtime.step import model_step  # noqa: E402


def cache_sized_ops(hlo: str, cache_shape: tuple[int, ...]) -> int:
    """Copies and fusions in `hlo` whose result is as large as the whole K (or V) cache or as one
    layer of it: each is a pass over the page pool (a materialized slice or a copy)."""
    sizes = {math.prod(cache_shape), math.prod(cache_shape[1:])}
    count = 0
    for match in re.finditer(r"= [a-z0-9]+\[([\d,]*)\]\{[^}]*\} (copy|fusion)\(", hlo):
        count += math.prod(int(x) for x in match.group(1).split(",") if x) in sizes
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", choices=["pallas", "ragged", "native"], default="ragged")
    ap.add_argument("--matmul", choices=["auto", "native", "xla"], default="auto")
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--bucket", type=int, default=8, help="the step's token bucket (empty batch)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10, help="steps back to back in a round (their mean is the round's)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--smollm", action="store_true", help="SmolLM-135M's shape instead of the tiny model")
    args = ap.parse_args()
    if args.smollm:
        model = ModelConfig(
            name="smollm_shape", vocab_size=49152, d_model=576, num_layers=args.layers, num_heads=9, num_kv_heads=3,
            head_dim=64, ffn_dim=1536, max_model_len=2048, tie_embeddings=True,
        )  # fmt: skip
    else:
        model = ModelConfig(num_layers=args.layers)
    buckets = sorted({args.bucket, args.slots * 2})
    steps = {}
    for pages in args.pages:
        ex = JaxExecutor(model, CacheConfig(num_pages=pages),
                         SchedulerConfig(max_num_seqs=args.slots, max_num_batched_tokens=buckets[-1]),
                         ExecutorConfig(name="jax", token_buckets=buckets, attention=args.attention,
                                        matmul=args.matmul))  # fmt: skip
        host = ex.packer.empty(args.bucket)
        compiled = model_step.lower(ex.weights, ex.cache, to_device(host), graphdef=ex.graphdef,
                                    attention=ex.attention, matmul=ex.matmul).compile()  # fmt: skip
        steps[pages] = (ex, host, compiled, cache_sized_ops(compiled.as_text(), ex.cache.k.shape))

    def call(pages: int, n: int) -> float:
        """Seconds per step over n steps back to back."""
        ex, host, compiled, _ = steps[pages]
        batch = to_device(host)
        t0 = time.perf_counter()
        for _ in range(n):
            greedy, _, ex.cache = compiled(ex.weights, ex.cache, batch)
            jax.block_until_ready(greedy)
        return (time.perf_counter() - t0) / n

    times: dict[int, list[float]] = {pages: [] for pages in args.pages}
    for pages in args.pages:
        call(pages, 1)  # untimed
    for r in range(args.rounds):  # each round in the other order: neither size always runs first
        for pages in args.pages if r % 2 == 0 else args.pages[::-1]:
            times[pages].append(call(pages, args.calls))
    rows = []
    for pages in args.pages:
        ex, _, _, copies = steps[pages]
        cache_mb = 2 * ex.cache.k.size * ex.cache.k.dtype.itemsize / 2**20
        rows.append((pages, f"{cache_mb:.1f}", copies, f"{1e3 * statistics.median(times[pages]):.2f}"))
    ex = steps[args.pages[0]][0]
    print(f"{model.name} model, {args.layers} layers, {args.slots} slots, attention {ex.attention} "
          f"({jax.default_backend()}), matmul {ex.matmul}, bucket {args.bucket} (empty batch); "
          f"medians of {args.rounds} rounds of {args.calls} steps")  # fmt: skip
    print(markdown_table(["cache.num_pages", "K+V cache MB", "cache-sized copies/fusions in the program", "ms/step"],
                         rows))  # fmt: skip
    lo, hi = min(args.pages), max(args.pages)
    ratio = statistics.median(times[hi]) / statistics.median(times[lo])
    print(f"pages {lo} -> {hi}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
