"""How long the native kernels' idle helper threads should wait before they block (the
`CBJAX_NATIVE_SPIN_US` knob, `native_common.h`): the engine's serving time at each value.

    python benchmarks/native_spin.py [--spins 0 50 2000] [--rounds 3] [--requests 96]
    python benchmarks/native_spin.py --micro [--spins 0 50 2000] [--rounds 5]

Engine mode: runs `cbjax executor=jax` (the tiny model, the native kernels, requests all arriving
at once) in a fresh process per run, alternating the spin values round by round, and prints each
value's median serving wall time (summary.json's wall_s, warmup excluded) and throughput. The
compilation cache is shared, so only the first run compiles.

--micro: a fresh process per spin value and round times "steps" of 20 back-to-back native
matmuls (4 rows x [256, 1024], split over the helper threads) with `--gap-us` of host time
between steps (the engine's scheduling and packing), and prints each value's median step time.
It separates the two waits the spin trades: within a step (the next kernel follows at once) and
between steps (a helper that still spins holds a core the host could use, one that sleeps must
be woken).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(spin: int, requests: int, out: Path) -> dict:
    env = dict(os.environ, CBJAX_NATIVE_SPIN_US=str(spin), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "cbjax", "executor=jax", "progress=false", f"workload.num_requests={requests}",
           "workload.arrival=all_at_once", f"hydra.run.dir={out}"]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    return json.loads((out / "summary.json").read_text())


MICRO = """
import os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from cbjax.kernels.native import layer_matmul, to_panels
rng = np.random.default_rng(0)
w = jnp.asarray(to_panels(rng.standard_normal((1, 256, 1024), dtype=np.float32)))
x0 = jnp.asarray(rng.standard_normal((4, 256), dtype=np.float32))

@jax.jit
def step(x):
    for _ in range(20):
        x = layer_matmul(x, w)[:, :256] * 0.01
    return x

gap = float(sys.argv[1]) * 1e-6
x = step(x0).block_until_ready()
times = []
for _ in range(400):
    t0 = time.perf_counter()
    x = step(x0).block_until_ready()
    times.append(time.perf_counter() - t0)
    end = time.perf_counter() + gap
    while time.perf_counter() < end:
        pass
print(statistics.median(times))
"""


def micro(spins: list[int], rounds: int, gap_us: float) -> None:
    times: dict[int, list[float]] = {s: [] for s in spins}
    for _ in range(rounds):
        for spin in spins:
            env = dict(os.environ, CBJAX_NATIVE_SPIN_US=str(spin), PYTHONPATH=str(REPO))
            out = subprocess.run([sys.executable, "-c", MICRO, str(gap_us)], env=env, cwd=REPO, check=True,
                                 capture_output=True, text=True, timeout=600)  # fmt: skip
            times[spin].append(float(out.stdout.strip().splitlines()[-1]))
    print(f"20 native matmuls a step (4 x [256, 1024]), {gap_us:.0f} us of host time between steps, "
          f"{os.cpu_count()} CPUs; median step of 400, per process; {rounds} alternating rounds")
    print("| CBJAX_NATIVE_SPIN_US | step ms (median of rounds) | step ms (each round) |")
    print("|---|---|---|")
    for spin in spins:
        each = ", ".join(f"{1e3 * t:.3f}" for t in times[spin])
        print(f"| {spin} | {1e3 * statistics.median(times[spin]):.3f} | {each} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--spins", type=int, nargs="+", default=[0, 50, 2000])
    ap.add_argument("--micro", action="store_true", help="time back-to-back native matmuls, not the engine")
    ap.add_argument("--gap-us", type=float, default=500.0, help="--micro: host time between steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    args = ap.parse_args()
    if args.micro:
        micro(args.spins, args.rounds, args.gap_us)
        return
    walls: dict[int, list[float]] = {s: [] for s in args.spins}
    tput: dict[int, list[float]] = {s: [] for s in args.spins}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for spin in args.spins:
                summary = run(spin, args.requests, Path(tmp) / f"r{r}_s{spin}")
                walls[spin].append(summary["wall_s"])
                tput[spin].append(summary["throughput_tok_s"])
    print(f"tiny model, {args.requests} requests at once, medians of {args.rounds} alternating rounds")
    print("| CBJAX_NATIVE_SPIN_US | wall_s (median) | wall_s (all) | tok/s (median) |")
    print("|---|---|---|---|")
    for spin in args.spins:
        all_w = ", ".join(f"{w:.2f}" for w in walls[spin])
        print(f"| {spin} | {statistics.median(walls[spin]):.2f} | {all_w} | {statistics.median(tput[spin]):.0f} |")


if __name__ == "__main__":
    main()
