"""Benchmark: continuous (fcfs) vs static batching on the real JAX engine, beside the profiled simulator's prediction.

    python benchmarks/engine_static_vs_continuous.py [--rounds 5] [--requests 256] [--repeats 9]
    python benchmarks/engine_static_vs_continuous.py --profile outputs/profile/profile.json

It runs in rounds (about 1.5 minutes each). Without --profile each round profiles the machine
first (`python -m cbjax.profile`, default tiny model, about half a minute) into
outputs/bench_profile/roundN/: simulator and engine then see the machine in the same state.
On a shared VM the engine's own speed drifts by 20-50% within minutes, and its
continuous/static ratio with it (the median of 9 paired repeats moved 1.29-1.54 between runs
of a quarter of an hour), and a profile taken at one moment predicts the machine of that
moment: one round's error mixes the simulator's with the VM's drift. The rounds' median error
is the figure; each round's is printed.

Two workloads, all requests at t=0, on the profile's model, slot count, page size and page pool:
`exponential` (prompts uniform 16..128, outputs exponential with mean 64, at most 384: this
benchmark's workload) and `azure_code` (the first requests of the Azure code trace, prompts
/16, as experiments/calibrate.py scales them). Per workload and policy: the engine's wall-clock
tokens/s (median of repeats, the two policies run side by side in each repeat), iterations, ms
per iteration, host share (the scheduler's and the packer's seconds over the makespan; under
pipelined serving they overlap the device's), and the simulator's tokens/s with
`executor.cost_model=profiled`;
then the fcfs/static throughput ratio, engine against simulator, with the error; at the end the
errors of all rounds and their median (target within 5%). The engine's ratio is the median of
the per-repeat pairs, each pair run back to back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

import calibrate  # noqa: E402
from cbjax.config import LengthConfig, WorkloadConfig  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.app.run import run_single  # noqa: E402

POLICIES = ("static", "fcfs")


def bench_workloads(args, base, out: Path) -> dict[str, WorkloadConfig]:
    vocab = base.model.vocab_size
    azure = calibrate.azure_slice(Path(args.trace), out, args.requests, None, base.model.max_model_len)
    return {
        "exponential": WorkloadConfig(
            num_requests=args.requests,
            vocab_size=vocab,
            prompt_len=LengthConfig(dist="uniform", low=16, high=args.max_prompt, max=args.max_prompt),
            output_len=LengthConfig(dist="exponential", mean=args.mean_output, max=args.max_output),
        ),  # fmt: skip
        "azure_code": WorkloadConfig(name="trace", format="csv", vocab_size=vocab, path=str(azure)),
    }


def engine_row(summary: dict) -> dict:
    iters = summary["iterations"]
    host = summary["scheduler_host_s"] + summary["host_pack_s"]
    return {
        "tok_s": summary["throughput_tok_s"], "iterations": iters,
        "ms_per_iter": 1e3 * summary["makespan_s"] / iters, "host_share": host / summary["makespan_s"],
    }  # fmt: skip


def profile_now(out: Path) -> Path:
    """Run `python -m cbjax.profile` (defaults) into `out` in a process of its own; its profile.json."""
    print(f"profiling this machine first (about a minute): python -m cbjax.profile hydra.run.dir={out}",
          file=sys.stderr, flush=True)  # fmt: skip
    cmd = [sys.executable, "-m", "cbjax.profile", f"hydra.run.dir={out}", "progress=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"engine_static_vs_continuous: error: profiling failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return out / "profile.json"


def run_round(args, profile_path: str, tmp: Path) -> dict:
    """One round: the simulator on `profile_path`, then the engine's paired repeats; per workload and
    policy the engine's runs and the simulator's summary."""
    profile = json.loads(Path(profile_path).read_text())
    base = calibrate.base_config(profile, args.requests)
    if args.pages is not None:
        base = dataclasses.replace(base, cache=dataclasses.replace(base.cache, num_pages=args.pages))
    wls = bench_workloads(args, base, tmp)
    cfgs = {(w, p): dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, name=p), workload=wl)
            for w, wl in wls.items() for p in POLICIES}  # fmt: skip
    sim = {k: run_single(calibrate.sim_config(cfg, profile_path), None, verbose=False) for k, cfg in cfgs.items()}
    engine: dict[tuple[str, str], list[dict]] = {k: [] for k in cfgs}
    # untimed: a process's first serving pays one-time costs (compiles loaded, first allocations)
    first = cfgs[("exponential", "fcfs")]
    run_single(dataclasses.replace(first, workload=dataclasses.replace(first.workload, num_requests=64)), None,
               verbose=False)  # fmt: skip
    for r in range(args.repeats):  # the two policies side by side, under the same load
        for k, cfg in cfgs.items():
            engine[k].append(engine_row(run_single(cfg, None, verbose=False)))
        print(f"  repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return {"profile": profile_path, "model": profile["model"], "slots": base.scheduler.max_num_seqs,
            "workloads": list(wls), "engine": engine, "sim": sim}  # fmt: skip


def report_round(res: dict) -> dict[str, tuple[float, float, float]]:
    """Print one round's tables; per workload (engine ratio, simulator ratio, error %)."""
    out = {}
    for w in res["workloads"]:
        rows, tok = [], {}
        for p in POLICIES:
            runs, sim = res["engine"][(w, p)], res["sim"][(w, p)]
            med = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
            tok[p] = (med["tok_s"], sim["throughput_tok_s"], [x["tok_s"] for x in runs])
            rows.append((p, f"{med['tok_s']:.0f}", f"{tok[p][1]:.0f}", f"{calibrate.error_pct(tok[p][1], med['tok_s']):+.1f}",
                         int(med["iterations"]), int(sim["iterations"]), f"{med['ms_per_iter']:.2f}",
                         f"{med['host_share']:.1%}"))  # fmt: skip
        print(f"\n{w}:")
        print(markdown_table(["policy", "engine tok/s", "sim tok/s", "error %", "engine iterations", "sim iterations",
                              "engine ms/iter", "host share"], rows))  # fmt: skip
        # The engine's ratio: the median of each repeat's fcfs/static pair (run back to back, so a
        # pair shares the machine's state); the ratio of the two medians mixes repeats and drifts
        # with the VM, so it is printed beside it, not used.
        per_repeat = [f / s for f, s in zip(tok["fcfs"][2], tok["static"][2])]
        engine_ratio = statistics.median(per_repeat)
        sim_ratio = tok["fcfs"][1] / tok["static"][1]
        error = calibrate.error_pct(sim_ratio, engine_ratio)
        print(f"fcfs / static throughput: engine {engine_ratio:.3f}x (median of {len(per_repeat)} paired repeats, "
              f"range {min(per_repeat):.3f}-{max(per_repeat):.3f}; ratio of medians {tok['fcfs'][0] / tok['static'][0]:.3f}x), "
              f"simulator {sim_ratio:.3f}x: error {error:+.1f}%")  # fmt: skip
        out[w] = (engine_ratio, sim_ratio, error)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None,
                    help="profile.json from `python -m cbjax.profile` (its model, slots and page size are used) for "
                         "every round; default: profile this machine at the start of each round")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="rounds of (profile, simulator, engine repeats)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9, help="paired engine repeats per round")
    ap.add_argument("--mean-output", type=float, default=64.0)
    ap.add_argument("--max-output", type=int, default=384)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--pages", type=int, default=None,
                    help="cache.num_pages (default: the profile's; a larger pool spreads the pages in use and slows "
                         "served steps, so the simulator predicts the pool it was profiled at)")  # fmt: skip
    ap.add_argument("--trace", default=str(calibrate.AZURE_CODE), help="the Azure LLM inference code trace CSV")
    ap.add_argument("--out", default=str(REPO / "outputs" / "engine_static_vs_continuous.json"),
                    help="where to write every round's figures (JSON)")  # fmt: skip
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        sys.exit("engine_static_vs_continuous: error: --rounds and --repeats must be >= 1")
    if args.profile is not None and not Path(args.profile).is_file():
        sys.exit(f"engine_static_vs_continuous: error: no profile at {args.profile}; make one with "
                 "`python -m cbjax.profile hydra.run.dir=outputs/profile` or pass no --profile")  # fmt: skip
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts

    record = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
            path = args.profile or str(profile_now(REPO / "outputs" / "bench_profile" / f"round{rnd + 1}"))
            res = run_round(args, path, Path(tmp))
            print(f"\n## round {rnd + 1}/{args.rounds}: {res['model']} model, {res['slots']} slots, {args.requests} "
                  f"requests at t=0, engine medians of {args.repeats}; simulator: profiled cost model ({path})")  # fmt: skip
            ratios = report_round(res)
            record.append({
                "profile": path,
                "engine_tok_s": {f"{w}/{p}": [x["tok_s"] for x in runs] for (w, p), runs in res["engine"].items()},
                "sim_tok_s": {f"{w}/{p}": s["throughput_tok_s"] for (w, p), s in res["sim"].items()},
                "ratio": {w: {"engine": e, "sim": s, "error_pct": err} for w, (e, s, err) in ratios.items()},
            })  # fmt: skip
    print(f"\n## fcfs / static throughput over {args.rounds} rounds (error: simulator against engine, target within 5%)")
    rows = []
    for w in record[0]["ratio"]:
        rs = [r["ratio"][w] for r in record]
        errs = [r["error_pct"] for r in rs]
        rows.append((w, " ".join(f"{r['engine']:.3f}" for r in rs), " ".join(f"{r['sim']:.3f}" for r in rs),
                     " ".join(f"{e:+.1f}" for e in errs), f"{statistics.median(errs):+.1f}"))  # fmt: skip
    print(markdown_table(["workload", "engine ratio per round", "simulator ratio per round", "error % per round",
                          "median error %"], rows))  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": record}, indent=1))
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
