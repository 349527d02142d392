"""Soak test: 10,000 requests on the real engine (tiny model); resident memory at 10% and 100%.

    JAX_PLATFORMS=cpu python benchmarks/soak.py [--num-requests 10000] [--max-num-seqs 32]

Builds a RunConfig and calls the public `run_single`, nothing below it. Progress is read from
the run's live request log (requests.jsonl.partial, flushed within a second): a watcher thread
samples the process's resident set size once 10% of the requests have finished; the 100%
sample is taken when `run_single` returns (every request served, the files written). A leak
shows as 100% / 10% well above 1; the bound is within 10% (ratio <= 1.10).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

from cbjax.config import ExecutorConfig, LengthConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.report.tables import markdown_table
from cbjax.app.run import run_single


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def count_rows(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def watch(partial: Path, need: int, samples: dict[str, int], done: threading.Event) -> None:
    """Sample RSS as "10%" when the live log first holds at least `need` rows."""
    while not done.is_set():
        if count_rows(partial) >= need:
            samples["10%"] = rss_bytes()
            return
        done.wait(0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = RunConfig(
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048),
        executor=ExecutorConfig(name="jax"),
        workload=WorkloadConfig(
            num_requests=args.num_requests,
            prompt_len=LengthConfig(dist="uniform", low=16, high=128),
            output_len=LengthConfig(dist="exponential", mean=32.0, max=128),
            vocab_size=512,  # the tiny model's vocabulary
        ),
        seed=args.seed,
        progress=False,
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_model_len=256))
    with tempfile.TemporaryDirectory(prefix="cbjax-soak-") as tmp:
        out = Path(tmp)
        need = max(1, args.num_requests // 10)
        samples: dict[str, int] = {}
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(out / "requests.jsonl.partial", need, samples, done), daemon=True)
        t0 = time.perf_counter()
        watcher.start()
        summary = run_single(cfg, out, verbose=False)
        samples["100%"] = rss_bytes()
        done.set()
        watcher.join()
        wall = time.perf_counter() - t0
    mib = lambda b: f"{b / 2**20:.1f}" if b is not None else "-"  # noqa: E731
    at10, at100 = samples.get("10%"), samples.get("100%")
    ratio = f"{at100 / at10:.3f}" if at10 and at100 else "-"
    print(f"soak: {summary['num_finished']} of {summary['num_requests']} requests finished, "
          f"{summary['iterations']} iterations, {wall:.0f} s")  # fmt: skip
    print(markdown_table(
        ["RSS (MiB)", "at 10%", "at 100%", "100% / 10%"],
        [[f"{args.num_requests} requests", mib(at10), mib(at100), ratio]],
    ))  # fmt: skip


if __name__ == "__main__":
    main()
