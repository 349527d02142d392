"""Calibration: the same workloads on the JAX engine and in the profiled simulator; writes docs/CALIBRATION.md.

    python -m cbjax.profile hydra.run.dir=outputs/profile        # once per machine and model
    python experiments/calibrate.py --profile outputs/profile/profile.json [--repeats 3] [--requests 256]

About 12 minutes for the tiny model at the defaults on a 2-core machine; it prints each
engine run as it ends, with the time left.

The runs take the profile's shapes (model.max_model_len, page size, slot count, step budget,
token buckets). Workloads, kept apart from the profile's grid: Poisson arrivals at a low and a
high rate (30% and 90% of the simulator's saturated request rate), all requests at t=0, and a
slice of the Azure code trace with prompts scaled to the tiny model; each under fcfs, static and
sjf, with and without chunked prefill. Engine figures are medians of `--repeats` runs, with
their spread (max - min over the median) beside each error. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cbjax.config import (  # noqa: E402
    CacheConfig, ExecutorConfig, LengthConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig,
)  # fmt: skip
from cbjax.run import run_single  # noqa: E402
from cbjax.sim.profiled import COLD_TERMS  # noqa: E402

# the first 500 requests of the Azure code trace, shipped with cbjax (cbjax/data/README.md)
AZURE_CODE = REPO / "cbjax" / "data" / "AzureLLMInferenceTrace_code_sample.csv"
METRICS = [("throughput_tok_s", "throughput"), ("ttft_s_p50", "TTFT p50"), ("ttft_s_p90", "TTFT p90"),
           ("tpot_s_p50", "TPOT p50"), ("e2e_s_p50", "E2E p50"), ("e2e_s_p90", "E2E p90")]  # fmt: skip
TARGETS = {"throughput_tok_s": 3.0, "e2e_s_p50": 5.0, "ttft_s_p50": 10.0}  # median |error| %, issue 10
POLICIES = ("fcfs", "static", "sjf")


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
        cache=CacheConfig(page_size=made["cache.page_size"], num_pages=profile.get("num_pages", CacheConfig.num_pages)),
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
    """The four workloads; Poisson rates from the simulator's saturated request rate."""
    saturated = run_single(sim_config(base, sim_profile), None, verbose=False)["throughput_req_s"]
    wl = base.workload
    return {
        "poisson_low": dataclasses.replace(wl, arrival="poisson", rate=0.3 * saturated),
        "poisson_high": dataclasses.replace(wl, arrival="poisson", rate=0.9 * saturated),
        "all_at_t0": wl,
        "azure_code": WorkloadConfig(
            name="trace",
            format="csv",
            vocab_size=wl.vocab_size,
            path=str(azure_slice(trace, out, wl.num_requests, 0.7 * saturated, base.model.max_model_len)),
        ),  # fmt: skip
    }


def sim_config(cfg: RunConfig, profile: str) -> RunConfig:
    ex = dataclasses.replace(cfg.executor, name="sim", cost_model="profiled", profile=profile)
    return dataclasses.replace(cfg, executor=ex)


def error_pct(sim: float, eng: float) -> float:
    return 100.0 * (sim - eng) / eng if eng else float("nan")


def summarize_cell(wname: str, policy: str, chunked: bool, sim: dict, engine: list[dict]) -> dict:
    """One table row: per metric the simulator's figure, the engine's median, its spread, the error."""
    row = {"workload": wname, "policy": policy, "chunked": chunked}
    for key, _ in METRICS:
        values = [e[key] for e in engine if e[key] is not None]
        med = statistics.median(values) if values else None
        row[key] = {
            "sim": sim[key],
            "engine": med,
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else None,
            "error_pct": error_pct(sim[key], med) if med and sim[key] is not None else None,
        }
    return row


def run_all(args) -> list[dict]:
    """Every cell in the simulator once, then on the engine in `args.repeats` rounds over all the
    cells (a slow spell of the machine then lands on one run of many cells, not on one cell)."""
    profile = json.loads(Path(args.profile).read_text())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = base_config(profile, args.requests)
    chosen = {w: wl for w, wl in workloads(base, out, args.profile, Path(args.trace)).items()
              if not args.workloads or w in args.workloads}  # fmt: skip
    cells = {}
    for w in chosen:
        for policy in args.policies:
            for chunked in (False, True):
                sched = dataclasses.replace(base.scheduler, name=policy, chunked_prefill=chunked)
                cells[(w, policy, chunked)] = dataclasses.replace(base, scheduler=sched, workload=chosen[w])
    sim = {k: run_single(sim_config(cfg, args.profile), None, verbose=False) for k, cfg in cells.items()}
    engine: dict[tuple, list[dict]] = {k: [] for k in cells}
    total, done = len(cells) * args.repeats, 0
    start = time.perf_counter()
    # untimed: a process's first serving pays one-time costs (compiles loaded, first allocations)
    run_single(
        dataclasses.replace(base, workload=dataclasses.replace(base.workload, num_requests=64)), None, verbose=False
    )
    for r in range(args.repeats):
        for (wname, policy, chunked), cfg in cells.items():
            result = run_single(cfg, None, verbose=False)
            engine[(wname, policy, chunked)].append(result)
            done += 1
            elapsed = time.perf_counter() - start
            err = error_pct(sim[(wname, policy, chunked)]["throughput_tok_s"], result["throughput_tok_s"])
            print(f"[{done}/{total}] round {r + 1}: {wname} {policy} chunked {'on' if chunked else 'off'}: "
                  f"throughput error {err:+.1f}% | {elapsed / 60:.1f} min in, "
                  f"~{elapsed / done * (total - done) / 60:.1f} min left", flush=True)  # fmt: skip
    rows = [summarize_cell(*k, sim[k], engine[k]) for k in cells]
    (out / "calibration.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"calibration took {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return rows


def _fmt(cell: dict) -> str:
    if cell["error_pct"] is None:
        return "n/a"
    return f"{cell['sim']:.4g} / {cell['engine']:.4g} ({cell['error_pct']:+.1f}% ±{cell['spread_pct']:.1f})"


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


def write_markdown(rows: list[dict], profile_path: str, path: Path, repeats: int) -> None:
    profile = json.loads(Path(profile_path).read_text())
    lines = ["# Calibration: the profiled simulator against the JAX engine", "",
             f"Profile: `{profile_path}` (machine: {profile['machine']['cpu']}, {profile['machine']['cores']} cores, "
             f"jax {profile['machine']['jax']}; fit median error {profile['residuals']['median_rel_error']:.1%}, "
             f"max {profile['residuals']['max_rel_error']:.1%}). Generated by `experiments/calibrate.py`.", "",
             *_profile_notes(profile),
             f"Each cell: simulator / engine (error %, ± the engine's own spread over {repeats} runs, % of its median).", "",
             "| workload | policy | chunked | " + " | ".join(label for _, label in METRICS) + " |",
             "|---" * (3 + len(METRICS)) + "|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['workload']} | {r['policy']} | {'on' if r['chunked'] else 'off'} | "
                     + " | ".join(_fmt(r[k]) for k, _ in METRICS) + " |")  # fmt: skip
    lines += ["", "## Summary", "", "| metric | median abs error % | worst abs error % (where) | median engine spread % | target % |",
              "|---|---|---|---|---|"]  # fmt: skip
    for key, label in METRICS:
        cells = [(abs(r[key]["error_pct"]), r) for r in rows if r[key]["error_pct"] is not None]
        if not cells:
            continue
        med = statistics.median(c for c, _ in cells)
        worst, wr = max(cells, key=lambda c: c[0])
        spread = statistics.median(r[key]["spread_pct"] for _, r in cells)
        target = TARGETS.get(key)
        note = "" if target is None else (f"{max(target, spread):.1f}" + (" (the spread)" if spread > target else ""))
        lines.append(f"| {label} | {med:.1f} | {worst:.1f} ({wr['workload']}, {wr['policy']}, "
                     f"chunked {'on' if wr['chunked'] else 'off'}) | {spread:.1f} | {note} |")  # fmt: skip
    lines += ["", "## Continuous / static throughput ratio (fcfs over static, chunked prefill off)", "",
              "| workload | simulator | engine | error % |", "|---|---|---|---|"]  # fmt: skip
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = {r["policy"]: r["throughput_tok_s"] for r in rows if r["workload"] == w and not r["chunked"]}
        if "fcfs" in by and "static" in by and by["static"]["engine"]:
            sim = by["fcfs"]["sim"] / by["static"]["sim"]
            eng = by["fcfs"]["engine"] / by["static"]["engine"]
            lines.append(f"| {w} | {sim:.3f} | {eng:.3f} | {error_pct(sim, eng):+.1f} |")
    lines += ["", "![parity](calibration_parity.png)", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def plot_parity(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 8))
    for ax, (key, label) in zip(axes.flat, METRICS):
        pts = [(r[key]["engine"], r[key]["sim"]) for r in rows if r[key]["error_pct"] is not None]
        if not pts:
            continue
        eng, sim = map(np.array, zip(*pts))
        ax.scatter(eng, sim, s=14)
        lo, hi = min(eng.min(), sim.min()), max(eng.max(), sim.max())
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set_title(label)
        ax.set_xlabel("engine")
        ax.set_ylabel("simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile.json from `python -m cbjax.profile`")
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per cell (median)")
    ap.add_argument("--requests", type=int, default=256, help="requests per run (the Azure slice: at most 500)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--workloads", nargs="*", help="a subset of poisson_low poisson_high all_at_t0 azure_code")
    ap.add_argument("--trace", default=str(AZURE_CODE), help="the Azure LLM inference code trace CSV")
    ap.add_argument("--out-dir", default=str(REPO / "outputs" / "calibration"))
    ap.add_argument("--doc", default=str(REPO / "docs" / "CALIBRATION.md"))
    args = ap.parse_args()
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts

    rows = run_all(args)
    doc = Path(args.doc)
    write_markdown(rows, args.profile, doc, args.repeats)
    plot_parity(rows, doc.parent / "calibration_parity.png")
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
