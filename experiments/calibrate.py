"""Calibration: the same workloads on the JAX engine and in the profiled simulator; writes docs/CALIBRATION.md.

    python -m cbjax.profile hydra.run.dir=outputs/profile        # once per machine and model
    python experiments/calibrate.py --profile outputs/profile/profile.json [--repeats 5] [--requests 256]
    python experiments/calibrate.py --profile P16.json P32.json    # one report over two slot counts
    python experiments/calibrate.py --profile ... --quick          # a smoke run: few cells, small, not evidence

The runs take the profile's shapes (model.max_model_len, page size, slot count, step budget,
token buckets); several profiles (one per slot count) make one report, each cell named with its
slot count. Workloads, other requests than the profile's served runs (other length
distributions and seeds), one per load regime: a burst (every request at t=0: closed loop),
Poisson arrivals at 30%, 60% and 90% of the simulator's saturated request rate (light, medium,
heavy: open loop), and a slice of the Azure code trace at 70% (medium). By default the cells
are the acceptance cells (`ACCEPTANCE_CELLS`: the burst under fcfs and static, Poisson 30% and
60% under fcfs, chunked prefill off); `--cells all`: every workload under fcfs, static and sjf,
with and without chunked prefill.

Every cell runs at least 5 times on the engine (`--repeats`). Closed-loop cells carry the
throughput; open-loop cells carry the latencies, p99 beside p50 (an open-loop throughput is
the offered load, evidence of nothing). Per cell and figure the report gives the engine's
median, a seeded bootstrap 90% interval of it, the simulator's signed error, and whether the
simulator lies inside the interval and within the target; the verdict is the target's alone
(`cbjax.profile.acceptance`): no target is replaced by a spread. Per regime, each figure's mean
signed error and worst cell. Run it on a quiet machine, just after the profile: an engine run
counts only when the profile's anchor, timed before and after it, ran within 5% of the
profile's speed (`cbjax.profile.anchor`; `engine_rounds`), and `--reports` merges slot counts
calibrated one after another into one document (experiments/fidelity_acceptance.sh).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cbjax.config import (  # noqa: E402
    CacheConfig, ExecutorConfig, LengthConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig,
)  # fmt: skip
from cbjax.profile.anchor import SPEED_TOLERANCE, anchor_config, anchor_speed, on_speed, time_anchor  # noqa: E402
from cbjax.app.run import run_single  # noqa: E402
from cbjax.report.files import atomic_write_text, read_json, unwritable, write_json  # noqa: E402
from cbjax.profile.acceptance import REGIME_BIAS_PCT, judge_runs, signed_error_pct, summarize_regimes  # noqa: E402
from cbjax.sim.profiled import COLD_TERMS  # noqa: E402

# the first 500 requests of the Azure code trace, shipped with cbjax (cbjax/data/README.md)
AZURE_CODE = REPO / "cbjax" / "data" / "AzureLLMInferenceTrace_code_sample.csv"
# Closed-loop cells carry the throughput, open-loop cells the latencies (p99 beside p50).
CLOSED_METRICS = [("throughput_tok_s", "throughput")]
OPEN_METRICS = [("ttft_s_p50", "TTFT p50"), ("ttft_s_p99", "TTFT p99"), ("e2e_s_p50", "E2E p50"),
                ("e2e_s_p99", "E2E p99"), ("tpot_s_p50", "TPOT p50"), ("tpot_s_p99", "TPOT p99")]  # fmt: skip
METRICS = CLOSED_METRICS + OPEN_METRICS
# |signed error| % a cell's figure may carry; a figure without a target is reported, not judged.
TARGETS = {"throughput_tok_s": 5.0, "ttft_s_p50": 10.0, "e2e_s_p50": 10.0, "e2e_s_p99": 15.0}
RATIO_TARGET_PCT = 5.0  # the continuous / static throughput ratio
MIN_REPEATS = 5
# with the profile's anchor, rounds go on until each cell has `repeats` runs made at the
# profile's machine speed, up to this many rounds per repeat (`engine_rounds`)
MAX_ROUNDS_PER_REPEAT = 4
# the acceptance cells, on workloads the profile never served: a burst under fcfs and under
# static (closed loop: throughput and the continuous / static ratio), Poisson at 30% and 60% of
# the saturated rate under fcfs (open loop: the latencies); chunked prefill off
ACCEPTANCE_CELLS = (("burst", "fcfs", False), ("burst", "static", False), ("poisson_30", "fcfs", False),
                    ("poisson_60", "fcfs", False))  # fmt: skip
POLICIES = ("fcfs", "static", "sjf")
# workload -> (regime, closed loop, fraction of the saturated request rate; None: all at t=0)
WORKLOADS = {
    "burst": ("burst", True, None),
    # nearly every request meets an idle engine: its first step is launched with nothing in
    # flight (`--cells all --workloads poisson_5`; not an acceptance cell)
    "poisson_5": ("light", False, 0.05),
    "poisson_30": ("light", False, 0.3),
    "poisson_60": ("medium", False, 0.6),
    "poisson_90": ("heavy", False, 0.9),
    "azure_code": ("medium", False, 0.7),
}


def read_profile_arg(ap: argparse.ArgumentParser, path: str) -> dict:
    """The profile a script's `--profile` names; a usage error naming the flag if unreadable."""
    try:
        return read_json(path)
    except ValueError as err:
        ap.error(f"--profile: {err}")


def base_config(profile: dict, requests: int) -> RunConfig:
    """A run with the profile's shapes and a synthetic workload sized for the tiny model."""
    made = profile["made_for"]
    model = ModelConfig(**{k.split(".", 1)[1]: v for k, v in made.items() if k.startswith("model.")})
    lengths = dict(prompt_len=LengthConfig(dist="uniform", low=16, high=min(256, model.max_model_len // 4)),
                   output_len=LengthConfig(dist="exponential", mean=64.0, max=min(256, model.max_model_len // 4)))  # fmt: skip
    return RunConfig(
        model=model,
        scheduler=SchedulerConfig(
            max_num_seqs=made["scheduler.max_num_seqs"], max_num_batched_tokens=profile["max_num_batched_tokens"]
        ),  # fmt: skip
        # no prefix cache, as the profile's served runs but one, and its anchor, ran
        cache=CacheConfig(page_size=made["cache.page_size"], num_pages=profile.get("num_pages", CacheConfig.num_pages),
                          prefix_caching=False),
        executor=ExecutorConfig(name="jax", token_buckets=profile["token_buckets"]),
        workload=WorkloadConfig(num_requests=requests, vocab_size=model.vocab_size, **lengths),
        progress=False,
    )


def azure_slice(trace: Path, out: Path, requests: int, rate: Optional[float], max_model_len: int) -> Path:
    """The first `requests` rows of the Azure code trace as a plain CSV: prompts divided by 16 (the
    trace's are ~2k tokens, the tiny model's context is ~1k), outputs clipped, arrivals rescaled to
    `rate` (None: all at t=0)."""
    if not trace.is_file():
        sys.exit(f"calibrate: error: no Azure code trace at {trace} (--trace PATH)")
    with open(trace) as f:
        rows = list(csv.DictReader(f))[:requests]
    if len(rows) < requests:
        sys.exit(f"calibrate: error: --requests {requests}: the trace {trace} has only {len(rows)} requests")
    from cbjax.workload.trace import parse_timestamp

    stamps = [parse_timestamp(r["TIMESTAMP"]) for r in rows]
    t = np.array([(s[0] - stamps[0][0]) + (s[1] - stamps[0][1]) for s in stamps])
    t = t * (len(t) / rate) / max(t[-1], 1e-9) if rate else np.zeros(len(t))
    path = out / ("azure_code_slice.csv" if rate else "azure_code_slice_t0.csv")
    with open(path, "w") as f:
        f.write("arrival_s,prompt_len,output_len\n")
        for ti, r in zip(t, rows):
            prompt = min(max(1, int(r["ContextTokens"]) // 16), max_model_len // 2)
            output = min(max(1, int(r["GeneratedTokens"])), max_model_len // 4)
            f.write(f"{ti:.6f},{prompt},{output}\n")
    return path


def workloads(base: RunConfig, out: Path, sim_profile: str, trace: Path) -> dict[str, WorkloadConfig]:
    """The workloads of WORKLOADS; Poisson rates from the simulator's saturated request rate."""
    saturated = run_single(sim_config(base, sim_profile), None, verbose=False)["throughput_req_s"]
    wl = base.workload
    out_wl = {}
    for name, (_, _, load) in WORKLOADS.items():
        if name == "azure_code":
            path = azure_slice(trace, out, wl.num_requests, load * saturated, base.model.max_model_len)
            out_wl[name] = WorkloadConfig(name="trace", format="csv", vocab_size=wl.vocab_size, path=str(path))
        elif load is None:
            out_wl[name] = wl
        else:
            out_wl[name] = dataclasses.replace(wl, arrival="poisson", rate=load * saturated)
    return out_wl


def sim_config(cfg: RunConfig, profile: str) -> RunConfig:
    ex = dataclasses.replace(cfg.executor, name="sim", cost_model="profiled", profile=profile)
    return dataclasses.replace(cfg, executor=ex)


def judge_cell(
    wname: str, policy: str, chunked: bool, sim: dict, engine: list[dict], seed: int = 0,
    repeats: int = 0, runs: Optional[int] = None,
) -> dict:  # fmt: skip
    """One cell: its regime, and per figure it carries (closed loop: throughput; open loop: the
    latencies) `cbjax.profile.acceptance.judge_runs` of the simulator against the engine's runs `engine`
    (those made at the profile's machine speed, of `runs` made). With fewer than `repeats` of
    them every targeted figure fails: the cell was not measured at the profile's speed."""
    regime, closed, _ = WORKLOADS[wname]
    name = f"{wname}, {policy}, chunked {'on' if chunked else 'off'}"
    cell = {"name": name, "workload": wname, "regime": regime, "closed_loop": closed, "policy": policy,
            "chunked": chunked, "runs_judged": len(engine), "runs": len(engine) if runs is None else runs}  # fmt: skip
    for key, _ in CLOSED_METRICS if closed else OPEN_METRICS:
        values = [e[key] for e in engine if e.get(key) is not None]
        cell[key] = judge_runs(sim.get(key), values, TARGETS.get(key), judged=len(engine), repeats=repeats,
                               made=cell["runs"], seed=seed)  # fmt: skip
    return cell


def profile_anchor(base: RunConfig, profile: dict, where: str) -> tuple[Optional[Callable[[], float]], Optional[float]]:
    """(what times the anchor now, its reference_s) for `engine_rounds`, from the profile at
    `where`; (None, None), said once, for a profile made before the anchor (every run judged)."""
    if not profile.get("anchor"):
        print(f"{where}: no anchor (a profile made before it): every engine run is judged, whatever the machine's "
              "speed", flush=True)  # fmt: skip
        return None, None
    return anchor_timer(base, profile["anchor"]), profile["anchor"]["reference_s"]


def anchor_timer(base: RunConfig, record: dict) -> Callable[[], float]:
    """A warm engine of `base`'s model serving the profile's anchor (`cbjax.profile.anchor`);
    returns what times it (`time_anchor`: the median of ANCHOR_RUNS makespans)."""
    from cbjax.profile.serving import serve_timed
    from cbjax.app.run import build_executor, resolve

    cfg = resolve(anchor_config(base, record))
    executor = build_executor(cfg)
    executor.sampling = False
    executor.warmup()
    serve_timed(executor, cfg)  # untimed: the first serving's one-time costs

    return lambda: time_anchor(lambda: serve_timed(executor, cfg).makespan)


def engine_rounds(
    cells: dict, repeats: int, run: Callable[..., dict], anchor: Optional[Callable[[], float]],
    reference: Optional[float], max_rounds: Optional[int] = None, give_up_after: Optional[int] = None,
) -> dict[tuple, list[dict]]:  # fmt: skip
    """Every cell's engine runs, in rounds over all the cells (a slow spell of the machine then
    lands on one run of many cells, not on one cell): `run(key, cfg, round, done, total)`
    returns a run's summary. With an `anchor` (the profile's, timed before the first run and
    after each; `reference`: its timing at the profile) each run gets its `anchor_speed` and
    `on_speed` (`cbjax.profile.anchor.on_speed`), and rounds go on, for the cells short of
    `repeats` runs on speed, up to `max_rounds` (default MAX_ROUNDS_PER_REPEAT x repeats), or
    until the machine has moved (`moved`: the last `give_up_after` runs' median speed off the
    profile's), when the runs left would measure another machine (a caller may take a new
    profile and start again). Without an anchor, `repeats` rounds, every run on speed. Returns
    every run made, per cell."""
    max_rounds = repeats if anchor is None else (max_rounds or MAX_ROUNDS_PER_REPEAT * repeats)
    runs: dict[tuple, list[dict]] = {k: [] for k in cells}
    before = anchor() if anchor else None
    done = 0
    speeds: list[float] = []  # every run's anchor speed, in the order made
    for r in range(max_rounds):
        todo = [k for k in cells if sum(e["on_speed"] for e in runs[k]) < repeats]
        if not todo:
            break
        for key in todo:
            if moved(speeds, give_up_after):
                break
            summary = run(key, cells[key], r, done, len(cells) * repeats)
            done += 1
            if anchor is None:
                runs[key].append({**summary, "anchor_speed": None, "on_speed": True})
                continue
            after = anchor()
            runs[key].append({**summary, "anchor_speed": anchor_speed(before, after, reference),
                              "on_speed": on_speed(before, after, reference)})  # fmt: skip
            speeds.append(runs[key][-1]["anchor_speed"])
            before = after
        else:  # every cell of the round ran
            continue
        print(f"the last {give_up_after} runs' median machine speed is {np.median(speeds[-give_up_after:]):.3f} "
              "of the profile's: the machine has moved; no more rounds (take a new profile)", flush=True)  # fmt: skip
        break
    return runs


def moved(speeds: list[float], last: Optional[int], tolerance: float = SPEED_TOLERANCE) -> bool:
    """Whether the median of the `last` anchor speeds (run over the profile's) lies beyond
    `tolerance` of 1: the machine has left the profile's speed, not just one timing (the anchor
    itself spreads a few percent from one timing to the next). False while fewer runs were made,
    or with no `last`."""
    return bool(last) and len(speeds) >= last and abs(float(np.median(speeds[-last:])) - 1.0) > tolerance


def ratio_rows(cells: list[dict], sim_tp: dict, engine_tp: dict) -> list[dict]:
    """fcfs / static throughput (chunked prefill off) per closed-loop workload, simulator vs the
    engine's medians, with its target."""
    rows = []
    for w in dict.fromkeys(c["workload"] for c in cells if c["closed_loop"]):
        key_f, key_s = (w, "fcfs", False), (w, "static", False)
        if key_f in sim_tp and key_s in sim_tp:
            sim = sim_tp[key_f] / sim_tp[key_s]
            if not (engine_tp[key_f] and engine_tp[key_s]):  # a cell with no run at the profile's speed
                rows.append({"workload": w, "sim": sim, "engine": None, "error_pct": None, "verdict": "fail"})
                continue
            eng = float(np.median(engine_tp[key_f])) / float(np.median(engine_tp[key_s]))
            err = signed_error_pct(sim, eng)
            rows.append({"workload": w, "sim": sim, "engine": eng, "error_pct": err,
                         "verdict": "pass" if abs(err) <= RATIO_TARGET_PCT else "fail"})  # fmt: skip
    return rows


def plan_cells(args) -> list[tuple[str, str, bool]]:
    """(workload, policy, chunked) of every cell: by default (`--cells acceptance`) ACCEPTANCE_CELLS;
    `--cells all` every workload of `--workloads` under every policy of `--policies`, chunked prefill
    off and on; --quick: burst and poisson_30, fcfs and static, chunked off."""
    if args.quick:
        policies = [p for p in args.policies if p in ("fcfs", "static")]
        return [(w, p, False) for w in ("burst", "poisson_30") for p in policies]
    if args.cells == "acceptance":
        return list(ACCEPTANCE_CELLS)
    names = args.workloads or list(WORKLOADS)
    return [(w, p, c) for w in names for p in args.policies for c in (False, True)]


def run_all(args, profile_path: str) -> dict:
    """Every cell in the simulator once, then on the engine in `args.repeats` rounds over all the
    cells (a slow spell of the machine then lands on one run of many cells, not on one cell),
    with the shapes and slot count of the profile at `profile_path`."""
    profile = json.loads(Path(profile_path).read_text())
    slots = profile["made_for"]["scheduler.max_num_seqs"]
    out = Path(args.out_dir) / f"slots_{slots}"
    out.mkdir(parents=True, exist_ok=True)
    base = base_config(profile, args.requests)
    plan = plan_cells(args)
    chosen = workloads(base, out, profile_path, Path(args.trace))
    cells = {}
    for w, policy, chunked in plan:
        sched = dataclasses.replace(base.scheduler, name=policy, chunked_prefill=chunked)
        cells[(w, policy, chunked)] = dataclasses.replace(base, scheduler=sched, workload=chosen[w])
    sim = {k: run_single(sim_config(cfg, profile_path), None, verbose=False) for k, cfg in cells.items()}
    start = time.perf_counter()
    # untimed: a process's first serving pays one-time costs (compiles loaded, first allocations)
    run_single(
        dataclasses.replace(base, workload=dataclasses.replace(base.workload, num_requests=64)), None, verbose=False
    )
    anchor, reference = profile_anchor(base, profile, profile_path)

    def run(key, cfg, r, done, total):
        elapsed = time.perf_counter() - start
        print(f"[{done + 1}/~{total}] {slots} slots, round {r + 1}: {key[0]} {key[1]} chunked {'on' if key[2] else 'off'} | "
              f"{elapsed / 60:.1f} min in", flush=True)  # fmt: skip
        return run_single(cfg, None, verbose=False)

    # the median speed of two rounds' worth of runs off the profile's: the machine has moved (a
    # round of 4 short cells lasts seconds, one of this VM's spells)
    runs = engine_rounds(cells, args.repeats, run, anchor, reference, give_up_after=2 * len(cells))
    engine = {k: [e for e in v if e["on_speed"]] for k, v in runs.items()}
    judged = [judge_cell(*k, sim[k], engine[k], repeats=args.repeats, runs=len(runs[k])) for k in cells]
    for cell, k in zip(judged, cells):
        cell["anchor_runs"] = [{"speed": e["anchor_speed"], "judged": e["on_speed"]} for e in runs[k]]
    tp = {k: [e["throughput_tok_s"] for e in engine[k]] for k in cells}
    report = {
        "slots": slots,
        "repeats": args.repeats,
        "quick": args.quick,
        "anchor_reference_s": reference,
        "cells": judged,
        "regimes": summarize_regimes(judged, [k for k, _ in METRICS]),
        "ratios": ratio_rows(judged, {k: sim[k]["throughput_tok_s"] for k in cells}, tp),
    }
    write_json(out / "calibration.json", report)
    print(f"calibration at {slots} slots took {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return report


def merge_reports(reports: list[dict]) -> dict:
    """One report of several slot counts' (`run_all` per profile): each cell and ratio named with its
    slot count, the regimes summarised over all the cells."""
    cells, ratios = [], []
    for r in reports:
        cells += [{**c, "name": f"{r['slots']} slots: {c['name']}", "slots": r["slots"]} for c in r["cells"]]
        ratios += [{**x, "workload": f"{x['workload']} ({r['slots']} slots)"} for x in r["ratios"]]
    return {"slots": [r["slots"] for r in reports], "repeats": min(r["repeats"] for r in reports),
            "quick": any(r["quick"] for r in reports), "cells": cells,
            "regimes": summarize_regimes(cells, [k for k, _ in METRICS]), "ratios": ratios}  # fmt: skip


def _profile_notes(profile: dict) -> list[str]:
    """The profile's serving-loop figures and load, where it has them (a line and a blank)."""
    coef, served = profile.get("coefficients", {}), profile.get("residuals", {}).get("served")
    if "bucket_scale" not in coef or not served:
        return []
    m = profile["machine"]
    own = coef.get("served_bucket_s") or {}
    colds = [coef.get(k, 0.0) for k in COLD_TERMS]
    cold = ("the 1st-4th step after a larger bucket's " + "/".join(f"{1e3 * c:.2f}" for c in colds) + " ms more"
            if any(colds) else "no cold-step terms")  # fmt: skip
    if m.get("others_cpu_share") is not None:
        busy = f"other processes took {m['others_cpu_share']:.0%} of the cores while it ran"
    elif "load_average_at_start" in m:
        busy = f"load average {m['load_average_at_start'][0]:.2f} before it started"
    else:
        busy = f"load average {m.get('load_average', [float('nan')])[0]:.2f} when it ended"
    return [f"Serving loop in the profile: fitted on {served['num_points']} served iterations over the grid's step terms "
            f"(fixed costs of their own for {len(own)} buckets, the rest x{coef['bucket_scale']:.3f} the grid's timing; "
            f"{cold}; the grid model alone puts them "
            f"{served['grid_model_total_error']:+.1%} off), "
            f"loop {1e6 * coef['loop_s']:.0f} us + {1e6 * coef['loop_seq_s']:.1f} us per request, wake {1e3 * coef['wake_s']:.2f} ms; "
            f"its served runs' total time predicted {served['total_error']:+.1%}; {busy}.", ""]  # fmt: skip


def _profile_table(profile: dict) -> list[str]:
    """The profile's own step-time residuals by regime (`residuals.by_regime`), where it has them."""
    table = profile.get("residuals", {}).get("by_regime")
    if not table or not table.get("regimes"):
        return []
    from cbjax.profile.residuals import format_table

    made = profile.get("made_for", {})
    head = (f"Its step-time residuals by regime ({made.get('model.d_model', '?')}-wide model, "
            f"{made.get('scheduler.max_num_seqs', '?')} slots), on the {table.get('steps', 'in-sample')} served steps, "
            f"fit `{profile.get('served_weighting', 'absolute')}`; a regime beyond ±{table['limit']:.0%} mean signed "
            f"fails the profile ({len(table['failures'])} do):")  # fmt: skip
    return [head, "", *[f"- {line}" for line in format_table(table, buckets=False)], ""]


LABELS = dict(METRICS)


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def _speed_section(cells: list[dict]) -> list[str]:
    """The runs judged per cell and the machine's speed around them (`cbjax.profile.anchor`); none
    where no run was timed against an anchor."""
    timed = [c for c in cells if any(x["speed"] is not None for x in c.get("anchor_runs", []))]
    if not timed:
        return []
    lines = [
        "## Machine speed", "",
        "The profile timed its anchor (`cbjax.profile.anchor`: one of its closed-loop bursts) through its served "
        "rounds; the calibration timed it again before and after each engine run, and judges a cell on the runs made "
        f"while both timings lay within ±{100 * SPEED_TOLERANCE:g}% of the profile's median (rounds go on, up to "
        f"{MAX_ROUNDS_PER_REPEAT} per repeat, until each cell has its repeats). A run off that speed measured another "
        "machine than the profile's and is counted here, not judged; a cell short of its repeats fails. Speed: the "
        "anchor's timing around a run over the profile's (above 1: slower).", "",
        "| cell | runs judged / made | speed of the runs judged | speed of the runs not judged |", "|---|---|---|---|",
    ]  # fmt: skip
    for c in timed:
        judged = sorted(x["speed"] for x in c["anchor_runs"] if x["judged"])
        off = sorted(x["speed"] for x in c["anchor_runs"] if not x["judged"])
        span = lambda xs: f"{xs[0]:.3f}-{xs[-1]:.3f}" if xs else "-"  # noqa: E731
        lines.append(f"| {c['name']} | {c['runs_judged']} / {c['runs']} | {span(judged)} | {span(off)} |")
    return lines + [""]


def judged_cells(j: dict) -> tuple[str, str]:
    """A judged figure's table cells: the engine's median with its interval, and whether the
    simulator is within the target (the target beside it)."""
    lo, hi = j["interval"]
    within = "-" if j["within_target"] is None else ("yes" if j["within_target"] else "no")
    target = "" if j["target_pct"] is None else f" (±{j['target_pct']:g})"
    if j["engine"] is None:  # `unmeasured`
        return "no run at the profile's speed", within + target
    return f"{_num(j['engine'])} [{_num(lo)}, {_num(hi)}]", within + target


def write_markdown(report: dict, profile_paths, path: Path, residual_profiles: Sequence[str] = ()) -> None:
    """docs/CALIBRATION.md's generated part: the profiles (and their held-out step residuals by
    regime), the rule, every judged figure, the regimes, the ratio. `profile_paths`: one path or a
    list; `residual_profiles`: more profiles whose residual tables alone are listed."""
    lines = ["# Calibration: the profiled simulator against the JAX engine", ""]
    for profile_path in [profile_paths] if isinstance(profile_paths, str) else profile_paths:
        profile = json.loads(Path(profile_path).read_text())
        m = profile["machine"]
        lines += [f"Profile: `{profile_path}` (machine: {m['cpu']}, {m['cores']} cores, jax {m['jax']}; fit median error "
                  f"{profile['residuals']['median_rel_error']:.1%}, max {profile['residuals']['max_rel_error']:.1%}). "
                  "Generated by `experiments/calibrate.py`.", "",
                  *_profile_notes(profile), *_profile_table(profile)]  # fmt: skip
    for extra in residual_profiles:
        profile = json.loads(Path(extra).read_text())
        lines += [f"Also profiled, not calibrated here: `{extra}` ({profile.get('model', '?')}).", "",
                  *_profile_table(profile)]  # fmt: skip
    if report.get("quick"):
        lines += ["**A `--quick` smoke run: few cells and requests; its figures are not evidence.**", ""]
    targets = ", ".join(f"{LABELS[k]} {v:g}%" for k, v in TARGETS.items())
    lines += [
        "## The rule", "",
        f"Each cell ran {report['repeats']} times on the engine. Per figure: the engine's median and a bootstrap 90% "
        "interval of it (seeded), the simulator's signed error against the median (+: the simulator over-predicts), "
        "whether the simulator lies inside the interval, and whether it lies within the target. The verdict is the "
        f"target's alone ({targets}; no target is ever replaced by the engine's spread). Closed-loop cells (a burst) "
        "carry the throughput; open-loop cells (Poisson, the trace) carry the latencies, p99 beside p50. Per regime, "
        f"each figure's mean signed error must stay within ±{REGIME_BIAS_PCT:g}%; the continuous / static throughput "
        f"ratio within ±{RATIO_TARGET_PCT:g}%.", "",
        *_speed_section(report["cells"]),
        "## Cells", "",
        "| cell | regime | figure | engine median [90% interval] | simulator | error % | in interval | within target | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for c in report["cells"]:
        for key, label in METRICS:
            j = c.get(key)
            if j is None:
                continue
            engine, within = judged_cells(j)
            error = "-" if j["error_pct"] is None else f"{j['error_pct']:+.1f}"
            lines.append(f"| {c['name']} | {c['regime']} | {label} | {engine} | "
                         f"{_num(j['sim'])} | {error} | {'yes' if j['in_interval'] else 'no'} | "
                         f"{within} | {j['verdict']} |")  # fmt: skip
    lines += ["", "## Regimes", "",
              "| regime | figure | cells | mean signed error % | worst cell (error %) | pass / judged | bias within "
              f"±{REGIME_BIAS_PCT:g}% |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["regimes"]:
        judged = f"{r['num_pass']} / {r['num_targeted']}" if r["num_targeted"] else "-"
        worst = "-" if r["worst_error_pct"] is None else f"{r['worst_error_pct']:+.1f}"
        lines.append(f"| {r['regime']} | {LABELS[r['figure']]} | {r['num_cells']} | {r['mean_signed_error_pct']:+.1f} | "
                     f"{r['worst_cell']} ({worst}) | {judged} | {'yes' if r['bias_ok'] else 'no'} |")  # fmt: skip
    lines += ["", "## Continuous / static throughput ratio (fcfs over static, chunked prefill off, closed loop)", "",
              "| workload | simulator | engine (medians) | error % | verdict |", "|---|---|---|---|---|"]  # fmt: skip
    for r in report["ratios"]:
        engine, error = ("-", "-") if r["engine"] is None else (f"{r['engine']:.3f}", f"{r['error_pct']:+.1f}")
        lines.append(f"| {r['workload']} | {r['sim']:.3f} | {engine} | {error} | {r['verdict']} |")
    cells = [c[k] for c in report["cells"] for k, _ in METRICS if c.get(k) and c[k]["verdict"] != "-"]
    fails = sum(j["verdict"] == "fail" for j in cells)
    biased = [f"{r['regime']} {LABELS[r['figure']]}" for r in report["regimes"] if not r["bias_ok"]]
    lines += ["", f"**Overall:** {len(cells) - fails} of {len(cells)} judged figures within target; regimes biased beyond "
              f"±{REGIME_BIAS_PCT:g}%: {', '.join(biased) or 'none'}.", "", "![parity](calibration_parity.png)", ""]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    head = hand_kept(path) or lines[:2]  # a new document: the generated title
    atomic_write_text(path, "\n".join(head + lines[2:]))  # a write cut short keeps the hand-kept guide


def hand_kept(path: Path) -> list[str]:
    """The lines of the document at `path` before its generated tables (its first `Profile:`
    line), which a regeneration keeps: docs/CALIBRATION.md's guide, and the date, command and
    commit of the tables that follow it. None: empty."""
    if not path.is_file():
        return []
    old = path.read_text().split("\n")
    return old[: next((i for i, line in enumerate(old) if line.startswith("Profile: `")), len(old))]


def plot_parity(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(15, 8))
    for ax, (key, label) in zip(axes.flat, METRICS):
        pts = [(c[key]["engine"], c[key]["sim"], *c[key]["interval"]) for c in report["cells"] if c.get(key) and c[key]["engine"] is not None]
        if not pts:
            ax.set_visible(False)
            continue
        eng, sim, lo, hi = map(np.array, zip(*pts))
        ax.errorbar(eng, sim, xerr=[eng - lo, hi - eng], fmt="o", ms=3, lw=0.8)
        lo_all, hi_all = min(lo.min(), sim.min()), max(hi.max(), sim.max())
        ax.plot([lo_all, hi_all], [lo_all, hi_all], color="gray", lw=1)
        ax.set_title(label)
        ax.set_xlabel("engine (median, 90% interval)")
        ax.set_ylabel("simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, nargs="+",
                    help="profile.json from `python -m cbjax.profile`; several (one per slot count): one report")  # fmt: skip
    ap.add_argument("--residual-profiles", nargs="*", default=[],
                    help="more profiles (another model) whose step-time residual tables the report lists, uncalibrated")  # fmt: skip
    ap.add_argument("--cells", choices=("acceptance", "all"), default="acceptance",
                    help="acceptance: ACCEPTANCE_CELLS; all: every --workloads x --policies, chunked off and on")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"engine runs per cell (at least {MIN_REPEATS})")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: burst and poisson_30, fcfs and static, chunked off, 32 requests; any repeats")  # fmt: skip
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 256, --quick 32; Azure: <= 500)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--workloads", nargs="*", choices=list(WORKLOADS), help="a subset of the workloads")
    ap.add_argument("--trace", default=str(AZURE_CODE), help="the Azure LLM inference code trace CSV")
    ap.add_argument("--out-dir", default=str(REPO / "outputs" / "calibration"))
    ap.add_argument("--doc", default=str(REPO / "docs" / "CALIBRATION.md"))
    ap.add_argument("--cores", type=int, default=None,
                    help="pin the engine runs to the first N CPUs (default: as the first profile was pinned)")  # fmt: skip
    ap.add_argument("--reports", nargs="+", default=None,
                    help="no engine runs: merge these calibration.json files (one per --profile, in its order, as a "
                         "run per slot count writes them) into one report and document")  # fmt: skip
    args = ap.parse_args(argv)
    if args.reports is not None and len(args.reports) != len(args.profile):
        ap.error(f"--reports: {len(args.reports)} files for {len(args.profile)} --profile files; give one per profile")
    if args.repeats < MIN_REPEATS and not args.quick:
        ap.error(f"--repeats {args.repeats}: a cell needs at least {MIN_REPEATS} engine runs (or --quick, which is not evidence)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.requests is None:
        args.requests = 32 if args.quick else 256
    for flag, folder in (("--out-dir", Path(args.out_dir)), ("--doc", Path(args.doc).parent)):
        if problem := unwritable(folder):  # found now, not after the engine runs
            ap.error(f"{flag}: {problem}")
    read = {}  # every file read before the engine runs: a bad one fails now, not after them
    for flag, paths in (("--profile", args.profile), ("--reports", args.reports or []),
                        ("--residual-profiles", args.residual_profiles)):  # fmt: skip
        try:
            read[flag] = [read_json(p) for p in paths]
        except ValueError as err:
            ap.error(f"{flag}: {err}")
    if args.reports is None:  # the engine runs as its profile ran: pinned alike (before jax starts)
        from cbjax.profile.pinning import pin

        cores = args.cores
        if cores is None:
            cores = (read["--profile"][0].get("pinning") or {}).get("cores")
        try:
            pinning = pin(cores, key="--cores")
        except ValueError as err:
            ap.error(str(err))
        print(f"engine runs pinned to CPUs {pinning['cpus']}" if pinning else "engine runs unpinned", flush=True)
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts

    start = time.perf_counter()
    if args.reports is not None:  # each slot count calibrated just after its profile: merge them
        reports = read["--reports"]
    else:
        reports = [run_all(args, p) for p in args.profile]
    report = reports[0] if len(reports) == 1 else merge_reports(reports)
    write_json(Path(args.out_dir) / "calibration.json", report)
    print(f"calibration took {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    doc = Path(args.doc)
    write_markdown(report, args.profile, doc, args.residual_profiles)
    plot_parity(report, doc.parent / "calibration_parity.png")
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
