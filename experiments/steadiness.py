"""How steady the engine's own speed is on this machine: one workload served again and again.

    python experiments/steadiness.py model=smollm_135m scheduler.max_num_seqs=8 \
        scheduler.max_num_batched_tokens=256 --run fcfs_poisson_60pct --runs 12

Serves one of the profile's own workloads (`cbjax.profile.serving.serving_runs`, round 0's
requests and arrivals: the same ones every time) `--runs` times on one warm engine, and reports
per run the median time of its most common step (the decode shape, rows and bucket, served most
often over all runs). Nothing but the moment changes between runs, so their spread is the
machine's: no simulator can be judged nearer to the engine than that. A profile's residual
table by regime judges a few runs per regime, and a calibration cell five: on a machine whose
runs fall into two speeds, either reads that mix as much as the model.

After each run it also times the machine itself (`stream_gb_s`): numpy summing a 128 MB array
on one thread, then one array per core on as many threads at once. Where the engine's runs
fall at two speeds and the second figure follows them while the first does not, the cores'
joint memory bandwidth is what moves (docs/CALIBRATION.md, "When to pin").

Writes the runs and the summary (`steadiness`) as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cbjax.report.files import unwritable, write_json  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402

CONFIG_DIR = REPO / "configs"
# runs this near the median of all runs' medians count as at its speed (the calibration's
# SPEED_TOLERANCE, `cbjax.profile.anchor`)
NEAR = 0.05


def steadiness(medians: list[float], near: float = NEAR) -> dict[str, Any]:
    """Over per-run median step times: their median, the fastest and slowest run, the slowest over
    the fastest less 1 (`spread`), and how many runs lie within `near` of the median (`near_median`).
    An empty list is a ValueError."""
    if not medians:
        raise ValueError("medians: no runs")
    mid = statistics.median(medians)
    return {
        "runs": len(medians), "median_s": mid, "fastest_s": min(medians), "slowest_s": max(medians),
        "spread": max(medians) / min(medians) - 1.0,
        "near_median": sum(abs(m / mid - 1.0) <= near for m in medians), "near": near,
    }  # fmt: skip


def stream_gb_s(threads: int, mb: int = 128, sums: int = 10) -> float:
    """GB/s that `threads` threads at once read summing `sums` times an array of `mb` MB each
    (numpy's sum releases the GIL): one thread measures a core's memory bandwidth, one per core
    the cores' together."""
    import threading

    import numpy as np

    arrays = [np.ones(mb * 1024 * 1024 // 8) for _ in range(threads)]
    work = [threading.Thread(target=lambda a=a: [a.sum() for _ in range(sums)]) for a in arrays]
    t0 = time.perf_counter()
    for t in work:
        t.start()
    for t in work:
        t.join()
    return threads * sums * arrays[0].nbytes / 1e9 / (time.perf_counter() - t0)


def compose(overrides: list[str]):
    """The profile's config (`configs/profile.yaml`) with `overrides`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    import cbjax.profile.__main__  # noqa: F401  registers the profile's config schema

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return OmegaConf.to_object(hydra_compose(config_name="profile", overrides=["progress=false", *overrides]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "overrides", nargs="*", help="the profile's Hydra overrides (model=..., scheduler.max_num_seqs=...)"
    )
    ap.add_argument("--runs", type=int, default=12, help="times the workload is served (default 12)")
    ap.add_argument(
        "--run", default="fcfs_poisson_60pct", help="which of the profile's workloads (default fcfs_poisson_60pct)"
    )
    ap.add_argument("--out", default="outputs/steadiness.json", help="where the JSON goes")
    ap.add_argument("--cores", type=int, default=None, help="pin the process to the first N CPUs (default: unpinned)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="serve --runs unpinned and --runs pinned to one core (two processes, one after the "
                         "other) and print both summaries side by side")  # fmt: skip
    args = ap.parse_args(argv)
    if args.runs < 2:
        ap.error(f"--runs: at least 2 to compare, got {args.runs}")
    if problem := unwritable(Path(args.out).parent):  # found now, not after the runs
        ap.error(f"--out: {problem}")
    if args.side_by_side:
        side_by_side(args)
        return
    from cbjax.profile.pinning import pin

    try:
        pinning = pin(args.cores, key="--cores")
    except ValueError as err:
        ap.error(str(err))
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts
    from cbjax.profile.serving import serve_timed, served_points, serving_runs
    from cbjax.app.run import build_executor, resolve

    cfg = resolve(compose(args.overrides))
    executor = build_executor(cfg)
    executor.warmup(sampling=False)  # the profile's runs are greedy
    runs = dict(serving_runs(cfg, None, 0))
    if "poisson" in args.run:  # the Poisson rates are shares of the first burst's request rate
        first = next(iter(runs.values()))
        runs = dict(serving_runs(cfg, first.workload.num_requests / serve_timed(executor, first).makespan, 0))
    if args.run not in runs:
        ap.error(f"--run: unknown workload {args.run!r}; choose one of {', '.join(runs)}")
    served = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for i in range(args.runs):
        t0 = time.perf_counter()
        steps, _ = served_points(args.run, serve_timed(executor, runs[args.run]), executor.shapes)
        served.append({"wall_s": time.perf_counter() - t0, "steps": steps, "stream_1_gb_s": stream_gb_s(1),
                       "stream_all_gb_s": stream_gb_s(cores)})  # fmt: skip
        print(f"[{i + 1}/{args.runs}] {args.run}: {served[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    # steps the loop idled before or collected with nothing behind them cost otherwise (`served_points`)
    plain = lambda s: s["kind"] == "decode" and not s.get("idle") and not s.get("uncovered")  # noqa: E731
    shape = Counter((s["rows"], s["bucket"]) for r in served for s in r["steps"] if plain(s)).most_common(1)[0][0]
    rows = []
    for i, r in enumerate(served):
        times = sorted(s["measured_s"] for s in r["steps"] if plain(s) and (s["rows"], s["bucket"]) == shape)
        rows.append({"run": i, "wall_s": r["wall_s"], "steps": len(times), "median_s": statistics.median(times),
                     "p10_s": times[len(times) // 10], "p90_s": times[9 * len(times) // 10],
                     "stream_1_gb_s": r["stream_1_gb_s"], "stream_all_gb_s": r["stream_all_gb_s"]})  # fmt: skip
    summary = steadiness([r["median_s"] for r in rows])
    print(f"{args.run} served {args.runs} times; decode steps of {shape[0]} rows in bucket {shape[1]} (ms):")
    print(markdown_table(["run", "wall s", "steps", "median", "p10", "p90", "GB/s, 1 thread", f"GB/s, {cores} threads"],
                         [[r["run"], f"{r['wall_s']:.1f}", r["steps"]] + [f"{1e3 * r[k]:.2f}" for k in ("median_s", "p10_s", "p90_s")]
                          + [f"{r['stream_1_gb_s']:.0f}", f"{r['stream_all_gb_s']:.0f}"] for r in rows]))  # fmt: skip
    print(f"runs' medians: fastest {1e3 * summary['fastest_s']:.2f} ms, slowest {1e3 * summary['slowest_s']:.2f} ms "
          f"(+{100 * summary['spread']:.0f}%); {summary['near_median']} of {summary['runs']} within "
          f"{100 * NEAR:.0f}% of their median {1e3 * summary['median_s']:.2f} ms")  # fmt: skip
    out = Path(args.out)
    write_json(out, {"overrides": args.overrides, "run": args.run, "shape": {"rows": shape[0], "bucket": shape[1]},
                     "pinning": pinning, "runs": rows, "summary": summary})  # fmt: skip
    print(f"wrote {out}")


def side_by_side(args: argparse.Namespace) -> None:
    """This script twice, in child processes one after the other: unpinned, then pinned to one
    core; both summaries in one table (`--out` gets both)."""
    import subprocess
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("unpinned", []), ("pinned, 1 core", ["--cores", "1"])):
            out = Path(tmp) / f"{len(results)}.json"
            cmd = [sys.executable, __file__, *args.overrides, "--runs", str(args.runs), "--run", args.run,
                   "--out", str(out), *extra]  # fmt: skip
            print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results[name] = json.loads(out.read_text())
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rows.append([name, s["runs"], f"{1e3 * s['median_s']:.2f}", f"{1e3 * s['fastest_s']:.2f}",
                     f"{1e3 * s['slowest_s']:.2f}", f"+{100 * s['spread']:.0f}%", f"{s['near_median']} of {s['runs']}"])  # fmt: skip
    print(f"{args.run}: each run's median of its most common decode step (ms)")
    print(markdown_table(["setting", "runs", "median", "fastest", "slowest", "spread", f"within {100 * NEAR:.0f}%"], rows))
    out = Path(args.out)
    write_json(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
