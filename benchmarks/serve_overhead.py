"""Benchmark: one workload served three ways, side by side, to show what the server costs.

    python benchmarks/serve_overhead.py [--executor jax] [--rate 8|half|half-served] [--num-requests 200]
        [--profile PROFILE.json] [--out DIR] [--repeats 1] [--ways offline,served,...] [OVERRIDE ...]

--ways defaults to every way but `engine process`.

1. offline: `cbjax` in-process (run_experiment) with the executor;
2. served: `cbjax-serve` with the same executor, driven by `cbjax-bench` open loop at the
   workload's arrival times, on this machine (client-side times); and, as `engine process`,
   the same with `server.engine_process=true` (the engine in a process of its own);
3. paced sim: `cbjax-serve executor=sim executor.pace=realtime` (cost_model=profiled with
   --profile, the profile of this machine from `python -m cbjax.profile`; roofline without),
   driven the same way;
and, as the paced simulator's own reference, 4. offline sim: the same simulator offline.

The table shows medians over --repeats of TTFT, TPOT, ITL (the client's; offline runs' time
between tokens) and E2E p50, and output throughput, with served / offline and paced sim /
offline sim. With offline and served among --ways, a second table gives the server-overhead
figures as median [min, max]: the client's TTFT p50 minus the server's own (its requests.jsonl,
from each request's receipt) against max(2 ms, 10%), and the served / offline throughput ratio;
and the CPU time per output token of the server process (all its threads, the engine's
included) and of the client while the workload ran (from /proc on Linux). OVERRIDEs (Hydra
`key=value`) apply to every run: the model, scheduler, cache, workload lengths. Measure on a quiet machine: the client and the server share its cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import statistics
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's cbjax, as the server (run from ROOT) imports it

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import cbjax.bench.cli  # noqa: F401, E402  registers BenchConfig
import cbjax.app.cli  # noqa: F401, E402  registers RunConfig
from cbjax.bench.config import BenchConfig  # noqa: E402
from cbjax.bench.run import run_bench  # noqa: E402
from cbjax.app.config_merge import check_known_keys, to_run_config  # noqa: E402
from cbjax.report.tables import markdown_table  # noqa: E402
from cbjax.app.run import run_experiment  # noqa: E402
from cbjax.serve import process as serve_process  # noqa: E402

CONFIGS = str(ROOT / "configs")
WAYS = ("offline", "served", "engine process", "paced sim", "offline sim")
METRICS = (("TTFT p50 (ms)", "ttft_s_p50", 1e3), ("TPOT p50 (ms)", "tpot_s_p50", 1e3), ("ITL p50 (ms)", "tbt_s_p50", 1e3),
           ("E2E p50 (ms)", "e2e_s_p50", 1e3), ("throughput (tok/s)", "throughput_tok_s", 1.0))  # fmt: skip


def offline(overrides: list[str], out: Path) -> dict:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=["progress=false", *overrides]))
    return run_experiment(cfg, out, verbose=False)


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def served(server_overrides: list[str], workload: list[str], out: Path, cpu: Optional[list] = None) -> dict:
    """Start cbjax-serve, send the workload with cbjax-bench, stop the server (SIGTERM). With
    `cpu`, append the CPU seconds the server process and this one (the client) spent while the
    workload ran."""
    proc, base = serve_process.start([f"hydra.run.dir={out / 'server'}", *server_overrides], ROOT)
    try:
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            raw = compose(config_name="bench", overrides=["progress=false", f"bench.url={base}", *workload])
        check_known_keys(raw, BenchConfig)
        server0, client0 = serve_process.cpu_s(proc.pid), own_cpu_s()
        summary = run_bench(OmegaConf.to_object(raw), out / "bench", verbose=False)
        if summary.get("interrupted"):  # Ctrl-C: a partial run would be tabled as a whole one
            raise SystemExit(f"interrupted: {out} holds a partial run; nothing is tabled")
        server1, client1 = serve_process.cpu_s(proc.pid), own_cpu_s()
        if cpu is not None:
            cpu.append({"server_s": None if server0 is None or server1 is None else server1 - server0,
                        "client_s": client1 - client0})  # fmt: skip
        return summary
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def server_log(out: Path) -> dict:
    """The served run's own summary.json: its TTFT counts from each request's receipt."""
    return json.loads((out / "server" / "summary.json").read_text())


def spread(vals: list[float], scale: float = 1.0) -> str:
    """Median [min, max]."""
    return f"{statistics.median(vals) * scale:.2f} [{min(vals) * scale:.2f}, {max(vals) * scale:.2f}]"


def overhead_figures(results: dict[str, list[dict]], logs: list[dict], cpu: list[dict]) -> list[list[str]]:
    """The server-overhead figures, per repeat then as median [min, max]: the client's
    TTFT p50 over the server's own (from requests' receipt) and over the offline run's, with
    the bound max(2 ms, 10%) of the latter; the served / offline throughput ratio (within 5%).
    Beside them, the CPU time per output token of the server process and of the client while
    the workload ran: on a machine whose speed drifts, a steadier measure of what serving costs."""
    client = [s["ttft_s_p50"] for s in results["served"]]
    server = [s["ttft_s_p50"] for s in logs]
    off = [s["ttft_s_p50"] for s in results["offline"]]
    thr = [a["throughput_tok_s"] / b["throughput_tok_s"] for a, b in zip(results["served"], results["offline"])]
    diff_server = [c - s for c, s in zip(client, server)]
    diff_offline = [c - o for c, o in zip(client, off)]
    bound = [max(0.002, 0.1 * s) for s in server]
    tokens = [s["output_tokens"] for s in logs]
    per_token = []
    for key, label in (("server_s", "server process CPU per output token (us)"), ("client_s", "client CPU per output token (us)")):
        vals = [c[key] / n for c, n in zip(cpu, tokens) if c.get(key) is not None and n]
        if vals:
            per_token.append([label, spread(vals, 1e6)])
    return [
        ["client TTFT p50 (ms)", spread(client, 1e3)],
        ["server TTFT p50, its requests.jsonl (ms)", spread(server, 1e3)],
        ["offline TTFT p50 (ms)", spread(off, 1e3)],
        ["client - server TTFT p50 (ms)", spread(diff_server, 1e3)],
        ["  bound max(2 ms, 10% of server) (ms)", spread(bound, 1e3)],
        ["client - offline TTFT p50 (ms)", spread(diff_offline, 1e3)],
        ["throughput served / offline", spread(thr)],
        *per_token,
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executor", default="jax", choices=("jax", "sim"))
    parser.add_argument("--rate", default="8", help="Poisson arrivals, requests per second; `half`: half of the "
                        "executor's capacity, measured first offline with every request arriving at once; "
                        "`half-served`: half of the server's, every request sent at once through cbjax-serve")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--profile", help="profile.json of this machine for the paced simulator (cost_model=profiled)")
    parser.add_argument("--repeats", type=int, default=1)
    default_ways = ",".join(w for w in WAYS if w != "engine process")
    parser.add_argument("--ways", default=default_ways, help=f"which of {', '.join(WAYS)} to run (comma-separated)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "serve_overhead")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (model, scheduler, lengths)")
    args = parser.parse_args(argv)
    chosen = args.ways.split(",")
    unknown = [w for w in chosen if w not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    # the workload keys go to cbjax-bench too; the rest only to the server and offline runs
    lengths = [o for o in args.overrides if o.startswith(("workload.", "workload=", "seed=", "slo."))]
    # one model for every way, the simulator's included: the engine's default unless an override names one
    engine = ["model=tiny", "hardware=a100_80gb", *(o for o in args.overrides if o not in lengths)]
    if args.rate in ("half", "half-served"):
        burst = [f"workload.num_requests={args.num_requests}", *lengths, "workload.arrival=all_at_once"]
        if args.rate == "half":
            print("capacity: offline, every request at once", file=sys.stderr, flush=True)
            cap = offline([f"executor={args.executor}", *engine, *burst], args.out / "capacity")
        else:
            print("capacity: served, every request at once", file=sys.stderr, flush=True)
            cap = served([f"executor={args.executor}", *engine], burst, args.out / "capacity")
        args.rate = round(cap["throughput_req_s"] / 2, 2)
        print(f"capacity {cap['throughput_req_s']:.1f} req/s: rate {args.rate}/s", file=sys.stderr, flush=True)
    else:
        try:
            args.rate = float(args.rate)
        except ValueError:
            parser.error(f"--rate: {args.rate!r} is neither a number, `half` nor `half-served`")
    workload = [f"workload.num_requests={args.num_requests}", "workload.arrival=poisson", f"workload.rate={args.rate}", *lengths]
    sim = ["executor=sim", *((["executor.cost_model=profiled", f"executor.profile={args.profile}"]) if args.profile else [])]
    cpu: list[dict] = []  # the served runs' CPU seconds, server and client
    ways = {
        "offline": lambda out: offline([f"executor={args.executor}", *engine, *workload], out),
        "served": lambda out: served([f"executor={args.executor}", *engine], workload, out, cpu),
        "engine process": lambda out: served([f"executor={args.executor}", "server.engine_process=true", *engine], workload, out),
        "paced sim": lambda out: served([*sim, "executor.pace=realtime", *engine], workload, out),
        "offline sim": lambda out: offline([*sim, *engine, *workload], out),
    }
    ways = {name: run for name, run in ways.items() if name in chosen}
    results: dict[str, list[dict]] = {name: [] for name in ways}
    logs: list[dict] = []  # the served runs' own summaries
    for i in range(args.repeats):
        for name, run in ways.items():
            print(f"repeat {i + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
            out = args.out / f"r{i}" / name.replace(" ", "_")
            results[name].append(run(out))
            if name == "served":
                logs.append(server_log(out))

    def value(name: str, key: str, scale: float):
        vals = [s.get(key) for s in results.get(name, ()) if s.get(key) is not None]
        return statistics.median(vals) * scale if vals else None

    def ratio(v: dict, a: str, b: str) -> str:
        return f"{v[a] / v[b]:.3f}" if v.get(a) is not None and v.get(b) else "-"

    rows = []
    for label, key, scale in METRICS:
        v = {name: value(name, key, scale) for name in ways}
        rows.append([label, *(f"{v[n]:.2f}" if v[n] is not None else "-" for n in ways),
                     ratio(v, "served", "offline"), ratio(v, "engine process", "offline"),
                     ratio(v, "paced sim", "offline sim")])  # fmt: skip
    header = ["metric", *ways, "served / offline", "engine process / offline", "paced sim / offline sim"]
    print(f"\nexecutor={args.executor}, {args.num_requests} requests at {args.rate}/s, medians of {args.repeats}\n")
    print(markdown_table(header, rows))
    if "served" in ways and "offline" in ways:
        print(f"\nserver overhead, median [min, max] of {args.repeats}\n")
        print(markdown_table(["figure", "value"], overhead_figures(results, logs, cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
