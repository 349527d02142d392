"""Benchmark: wall time of a simulated cluster against one replica (roofline cost model).

    python benchmarks/cluster_sim.py [--requests 20000] [--replicas 8] [--router least_loaded]

The trace: `--requests` (prompt, output) length pairs drawn with replacement from the Azure
code trace (../shared/traces), Poisson arrivals at `--rate-per-replica` x replicas. One replica
serves 1/replicas of it at 1/replicas of the rate, so the load per replica is alike; both keep
the per-iteration service log a run keeps (client_service). Prints a table: wall and CPU
time (the process's own: on a shared machine wall time counts other processes' turns),
simulated iterations, and the CPU cost per iteration of each, against one replica's. Each row
reports its fastest run's CPU figures (the one-replica baseline, a short run, is repeated
`--baseline-repeats` times so that its noise does not swing the ratio) and the median wall time.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import sys

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's cbjax, installed or not

from cbjax.cluster import ClusterSim  # noqa: E402
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, RunConfig, SchedulerConfig, WorkloadConfig  # noqa: E402
from cbjax.engine.offline import serve  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.app.config_merge import from_dict  # noqa: E402
from cbjax.app.run import build_executor  # noqa: E402
from cbjax.scheduler import Scheduler  # noqa: E402
from cbjax.report.service import ServiceLog  # noqa: E402
from cbjax.workload import build_workload  # noqa: E402

AZURE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"


def model_config(name: str):
    import yaml

    from cbjax.config import ModelConfig

    return from_dict(ModelConfig, yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text()) or {})


def write_trace(path: Path, source: Path, num: int, rate: float, seed: int) -> None:
    """A CSV trace (arrival_s, prompt_len, output_len) of `num` length pairs of `source`."""
    with source.open() as f:
        pairs = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pairs), size=num)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num))
    with path.open("w") as f:
        f.write("arrival_s,prompt_len,output_len\n")
        for t, i in zip(arrivals, picks):
            f.write(f"{t:.6f},{pairs[i][0]},{max(1, pairs[i][1])}\n")


def timed(cfg: RunConfig, replicas: int) -> dict:
    requests = build_workload(cfg.workload, cfg.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    if replicas == 1:
        sched = Scheduler(cfg.scheduler, cfg.cache, cfg.model.max_model_len)
        result = serve(requests, sched, build_executor(cfg), on_step=ServiceLog().on_step)  # as run_single
    else:
        cfg = dataclasses.replace(cfg, cluster=ClusterConfig(replicas=replicas, router=cfg.cluster.router))
        result = ClusterSim(cfg, build_executor).serve(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    iters = result.stats.iterations
    return {"wall_s": wall, "cpu_s": cpu, "iterations": iters, "requests": len(requests), "makespan_s": result.makespan_s,
            "us_per_iteration": cpu / iters * 1e6 if iters else 0.0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--rate-per-replica", type=float, default=2.0, help="req/s per replica")
    ap.add_argument("--router", default="least_loaded")
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--num-pages", type=int, default=28000, help="KV pages of 16 tokens (Llama-3-8B on A100-80GB)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--baseline-repeats", type=int, default=3,
        help="runs of the one-replica baseline (short: its CPU per iteration is the fastest run's)",
    )  # fmt: skip
    ap.add_argument("--source", default=str(AZURE))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for replicas, num in ((1, args.requests // args.replicas), (args.replicas, args.requests)):
            path = Path(tmp) / f"trace_{replicas}.csv"
            write_trace(path, Path(args.source), num, args.rate_per_replica * replicas, seed=0)
            cfg = RunConfig(
                scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
                # no prefix cache: the figures of docs/benchmarks.md, and older trees, run without it
                cache=CacheConfig(page_size=16, num_pages=args.num_pages, prefix_caching=False),
                executor=ExecutorConfig(name="sim", cost_model="roofline"),
                workload=WorkloadConfig(name="trace", path=str(path), format="csv"),
                model=model_config(args.model),
                cluster=ClusterConfig(router=args.router),
                progress=False,
            )
            repeats = max(args.repeats, args.baseline_repeats) if replicas == 1 else args.repeats
            runs = [timed(cfg, replicas) for _ in range(repeats)]
            run = min(runs, key=lambda r: r["cpu_s"])
            rows.append([replicas, run["requests"], f"{run['makespan_s']:.0f}", run["iterations"],
                         f"{statistics.median(r['wall_s'] for r in runs):.2f}", f"{run['cpu_s']:.2f}",
                         f"{run['us_per_iteration']:.1f}"])  # fmt: skip
    base = float(rows[0][6])
    for row in rows:
        row.append(f"{float(row[6]) / base:.2f}x")
    header = [
        "replicas",
        "requests",
        "simulated s",
        "iterations",
        "wall s",
        "CPU s",
        "CPU us / iteration",
        "vs 1 replica",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
