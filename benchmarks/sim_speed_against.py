"""Benchmark: the simulator's speed against an earlier commit, side by side.

    python benchmarks/sim_speed_against.py [--ref e374f09] [--repeats 3] [--no-pin]

Makes a git worktree of `--ref` in a temporary folder, then runs, in turns (ref, this
checkout, ref, ...), each tree's own benchmarks: `benchmarks/sim_trace_replay.py` (the Azure
code trace in ../shared/traces at its real arrival times, one replica) and
`benchmarks/cluster_sim.py` (8 replicas). Each run is one process pinned to core 0
(`taskset -c 0`, unless --no-pin), so the two trees meet the same machine. Prints the median
seconds of each and their ratio (ref / this: above 1, this checkout is faster).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AZURE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"  # both trees read this one


def run(tree: Path, script: str, args: list[str], pin: bool) -> str:
    cmd = [sys.executable, f"benchmarks/{script}", *args]
    if pin and shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{tree}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def replay_seconds(out: str) -> float:
    """`sim_trace_replay.py`'s median simulate wall time."""
    return float(re.search(r"wall: simulate \(median\)\s*\|\s*([\d.]+) s", out).group(1))


def cluster_seconds(out: str, replicas: int) -> float:
    """`cluster_sim.py`'s CPU seconds of its `replicas`-replica row (the process's own time)."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == str(replicas):
            header = [c.strip() for c in out.splitlines()[0].strip().strip("|").split("|")]
            return float(cells[header.index("CPU s")])
    raise ValueError(f"no '{replicas} replicas' row in:\n{out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="e374f09")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    pin = not args.no_pin
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(ref), args.ref], cwd=REPO, check=True)
        try:
            times: dict[tuple[str, str], list[float]] = {}
            for i in range(args.repeats):
                for name, tree in (("ref", ref), ("this", REPO)):
                    out = run(tree, "sim_trace_replay.py", ["--repeats", "1", "--trace", str(AZURE)], pin)
                    times.setdefault((name, "replay"), []).append(replay_seconds(out))
                    out = run(tree, "cluster_sim.py", ["--replicas", str(args.replicas), "--baseline-repeats", "1",
                                                       "--source", str(AZURE)], pin)  # fmt: skip
                    times.setdefault((name, "cluster"), []).append(cluster_seconds(out, args.replicas))
                print(f"round {i + 1}/{args.repeats}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.2f} s" for k, v in times.items()),
                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=REPO, check=False)
    rows = [
        ("trace replay, 1 replica (wall s)", "replay"),
        (f"cluster, {args.replicas} replicas (CPU s)", "cluster"),
    ]
    print(f"| benchmark | {args.ref} | this checkout | {args.ref} / this |")
    print("|---|---|---|---|")
    for label, key in rows:
        a, b = statistics.median(times[("ref", key)]), statistics.median(times[("this", key)])
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    print(f"\nmedian of {args.repeats} runs each, in turns{', pinned to core 0' if pin else ''}")


if __name__ == "__main__":
    main()
