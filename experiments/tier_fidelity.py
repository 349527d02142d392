"""The simulator against the engine on multi-turn sessions with the host KV tier on.

    python -m cbjax.profile cores=1 hydra.run.dir=outputs/fidelity/profile_tiny_16   # once, quiet machine
    python experiments/tier_fidelity.py --profile outputs/fidelity/profile_tiny_16/profile.json [--runs 5] [--max-rounds 20]

Two cells, one per pause distribution between a session's turns: a person's think time
(exponential) and a tool call's heavy tail (Pareto). Each is a `workload=sessions` run with the
prefix cache and a host tier beneath a device pool too small for the sessions in flight, so
later turns load their history back from host memory. The runs take the profile's shapes
(`experiments/calibrate.py`'s `base_config`); the engine is pinned as the profile was (or to
`--cores`), before jax starts.

The simulator (the profile's `profiled` cost model, deterministic) runs each cell once; the
engine runs the cells in rounds until each has `--runs` runs made at the profile's machine
speed. A TTFT at light load follows what a request arriving at an idle loop pays, which a
saturated burst does not show, so by default (`--anchor lone`) the latency anchor judges that
speed: the profile's lone requests served again (`cbjax.profile.latency`) before the first run
and after each, a run counting only when both timings lie within 5% of the profile's
(`calibrate.engine_rounds`). `--anchor burst` judges by the profile's burst anchor
(`cbjax.profile.anchor`), as the calibration does; a profile without lone requests falls back
to it. Runs off speed are kept and reported beside the judged ones, not judged. Per cell and
figure the table gives the engine's median and range, the simulator's figure and its signed
error against that median, and whether it is within the target: TTFT p50 within 10%,
throughput within 5%. The host tier's copies are priced by the
profile's swap-out and swap-in terms (`swap_out_*`, `swap_in_*`), fitted on copies timed while
the profile served a sessions workload of its own (`cbjax.profile.copies`); a profile without
them prices them with its shared swap terms, and the script says which.

Prints one table per cell, and writes the runs and the verdicts as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import base_config, engine_rounds, profile_anchor, read_profile_arg, sim_config  # noqa: E402
from cbjax.app.run import run_single  # noqa: E402
from cbjax.config import LengthConfig, PauseConfig, RunConfig  # noqa: E402
from cbjax.report.files import unwritable, write_json  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.profile.copies import fit_served_copies  # noqa: E402
from cbjax.profile.latency import LONE_REPEATS, lone_reference, lone_timer  # noqa: E402
from cbjax.sim.profiled import SWAP_DIRECTION_TERMS, SWAP_TERMS  # noqa: E402

# summary key -> (label, |signed error| % the simulator may carry against the engine's median)
TARGETS = {"ttft_s_p50": ("TTFT p50", 10.0), "throughput_tok_s": ("throughput", 5.0)}
# reported beside the judged figures: whether the tier was used as the cell means it to be
REPORTED = ("prefix_hit_rate_device", "prefix_hit_rate_host", "kv_host_pages_loaded", "kv_host_pages_stored", "num_rejected")
ANCHORS = ("lone", "burst")
PAUSES = {
    "think time (exponential)": PauseConfig(dist="exponential", mean=0.5, max=5.0),
    "tool calls (Pareto, shape 1.3)": PauseConfig(dist="pareto", mean=0.5, alpha=1.3, max=5.0),
}


def cells(base: RunConfig, sessions: int, rate: float, device_pages: int, host_pages: int) -> dict[str, RunConfig]:
    """cell name -> engine config: `sessions` sessions of 3-5 turns, each turn adding 16 to
    max_model_len / 16 tokens and generating up to 32, on `device_pages` device pages and
    `host_pages` host pages."""
    ctx = base.model.max_model_len
    turn_in = LengthConfig(dist="uniform", low=16, high=max(16, ctx // 16), max=max(16, ctx // 16))
    turn_out = LengthConfig(dist="uniform", low=4, high=min(32, max(4, ctx // 16)))
    cache = dataclasses.replace(base.cache, prefix_caching=True, num_pages=device_pages, host_pages=host_pages)
    out = {}
    for name, pause in PAUSES.items():
        workload = dataclasses.replace(
            base.workload, name="sessions", num_sessions=sessions, arrival="poisson", rate=rate,
            turns=LengthConfig(dist="uniform", low=3, high=5, max=5), prompt_len=turn_in, output_len=turn_out,
            pause=pause,
        )  # fmt: skip
        out[name] = dataclasses.replace(base, cache=cache, workload=workload)
    return out


def figures(summary: dict) -> dict:
    return {key: summary.get(key) for key in (*TARGETS, *REPORTED)}


def copy_terms_note(profile: dict) -> str:
    """How the profile prices the host tier's copies."""
    coef = profile.get("coefficients", {})
    if all(k in coef for k in SWAP_DIRECTION_TERMS):
        served = profile.get("served_copies") or []
        if fit_served_copies(served):
            return (f"host-tier copies priced by the profile's swap_out_* and swap_in_* terms, fitted on {len(served)} "
                    "steps' copies timed while serving")  # fmt: skip
        return "host-tier copies priced by the profile's swap_out_* and swap_in_* terms, timed alone"
    if all(k in coef for k in SWAP_TERMS):
        return ("the profile lacks swap_out_* / swap_in_* (made before they existed): host-tier copies "
                "priced by its shared swap terms, swap_iter_s and swap_page_s")  # fmt: skip
    return "the profile has no swap terms: host-tier copies are priced at 0 (take a new profile)"


def judge(sim: dict, runs: list[dict]) -> dict:
    """Per judged figure: the engine's median and range, the simulator's figure, its signed
    error in % against the median, and whether it is within the target."""
    out = {}
    for key, (_, target) in TARGETS.items():
        values = [r[key] for r in runs if r.get(key) is not None]
        if not values or sim.get(key) is None:
            out[key] = {"engine_median": None, "engine_range": None, "simulator": sim.get(key), "error_pct": None,
                        "target_pct": target, "pass": False}  # fmt: skip
            continue
        median = statistics.median(values)
        error = 100.0 * (sim[key] / median - 1.0) if median else None
        out[key] = {"engine_median": median, "engine_range": [min(values), max(values)], "simulator": sim[key],
                    "error_pct": error, "target_pct": target, "pass": error is not None and abs(error) <= target}  # fmt: skip
    return out


def cell_table(name: str, verdict: dict, runs: int) -> str:
    rows = []
    for key, (label, target) in TARGETS.items():
        v = verdict[key]
        engine = "-" if v["engine_median"] is None else (
            f"{v['engine_median']:.4g} [{v['engine_range'][0]:.4g}, {v['engine_range'][1]:.4g}]")  # fmt: skip
        sim = "-" if v["simulator"] is None else f"{v['simulator']:.4g}"
        error = "-" if v["error_pct"] is None else f"{v['error_pct']:+.1f}%"
        rows.append([label, engine, sim, error, f"{target:.0f}%", "pass" if v["pass"] else "FAIL"])
    header = ["figure", f"engine at the profile's speed, median of {runs} [range]", "simulator", "error", "target", "verdict"]
    return f"### {name}\n\n" + markdown_table(header, rows)


def run_anchor(kind: str, base: RunConfig, profile: dict, where: str):
    """(what times the anchor now, its reference, the anchor used) for `engine_rounds`: the
    latency anchor (`cbjax.profile.latency`, reference 1) for `lone` where the profile kept its
    lone requests, else the profile's burst anchor (None for a profile without one)."""
    reference = lone_reference(profile.get("served_wake"))
    if kind == "lone" and reference:
        print(f"runs judged by the latency anchor: {LONE_REPEATS} passes of the profile's lone requests "
              f"(prompts of {', '.join(map(str, reference))} tokens) timed before the first run and after each", flush=True)  # fmt: skip
        return lone_timer(base, reference), 1.0, "lone"
    if kind == "lone":
        print(f"{where}: no lone requests (a profile made before them): runs judged by the burst anchor", flush=True)
    anchor, ref = profile_anchor(base, profile, where)
    return anchor, ref, "burst" if anchor is not None else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile.json of a lone replica (python -m cbjax.profile cores=1)")
    ap.add_argument("--runs", type=int, default=5, help="engine runs per cell at the profile's speed (at least 5 for a verdict)")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="rounds over the cells at most, looking for runs at the profile's speed (default 4 x --runs)")
    ap.add_argument("--sessions", type=int, default=24, help="sessions per run")
    ap.add_argument("--rate", type=float, default=4.0, help="sessions' first turns per second (Poisson)")
    ap.add_argument("--device-pages", type=int, default=None,
                    help="device pool pages (default: half a context and 4 pages, max_model_len / page_size / 2 + 4)")  # fmt: skip
    ap.add_argument("--host-pages", type=int, default=512)
    ap.add_argument("--cores", type=int, default=None, help="pin the engine to the first N CPUs (default: as the profile)")
    ap.add_argument("--anchor", choices=ANCHORS, default="lone",
                    help="what judges a run at the profile's machine speed: the profile's lone requests timed again "
                    "(lone, the latency the TTFT cells follow) or its saturated burst (burst)")  # fmt: skip
    ap.add_argument("--out", default=str(REPO / "outputs" / "tier_fidelity.json"))
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.max_rounds is not None and args.max_rounds < args.runs:
        ap.error(f"--max-rounds must be >= --runs ({args.runs}), got {args.max_rounds}")
    if problem := unwritable(Path(args.out).parent):  # found now, not after the runs
        ap.error(f"--out: {problem}")
    profile = read_profile_arg(ap, args.profile)
    cores = args.cores if args.cores is not None else (profile.get("pinning") or {}).get("cores")
    if cores:  # before jax starts: the engine runs as its profile ran
        from cbjax.profile.pinning import pin

        try:
            pinning = pin(cores, key="--cores")
        except ValueError as err:
            ap.error(str(err))
        print(f"engine runs pinned to CPUs {pinning['cpus']}" if pinning else "engine runs unpinned", flush=True)
    note = copy_terms_note(profile)
    print(note, flush=True)
    base = base_config(profile, 1)
    # half a context (and 4 pages): sessions in flight outgrow the pool, so a later turn's
    # history is often back from the host, while the longest conversation still fits
    device_pages = args.device_pages or -(-base.model.max_model_len // base.cache.page_size) // 2 + 4
    engine_cfgs = cells(base, args.sessions, args.rate, device_pages, args.host_pages)
    sim = {name: figures(run_single(sim_config(cfg, args.profile), verbose=False)) for name, cfg in engine_cfgs.items()}
    anchor, reference, judged_by = run_anchor(args.anchor, base, profile, args.profile)

    def run(name: str, cfg: RunConfig, r: int, done: int, total: int) -> dict:
        t0 = time.perf_counter()
        figs = figures(run_single(cfg, verbose=False))
        print(f"{name}: round {r + 1}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return figs

    made = engine_rounds(engine_cfgs, args.runs, run, anchor, reference, max_rounds=args.max_rounds)
    report = {"profile": args.profile, "runs": args.runs, "anchor": judged_by, "copy_terms": note, "device_pages": device_pages,
              "host_pages": args.host_pages, "sessions": args.sessions, "rate": args.rate, "cells": {}}  # fmt: skip
    for name in engine_cfgs:
        runs = [r for r in made[name] if r["on_speed"]]
        verdict = judge(sim[name], runs)
        every = judge(sim[name], made[name])  # every run, whatever the machine's speed: reported, not judged
        report["cells"][name] = {"simulator": sim[name], "engine": made[name], "runs_judged": len(runs),
                                 "verdict": verdict, "all_runs": every}  # fmt: skip
        print(cell_table(name, verdict, len(runs)))
        print(f"\nall {len(made[name])} runs made, at any speed: " + ", ".join(
            f"{label} {every[key]['engine_median']:.4g} ({every[key]['error_pct']:+.1f}%)" for key, (label, _) in TARGETS.items()
            if every[key]["error_pct"] is not None))  # fmt: skip
        first = runs[0] if runs else made[name][0]
        for who, figs in (("simulator", sim[name]), ("engine, first judged run" if runs else "engine, first run", first)):
            print(f"{who}: " + ", ".join(f"{k} {figs.get(k)}" for k in REPORTED))
        print()
    if any(c["runs_judged"] < 5 for c in report["cells"].values()):
        print("fewer than 5 runs at the profile's speed in some cell: a smoke run, not evidence")
    out = Path(args.out)
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
