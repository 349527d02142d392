"""Benchmark: does this machine run the same work at one speed? Run it before judging a calibration.

    python benchmarks/machine_speed.py [--seconds 20] [--slice-ms 10] [--out machine_speed.json]

A fixed unit of pure-Python work (a counting loop, no allocation, no I/O, one thread) is timed
over and over in short slices for --seconds. On a machine with a steady speed the slices' times
sit within a few percent of each other; on a virtual machine whose host throttles or shares its
cores they spread, and can fall into two clusters (a fast and a slow speed) between which the
machine switches within milliseconds or stays for seconds. Every engine figure taken on such a
machine is a mixture of the two speeds in proportions that move from one minute to the next:
a profile fitted in one mixture and cells measured in another disagree by the speed ratio's
share, whatever the model (docs/CALIBRATION.md).

It prints the slices' percentiles against the fastest, the two clusters found (split where
two-means on the times' logarithms: two clusters when their medians differ by over --split
and each holds 5% of the slices), the share of time
in the slow one, how many times the machine switched and the longest stay in each, and the
steal time the kernel counted meanwhile (/proc/stat, where there is one). With --out, the
numbers as JSON. Run it alone: another process on the cores shows up as slow slices too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cbjax.report.tables import markdown_table  # noqa: E402


def work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def calibrate_unit(slice_s: float) -> int:
    """Loop iterations that take about `slice_s` at this machine's faster speed (the fastest of
    a few tries)."""
    n = 10_000
    best = min(_timed(n) for _ in range(5))
    return max(1000, int(n * slice_s / best))


def _timed(n: int) -> float:
    t = time.perf_counter()
    work(n)
    return time.perf_counter() - t


def steal_jiffies() -> Optional[int]:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    return int(fields[8]) if len(fields) > 8 else None


def split_modes(times: np.ndarray, min_gap: float, min_share: float = 0.05) -> Optional[float]:
    """The cut between a fast and a slow cluster of slice times (two-means on their logarithms),
    if the clusters' medians differ by over 1 + min_gap and each holds at least min_share of the
    slices; else None (one speed, however spread)."""
    x = np.log(times)
    lo, hi = np.percentile(x, 10), np.percentile(x, 90)
    if hi - lo < 1e-12:
        return None
    cut = (lo + hi) / 2
    for _ in range(50):
        fast, slow = x[x <= cut], x[x > cut]
        if not len(fast) or not len(slow):
            return None
        new = (fast.mean() + slow.mean()) / 2
        if abs(new - cut) < 1e-9:
            break
        cut = new
    fast, slow = times[x <= cut], times[x > cut]
    if min(len(fast), len(slow)) < min_share * len(times) or np.median(slow) / np.median(fast) <= 1 + min_gap:
        return None
    return float(np.exp(cut))


def runs(slow: np.ndarray, durations: np.ndarray) -> dict:
    """Switches between the clusters and the longest stay (seconds) in each."""
    longest = {False: 0.0, True: 0.0}
    switches, cur, stay = 0, bool(slow[0]), 0.0
    for is_slow, d in zip(slow, durations):
        if bool(is_slow) != cur:
            longest[cur] = max(longest[cur], stay)
            switches, cur, stay = switches + 1, bool(is_slow), 0.0
        stay += d
    longest[cur] = max(longest[cur], stay)
    return {"switches": switches, "longest_fast_s": longest[False], "longest_slow_s": longest[True]}


def measure(seconds: float, slice_s: float, min_gap: float) -> dict:
    n = calibrate_unit(slice_s)
    steal0, t0 = steal_jiffies(), time.perf_counter()
    times = []
    while time.perf_counter() - t0 < seconds:
        times.append(_timed(n))
    wall = time.perf_counter() - t0
    steal1 = steal_jiffies()
    a = np.array(times)
    fastest = float(a.min())
    out = {
        "slices": len(a),
        "unit_iterations": n,
        "wall_s": wall,
        "fastest_ms": fastest * 1e3,
        "p5_p50_p95_over_fastest": [float(np.percentile(a, q) / fastest) for q in (5, 50, 95)],
        "steal_s": None if steal0 is None or steal1 is None else (steal1 - steal0) / 100.0,
    }
    cut = split_modes(a, min_gap)
    if cut is None:
        out["modes"] = None
        return out
    slow = a > cut
    out["modes"] = {
        "fast_median_ms": float(np.median(a[~slow]) * 1e3),
        "slow_median_ms": float(np.median(a[slow]) * 1e3),
        "slow_over_fast": float(np.median(a[slow]) / np.median(a[~slow])),
        "slow_share_of_time": float(a[slow].sum() / a.sum()),
        **runs(slow, a),
    }
    return out


def report(r: dict) -> str:
    p5, p50, p95 = r["p5_p50_p95_over_fastest"]
    rows = [
        ["slices (each ~%.1f ms at the fastest)" % r["fastest_ms"], f"{r['slices']} in {r['wall_s']:.1f} s"],
        ["p5 / p50 / p95 over the fastest", f"{p5:.2f} / {p50:.2f} / {p95:.2f}"],
        ["steal time counted by the kernel", "-" if r["steal_s"] is None else f"{r['steal_s']:.2f} s"],
    ]
    m = r["modes"]
    if m is None:
        rows.append(["speeds", "one (no gap in the slices' times)"])
    else:
        rows += [
            ["speeds", f"two: {m['fast_median_ms']:.2f} ms and {m['slow_median_ms']:.2f} ms a slice ({m['slow_over_fast']:.2f}x)"],
            ["share of time at the slow speed", f"{m['slow_share_of_time']:.0%}"],
            ["switches; longest stay fast / slow", f"{m['switches']}; {m['longest_fast_s']:.2f} s / {m['longest_slow_s']:.2f} s"],
        ]
    return markdown_table(["figure", "value"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--slice-ms", type=float, default=10.0, help="one slice's work, at the machine's faster speed")
    parser.add_argument("--split", type=float, default=0.15, help="the smallest gap between the clusters' medians, as a fraction")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    for name in ("seconds", "slice_ms", "split"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    r = measure(args.seconds, args.slice_ms / 1e3, args.split)
    print(report(r))
    if args.out is not None:
        args.out.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
