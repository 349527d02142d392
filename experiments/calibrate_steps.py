"""Where the profiled simulator and the engine disagree: one calibration workload served on the engine,
each iteration's step and the loop's host time against the profile's prediction, by batch kind and bucket.

    python experiments/calibrate_steps.py --profile outputs/profile/profile.json --workload poisson_30 --policy fcfs [--chunked]

The workloads are experiments/calibrate.py's. Steps after the loop idled (it turned more than
once waiting for an arrival) are listed apart, with the profile's wake cost for their idle gap
added to their prediction; gaps over 2 ms are left out of the loop's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

import calibrate  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.profile.acceptance import signed_error_pct  # noqa: E402

IDLE_GAP_S = 0.002


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--profile", required=True, help="profile.json from `python -m cbjax.profile`")
    ap.add_argument("--workload", default="burst", choices=list(calibrate.WORKLOADS))
    ap.add_argument("--policy", default="fcfs", choices=calibrate.POLICIES)
    ap.add_argument("--chunked", action="store_true", help="scheduler.chunked_prefill=true")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--trace", default=str(calibrate.AZURE_CODE))
    args = ap.parse_args()
    profile = calibrate.read_profile_arg(ap, args.profile)
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts
    from cbjax.profile.serving import serve_timed, served_points
    from cbjax.app.run import build_executor
    from cbjax.sim.profiled import cold_cost, load_profile, predict

    base = calibrate.base_config(profile, args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        wl = calibrate.workloads(base, Path(tmp), args.profile, Path(args.trace))[args.workload]
        sched = dataclasses.replace(base.scheduler, name=args.policy, chunked_prefill=args.chunked)
        cfg = dataclasses.replace(base, scheduler=sched, workload=wl)
        coef = load_profile(args.profile, cfg.model, cfg.cache.page_size, cfg.scheduler.max_num_seqs)["coefficients"]
        executor = build_executor(cfg)
        executor.progress = executor.sampling = False
        executor.warmup()
        timed = serve_timed(executor, cfg)
    steps, gaps = served_points(args.workload, timed, executor.shapes)
    groups: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for s in steps:  # the recorder's own idle flag: a pipelined engine leaves no gaps to read it from
        woke = s["idle"]
        pred = predict(coef, s["bucket"], s["features"]) + cold_cost(coef, s["since_larger"])
        pred += coef["wake_s"] * min(1.0, s["idle_s"] / max(coef["wake_ramp_s"], 1e-9)) if woke else 0.0
        g = groups[(s["kind"] + (" after idle" if woke else ""), s["bucket"])]
        g[0] += 1
        g[1] += s["measured_s"]
        g[2] += pred
    rows = [(kind, bucket, n, f"{1e3 * m / n:.2f}", f"{1e3 * p / n:.2f}", f"{signed_error_pct(p, m):+.1f}", f"{m:.3f}")
            for (kind, bucket), (n, m, p) in sorted(groups.items())]  # fmt: skip
    print(f"{args.workload}, {args.policy}, chunked prefill {'on' if args.chunked else 'off'}: {len(steps)} iterations")
    print(
        markdown_table(
            ["kind", "bucket", "iterations", "measured ms", "predicted ms", "error %", "measured s in all"], rows
        )
    )
    busy = [(n, g) for n, g in gaps if g <= IDLE_GAP_S]
    m_loop = sum(g for _, g in busy)
    p_loop = sum(coef["loop_s"] + coef["loop_seq_s"] * n for n, _ in busy)
    m_step = sum(v[1] for v in groups.values())
    p_step = sum(v[2] for v in groups.values())
    print(f"\nsteps: measured {m_step:.3f} s, predicted {p_step:.3f} s ({signed_error_pct(p_step, m_step):+.1f}%)")
    if not gaps:  # pipelined: each step's share of the wall clock holds the loop's host time
        print("loop: inside the steps (a pipelined engine overlaps it with the step in flight)")
    elif m_loop > 0:
        print(f"loop between busy steps: measured {m_loop:.3f} s, predicted {p_loop:.3f} s "
              f"({signed_error_pct(p_loop, m_loop):+.1f}%); {len(gaps) - len(busy)} idle gaps left out")  # fmt: skip


if __name__ == "__main__":
    main()
