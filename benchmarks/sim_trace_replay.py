"""Benchmark: wall time to replay a trace in the simulator (default: the Azure code trace, roofline).

    python benchmarks/sim_trace_replay.py [--trace PATH] [--repeats 5] [--model llama3_8b]

Prints the median wall time of the load and of the simulation, with the simulated figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from cbjax.config import CacheConfig, ExecutorConfig, HardwareConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.engine.offline import serve
from cbjax.report.metrics import summarize
from cbjax.report.tables import markdown_table
from cbjax.app.config_merge import from_dict
from cbjax.app.run import build_executor
from cbjax.scheduler import Scheduler
from cbjax.workload import build_workload

REPO = Path(__file__).resolve().parents[1]
AZURE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"


def model_config(name: str):
    import yaml

    from cbjax.config import ModelConfig

    return from_dict(ModelConfig, yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text()) or {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(AZURE))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--num-pages", type=int, default=28000, help="KV pages of 16 tokens (Llama-3-8B on A100-80GB)")
    args = ap.parse_args()
    cfg = RunConfig(
        scheduler=SchedulerConfig(name="fcfs", max_num_seqs=256, max_num_batched_tokens=8192),
        # no prefix cache: the figures of docs/benchmarks.md, and older trees, run without it
        cache=CacheConfig(page_size=16, num_pages=args.num_pages, prefix_caching=False),
        executor=ExecutorConfig(name="sim", cost_model="roofline"),
        workload=WorkloadConfig(name="trace", path=args.trace),
        model=model_config(args.model),
        hardware=HardwareConfig(),
        progress=False,
    )
    loads, sims, totals = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        requests = build_workload(cfg.workload, cfg.seed)
        t1 = time.perf_counter()
        sched = Scheduler(cfg.scheduler, cfg.cache, cfg.model.max_model_len)
        result = serve(requests, sched, build_executor(cfg))
        summary = summarize(result)
        t2 = time.perf_counter()
        loads.append(t1 - t0)
        sims.append(t2 - t1)
        totals.append(t2 - t0)
    rows = [
        ("requests", summary["num_requests"]),
        ("iterations simulated", summary["iterations"]),
        ("simulated makespan", f"{summary['makespan_s']:.1f} s"),
        ("simulated throughput", f"{summary['throughput_tok_s']:.1f} tok/s"),
        ("wall: load trace (median)", f"{statistics.median(loads):.3f} s"),
        ("wall: simulate (median)", f"{statistics.median(sims):.3f} s"),
        ("wall: total (median of %d)" % args.repeats, f"{statistics.median(totals):.3f} s"),
        ("simulated iterations per wall second", f"{summary['iterations'] / statistics.median(sims):,.0f}"),
        ("target", "< 5 s total (Vidur: ~120 CPU-s per configuration)"),
    ]
    print(markdown_table(["figure", f"{Path(args.trace).name}, {args.model}, a100_80gb, roofline"], rows))


if __name__ == "__main__":
    main()
