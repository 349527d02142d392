"""Tensor parallelism on forced CPU devices: step time and bytes all-reduced per step at each TP size.

    python benchmarks/tp_scaling.py [--tensor 1 2 4 8] [--buckets 8 64] [--layers 4] [--calls 10]

Not a speed benchmark: the 8 CPU "devices" share this machine's cores, so a larger mesh
splits the same cores further and adds collectives; what it shows is the sharded step
running at every size and its communication. For each TP size it builds the JaxExecutor
(`executor.mesh.tensor`) for a random model of 8 heads and 8 kv heads (d_model 512,
head_dim 64, ffn 1536, vocab 8192), warms it up, and times the step on an empty
(all-padding) batch of each token bucket, median of `--calls` after one untimed call; then
counts the all-reduce ops in the compiled program and the bytes they reduce
(`cbjax.runtime.hlo`, loop bodies times their trip count) and prints them beside the count
the roofline model charges (`cbjax.sim.tp`: 2 per layer of [tokens, d_model]), and the ring
bytes each device sends for them.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from cbjax.config import CacheConfig, ExecutorConfig, MeshConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.runtime.executor import JaxExecutor  # noqa: E402
from cbjax.runtime.hlo import all_reduce_traffic  # noqa: E402
from cbjax.sim.tp import allreduce_bytes_per_token, allreduces_per_step, ring_bytes_per_device  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--buckets", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    model = ModelConfig(
        name="tp_bench", vocab_size=8192, d_model=512, num_layers=args.layers, num_heads=8, num_kv_heads=8,
        head_dim=64, ffn_dim=1536, max_model_len=512,
    )  # fmt: skip
    buckets = sorted(args.buckets)
    rows = []
    for tensor in args.tensor:
        ex = JaxExecutor(
            model, CacheConfig(num_pages=256), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=buckets[-1]),
            ExecutorConfig(name="jax", token_buckets=buckets, mesh=MeshConfig(tensor), compilation_cache_dir=None),
            progress=False,
        )  # fmt: skip
        ex.warmup(sampling=False)
        for bucket in buckets:
            host = ex.packer.empty(bucket)
            times = []
            for i in range(args.calls + 1):
                t0 = time.perf_counter()
                jax.block_until_ready(ex._step(host))
                if i:
                    times.append(time.perf_counter() - t0)
            ops, measured = all_reduce_traffic(ex._compiled[bucket].as_text())
            predicted_ops = allreduces_per_step(model) if tensor > 1 else 0
            predicted = bucket * allreduce_bytes_per_token(model) if tensor > 1 else 0
            rows.append((
                tensor, bucket, f"{1e3 * statistics.median(times):.2f}", ops, predicted_ops, measured, predicted,
                "yes" if (ops, measured) == (predicted_ops, predicted) else "NO",
                f"{ring_bytes_per_device(measured, tensor):.0f}",
            ))  # fmt: skip
        if ex.metrics()["compiles_after_warmup"] != 0:
            raise SystemExit(f"tensor={tensor}: {ex.metrics()['compiles_after_warmup']} compiles after warmup")
    print(
        f"{model.num_layers} layers, d_model {model.d_model}, {model.dtype}, attention {ex.attention}; "
        f"{jax.device_count()} forced CPU devices on {os.cpu_count()} cores; empty batches, medians of {args.calls}"
    )
    header = ["tensor", "token bucket", "ms/step", "all-reduces (HLO)", "all-reduces (model)",
              "bytes all-reduced (HLO)", "bytes (model)", "equal", "ring bytes sent per device"]  # fmt: skip
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
