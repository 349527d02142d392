"""Benchmark: warmup of `cbjax executor=jax` (tiny model, defaults) cold and with a warm compilation cache.

    python benchmarks/warmup.py [--repeats 3] [extra overrides ...]

Each repeat makes a fresh, empty `executor.compilation_cache_dir` and runs the CLI twice in
fresh subprocesses with it: the first run compiles every program (cold), the second finds them
in JAX's persistent cache (warm). Prints warmup_s from each run's summary.json, cold and warm
side by side, with medians over repeats, plus compiled_programs, warmup_compiles (XLA
compiles warmup ran: 0 on the warm run when every program came from the cache) and the
cache's size. Extra
arguments are passed to both runs as Hydra overrides (e.g. workload.num_requests=8 to shorten
the serving that follows warmup; it does not change what warmup compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cbjax.report.tables import markdown_table

CLI = "from cbjax.app.cli import main; main()"


def run_cli(cache_dir: Path, run_dir: Path, overrides: list[str]) -> dict:
    """One `cbjax executor=jax` run in a fresh process; its summary.json plus the process's wall time."""
    cmd = [sys.executable, "-c", CLI, "executor=jax", f"executor.compilation_cache_dir={cache_dir}",
           f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["process_s"] = wall
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = ap.parse_args()
    rows, cold, warm = [], [], []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cache_dir = Path(tmp) / "jax_cache"
            first = run_cli(cache_dir, Path(tmp) / "cold", args.overrides)
            cache_mb = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) / 2**20
            second = run_cli(cache_dir, Path(tmp) / "warm", args.overrides)
        cold.append(first["warmup_s"])
        warm.append(second["warmup_s"])
        rows.append((i + 1, f"{first['warmup_s']:.2f}", f"{second['warmup_s']:.2f}", first["compiled_programs"],
                     f"{first.get('warmup_compiles', '')} / {second.get('warmup_compiles', '')}", f"{cache_mb:.1f}",
                     f"{first['process_s']:.1f}", f"{second['process_s']:.1f}"))  # fmt: skip
    rows.append(("median", f"{statistics.median(cold):.2f}", f"{statistics.median(warm):.2f}", "", "", "", "", ""))
    extra = f" {' '.join(args.overrides)}" if args.overrides else ""
    print(f"cbjax executor=jax{extra} (tiny model, defaults), fresh processes, a fresh compilation cache per repeat")
    print(markdown_table(["repeat", "warmup_s cold", "warmup_s warm cache", "compiled_programs",
                          "warmup_compiles cold / warm", "cache MB",
                          "process s cold", "process s warm"], rows))  # fmt: skip
    print(f"\nmedian warmup: {statistics.median(cold):.2f} s cold, {statistics.median(warm):.2f} s with a warm cache "
          f"(targets: <= 15 s cold, <= 3 s warm)")  # fmt: skip


if __name__ == "__main__":
    main()
