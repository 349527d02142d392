"""The profiled simulator against the engine under speculative decoding, fed the engine's own acceptance.

    python -m cbjax.profile cores=1 spec=ngram spec.num_tokens=3 progress=false hydra.run.dir=outputs/spec_fidelity/profile
    python experiments/spec_fidelity.py --profile outputs/spec_fidelity/profile/profile.json [--runs 5] [--max-rounds 20] [--out outputs/spec_fidelity]

The profile must be taken with speculation on, at the k judged here: its grid then times verify
steps (decodes of 1 + k tokens), and its served runs go through the loop a speculating engine
runs, one step at a time (the next plan needs the accepted drafts, so nothing is pipelined), which
is where the loop's own host time (`loop_s`, `loop_seq_s`: scheduling, the n-gram lookup, the
commit of accepted tokens) is measured. A profile lacking either is refused, naming what is
missing. Made with `cores=1`, it pins this script's engine runs to one core as well.

Two cells, both `spec.method=ngram spec.num_tokens=3` (fixed k), on the tiny model with the
profile's shapes (calibrate.py's `base_config`) and outputs of 64-192 tokens: the tiny model's
random weights under greedy decoding fall into loops, so its later outputs repeat earlier ones
and prompt lookup drafts them right (the script prints each cell's acceptance rate, and says so
when it lies below MIN_ACCEPTANCE):

- burst: every request at t=0 (closed loop);
- poisson_50: Poisson arrivals at half capacity, the capacity being the request rate the
  engine's first burst run served (its `throughput_req_s`), measured here, with speculation on.

Each cell runs on the engine, the cells interleaved round by round (burst, then Poisson), each
run writing its `spec_trace.jsonl`, until each has `--runs` runs made at the profile's machine
speed: the profile's anchor (`cbjax.profile.anchor`) is timed before the first run and after
each, and a run counts only when both timings around it lie within 5% of the profile's
(`calibrate.engine_rounds`, as the calibration judges its runs). This machine's speed drifts by
more than the targets within minutes; a run in another spell measures another machine. Runs off
speed are kept and reported beside the judged ones, not judged. The simulator (`executor.cost_model=profiled`)
replays each run's trace (`spec.acceptance=trace`); greedy n-gram drafts depend on the tokens
alone, but how many a step verifies depends on the token budget and pages left, so a Poisson
run's batches, and its trace, may differ from run to run: identical traces are simulated once.
Per cell and figure (output throughput and E2E p50): the engine's median and range over its
runs, the simulator's (the median over the runs' traces), its signed error against the engine's
median (+: over-predicts) and whether it lies within the target (throughput 5%, E2E p50 10%).

Prints one markdown table; writes every run's summary and the table as JSON to
`--out`/spec_fidelity.json, and each run's files under `--out`/runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import base_config, engine_rounds, profile_anchor, read_profile_arg, sim_config  # noqa: E402
from cbjax.config import LengthConfig, RunConfig, SpecConfig  # noqa: E402
from cbjax.profile.acceptance import signed_error_pct  # noqa: E402
from cbjax.report.files import unwritable, write_json  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.spec.trace import TRACE_FILE  # noqa: E402

K = 3
CELLS = ("burst", "poisson_50")
HALF = 0.5  # the Poisson cell's share of the burst's request rate
FIGURES = (("throughput_tok_s", "throughput (tok/s)"), ("e2e_s_p50", "E2E p50 (s)"))
TARGETS = {"throughput_tok_s": 5.0, "e2e_s_p50": 10.0}  # |signed error| %
# below this share of drafts accepted a cell measures little speculation: said, not judged
MIN_ACCEPTANCE = 0.3
MIN_RUNS = 5  # fewer engine runs per cell: a smoke run, not evidence
OUTPUT_LEN = LengthConfig(dist="uniform", low=64, high=192)


def half_capacity_rate(burst_req_s: float, share: float = HALF) -> float:
    """The Poisson cell's arrival rate (requests/s): `share` of the request rate a burst served."""
    if not (isinstance(burst_req_s, (int, float)) and math.isfinite(burst_req_s) and burst_req_s > 0):
        raise ValueError(f"half_capacity_rate: the burst's throughput_req_s must be a positive number, got {burst_req_s!r}")
    return share * burst_req_s


def trace_groups(traces: Sequence[str]) -> list[int]:
    """For each run's trace text, the index of the first run with the same text: runs with equal
    indices share one simulation."""
    first: dict[str, int] = {}
    return [first.setdefault(t, i) for i, t in enumerate(traces)]


def judge_figure(engine: Sequence[float], simulated: Sequence[float], target_pct: Optional[float]) -> dict:
    """One figure of a cell: the engine's median and range over its runs, the simulator's median
    over its runs, the signed error % of the latter against the former, and whether it lies
    within `target_pct` (None: no target, not judged)."""
    if not engine or not simulated:
        raise ValueError("judge_figure: needs at least one engine run and one simulation")
    eng, sim = statistics.median(engine), statistics.median(simulated)
    error = signed_error_pct(sim, eng)
    ok = None if target_pct is None else bool(abs(error) <= target_pct)
    return {"engine_median": float(eng), "engine_range": [float(min(engine)), float(max(engine))],
            "simulator": float(sim), "error_pct": float(error), "target_pct": target_pct, "pass": ok}  # fmt: skip


def judge_cell(name: str, engine: Sequence[dict], simulated: Sequence[dict]) -> dict:
    """A cell's figures (FIGURES, against TARGETS) from its engine runs' and its simulations'
    summaries, and their acceptance rates (medians)."""
    cell = {"cell": name, "runs": len(engine)}
    for key, _ in FIGURES:
        cell[key] = judge_figure([e[key] for e in engine], [s[key] for s in simulated], TARGETS.get(key))
    for who, runs in (("engine", engine), ("simulator", simulated)):
        rates = [r["spec_acceptance_rate"] for r in runs if r.get("spec_acceptance_rate") is not None]
        cell[f"{who}_acceptance_rate"] = statistics.median(rates) if rates else None
    return cell


def table_rows(cells: Sequence[dict]) -> list[list[str]]:
    """The printed table's rows: per cell and figure, the engine's median [range], the simulator,
    the signed error and the verdict."""
    rows = []
    for c in cells:
        for key, label in FIGURES:
            j = c[key]
            lo, hi = j["engine_range"]
            verdict = "-" if j["pass"] is None else ("pass" if j["pass"] else "FAIL")
            rows.append([c["cell"], label, f"{j['engine_median']:.4g} [{lo:.4g}, {hi:.4g}]", f"{j['simulator']:.4g}",
                         f"{j['error_pct']:+.1f}%", f"{verdict} (±{j['target_pct']:g}%)"])  # fmt: skip
    return rows


def _rate(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def check_profile(profile: dict, k: int) -> list[str]:
    """What the profile lacks to price a speculating engine at `k` drafts: verify steps of 1 + k
    tokens per row in its grid, and the loop's host time between steps (served runs one step at
    a time, as speculation runs). Empty: nothing."""
    problems = []
    verify = [s for s in profile.get("steps", []) if s.get("kind") == "verify" and s["tokens"] == (1 + k) * s["rows"]]
    if not verify:
        problems.append(f"its grid has no verify step of 1 + {k} tokens per row")
    if not profile.get("gaps"):
        problems.append("its served runs were pipelined: the loop's host time between steps was not measured")
    return problems


def cell_config(base: RunConfig, cell: str, rate: Optional[float]) -> RunConfig:
    wl = dataclasses.replace(base.workload, output_len=OUTPUT_LEN)
    if cell != "burst":
        wl = dataclasses.replace(wl, arrival="poisson", rate=rate)
    return dataclasses.replace(base, workload=wl, spec=SpecConfig(method="ngram", num_tokens=K))


def replay_config(cfg: RunConfig, profile: str, trace: Path) -> RunConfig:
    """The profiled simulator of the engine run `cfg`, fed the acceptance trace at `trace`."""
    spec = dataclasses.replace(cfg.spec, acceptance="trace", acceptance_path=str(trace))
    return dataclasses.replace(sim_config(cfg, profile), spec=spec)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help=f"profile.json made with spec=ngram spec.num_tokens={K} (cores=1)")
    ap.add_argument("--runs", type=int, default=MIN_RUNS, help=f"engine runs per cell (evidence: at least {MIN_RUNS})")
    ap.add_argument("--requests", type=int, default=256, help="requests per run")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="rounds over the cells at most, looking for runs at the profile's speed (default 4 x --runs)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "spec_fidelity"))
    ap.add_argument("--cores", type=int, default=None, help="pin to the first N CPUs (default: as the profile was pinned)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.requests < 1:
        ap.error(f"--requests must be >= 1, got {args.requests}")
    if args.max_rounds is not None and args.max_rounds < args.runs:
        ap.error(f"--max-rounds must be >= --runs ({args.runs}), got {args.max_rounds}")
    if problem := unwritable(Path(args.out)):  # found now, not after the runs
        ap.error(f"--out: {problem}")
    profile = read_profile_arg(ap, args.profile)
    problems = check_profile(profile, K)
    if problems:
        ap.error(f"--profile {args.profile}: {'; '.join(problems)} (profile with "
                 f"`python -m cbjax.profile cores=1 spec=ngram spec.num_tokens={K}`)")  # fmt: skip
    from cbjax.profile.pinning import pin

    cores = args.cores if args.cores is not None else (profile.get("pinning") or {}).get("cores")
    try:
        pinning = pin(cores, key="--cores")
    except ValueError as err:
        ap.error(str(err))
    print(f"engine runs pinned to CPUs {pinning['cpus']}" if pinning else "engine runs unpinned", flush=True)
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts
    from cbjax.app.run import run_single

    out = Path(args.out)
    base = base_config(profile, args.requests)
    start = time.perf_counter()
    anchor, reference = profile_anchor(base, profile, args.profile)
    rate: list[float] = []  # the Poisson cell's, set by the first burst run

    def run(cell: str, _, r: int, done: int, total: int) -> dict:
        run_dir = out / "runs" / cell / f"engine_{r}"
        t0 = time.perf_counter()
        summary = run_single(cell_config(base, cell, rate[0] if rate else None), run_dir, verbose=False)
        summary["run_dir"] = str(run_dir)
        if not rate:
            rate.append(half_capacity_rate(summary["throughput_req_s"]))
            print(f"half capacity: {rate[0]:.2f} req/s (half the first burst's {summary['throughput_req_s']:.2f})")
        print(f"{cell} round {r + 1}: {summary['throughput_tok_s']:.0f} tok/s, acceptance "
              f"{summary['spec_acceptance_rate']:.2f}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        return summary

    made = engine_rounds(dict.fromkeys(CELLS), args.runs, run, anchor, reference, max_rounds=args.max_rounds)
    cells, report = [], {"profile": args.profile, "runs": args.runs, "requests": args.requests, "k": K,
                         "poisson_rate_req_s": rate[0] if rate else None, "cells": {}}  # fmt: skip
    for cell in CELLS:
        runs = [s for s in made[cell] if s["on_speed"]]
        if not runs:
            print(f"{cell}: none of its {len(made[cell])} runs was made at the profile's speed: not judged")
            report["cells"][cell] = {"judged": None, "engine": made[cell], "simulator": []}
            continue
        groups = trace_groups([(Path(s["run_dir"]) / TRACE_FILE).read_text() for s in runs])
        sims = {}
        for i in sorted(set(groups)):
            trace = Path(runs[i]["run_dir"]) / TRACE_FILE
            sims[i] = run_single(replay_config(cell_config(base, cell, rate[0]), args.profile, trace),
                                 out / "runs" / cell / f"sim_{i}", verbose=False)  # fmt: skip
        simulated = [sims[g] for g in groups]  # one per judged engine run, its own trace's
        judged = judge_cell(cell, runs, simulated)
        judged["distinct_traces"] = len(sims)
        judged["runs_made"] = len(made[cell])
        # every run, whatever the machine's speed: reported, not judged
        judged["all_runs"] = {key: judge_figure([e[key] for e in made[cell]], [s[key] for s in simulated], None)
                              for key, _ in FIGURES}  # fmt: skip
        cells.append(judged)
        report["cells"][cell] = {"judged": judged, "engine": made[cell], "simulator": simulated}
    print(markdown_table(["cell", "figure", "engine at the profile's speed: median [range]", "simulator", "error",
                          "verdict"], table_rows(cells)))  # fmt: skip
    for c in cells:
        eng, sim = c["engine_acceptance_rate"], c["simulator_acceptance_rate"]
        low = " (below %.1f: little speculation measured)" % MIN_ACCEPTANCE if eng is not None and eng < MIN_ACCEPTANCE else ""
        print(f"{c['cell']}: drafts accepted, engine {_rate(eng)}, simulator {_rate(sim)}{low}; "
              f"{c['distinct_traces']} distinct trace(s) over {c['runs']} judged runs")  # fmt: skip
        every = ", ".join(f"{label} {c['all_runs'][key]['engine_median']:.4g} ({c['all_runs'][key]['error_pct']:+.1f}%)"
                          for key, label in FIGURES)  # fmt: skip
        print(f"{c['cell']}: all {c['runs_made']} runs made, at any speed, median: {every}")
    if len(cells) < len(CELLS) or any(c["runs"] < MIN_RUNS for c in cells):
        print(f"fewer than {MIN_RUNS} runs at the profile's speed in some cell: a smoke run, not evidence")
    print(f"took {(time.perf_counter() - start) / 60:.1f} min")
    write_json(out / "spec_fidelity.json", report)
    print(f"wrote {out / 'spec_fidelity.json'}")


if __name__ == "__main__":
    main()
