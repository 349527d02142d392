"""Benchmark: is the paced simulator faithful to itself?

    python benchmarks/serve_paced.py [--repeats 3] [--rate 8] [--num-requests 240] [--step-s 0.02]
        [--out DIR] [OVERRIDE ...]

Runs one Poisson workload on the simulator two ways, --repeats times each:
1. paced: `cbjax-serve executor=sim executor.pace=realtime`, driven by `cbjax-bench` open loop at
   the workload's arrival times (client-side times, and the server's own requests.jsonl);
2. offline: the same simulator in-process (`executor.pace=none`, the virtual clock).
Every simulated step costs `overhead.step_s` (--step-s) on top of the roofline of the tiny
model, so steps are long enough for the pacing to matter and short enough to be realistic.
Each repeat draws a new workload (seed = the repeat's index), the same for both ways: a
TTFT p50 over a few hundred requests still carries the sampling error of where arrivals fall
between step boundaries, and new draws average it out rather than repeat it. It prints TTFT
and TPOT p50 as median [min, max] over the repeats, and the per-repeat ratios paced /
offline as median [min, max]; the bound: the client's within 5% of 1. Bounded:
about 30 s of load per paced run. OVERRIDEs (Hydra `key=value`) apply to both ways. Measure
on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from serve_overhead import ROOT, offline, served  # first: puts this checkout's cbjax on the path

from cbjax.report.tables import markdown_table


def server_summary(out: Path) -> dict:
    """TTFT and TPOT p50 from the paced server's requests.jsonl (its own clock)."""
    rows = [json.loads(line) for line in (out / "server" / "requests.jsonl").read_text().splitlines()]
    ttft = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in rows if r.get("tpot_s") is not None]
    return {"ttft_s_p50": statistics.median(ttft) if ttft else None, "tpot_s_p50": statistics.median(tpot) if tpot else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests per second")
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--step-s", type=float, default=0.02, help="simulated host time per step (overhead.step_s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "serve_paced")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both ways (model, scheduler, lengths)")
    args = parser.parse_args(argv)
    lengths = ["workload.prompt_len.dist=uniform", "workload.prompt_len.low=16", "workload.prompt_len.high=256",
               "workload.output_len.dist=exponential", "workload.output_len.mean=32", "workload.output_len.max=128"]  # fmt: skip
    mine = [*lengths, *args.overrides]
    workload = [f"workload.num_requests={args.num_requests}", "workload.arrival=poisson", f"workload.rate={args.rate}",
                *(o for o in mine if o.startswith(("workload.", "workload=", "seed=", "slo.")))]  # fmt: skip
    engine = ["executor=sim", "model=tiny", "hardware=a100_80gb", f"overhead.step_s={args.step_s}",
              *(o for o in mine if o not in workload)]  # fmt: skip
    runs: dict[str, list[dict]] = {"offline sim": [], "paced (client)": [], "paced (server)": []}
    for i in range(args.repeats):
        out = args.out / f"r{i}"
        print(f"repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
        # a new workload each repeat (seed), the same for both ways within it
        seeded = [*workload, f"seed={i}"]
        runs["offline sim"].append(offline([*engine, "executor.pace=none", *seeded], out / "offline"))
        runs["paced (client)"].append(served([*engine, "executor.pace=realtime"], seeded, out / "paced"))
        runs["paced (server)"].append(server_summary(out / "paced"))

    def med(name: str, key: str):
        vals = [s[key] for s in runs[name] if s.get(key) is not None]
        return (statistics.median(vals), min(vals), max(vals)) if vals else None

    rows = []
    for label, key in (("TTFT p50 (ms)", "ttft_s_p50"), ("TPOT p50 (ms)", "tpot_s_p50")):
        cells = []
        for name in runs:
            m = med(name, key)
            cells.append("-" if m is None else f"{m[0] * 1e3:.2f} [{m[1] * 1e3:.2f}, {m[2] * 1e3:.2f}]")
        ratios = []
        for name in ("paced (client)", "paced (server)"):
            per = [a[key] / b[key] for a, b in zip(runs[name], runs["offline sim"]) if a.get(key) is not None and b.get(key)]
            ratios.append(f"{statistics.median(per):.3f} [{min(per):.3f}, {max(per):.3f}]" if per else "-")
        rows.append([label, *cells, *ratios])
    header = ["metric (median [min, max])", *runs, "client / offline", "server / offline"]  # ratios: per repeat
    print(f"\nexecutor=sim, step {args.step_s * 1e3:.0f} ms, {args.num_requests} requests at {args.rate}/s, "
          f"medians of {args.repeats}\n")  # fmt: skip
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
