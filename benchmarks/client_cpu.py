"""Benchmark: cbjax-bench's client against the hand-written HTTP/1.1 client it replaced, side by
side on one workload and one server.

    python benchmarks/client_cpu.py [--old REV] [--rate 80] [--num-requests 200] [--repeats 3]
        [OVERRIDE ...]

One `cbjax-serve executor=sim model=tiny executor.pace=realtime` (this checkout's) serves every run. Each
run is cbjax-bench in a process of its own, open loop at the workload's Poisson arrivals (the
same workload every run), with the cbjax of the checkout it measures: this one (aiohttp), and
REV's (default e374f09, the last commit with the hand-written `cbjax.bench.http`), extracted
with `git archive` into a temporary folder; the two alternate, in turn first. A run reports
the client's TTFT and ITL p50, the client process's CPU seconds (user + system, getrusage)
spent in run_bench per output token, and the server's CPU seconds per output token over the
same span (from /proc). At the end: the medians, and the TTFT p50 difference of each pair of
runs (this checkout's minus REV's) and their median. The client shares the machine's cores
with the server, so its CPU time both delays its own timestamps and slows the server: measure
on a quiet machine. OVERRIDEs (Hydra `key=value`): `workload.*` go to the client, the rest to
the server.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's cbjax, as the server (run from ROOT) imports it

from cbjax.serve import process as serve_process  # noqa: E402

# the client process: run_bench in-process between two getrusage readings; one JSON line out
CLIENT = r"""
import json, resource, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
import cbjax, cbjax.bench.cli
from cbjax.bench.config import BenchConfig
from cbjax.bench.run import run_bench
from cbjax.app.config_merge import check_known_keys
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    raw = compose(config_name="bench", overrides=["progress=false", *sys.argv[2:]])
check_known_keys(raw, BenchConfig)
cfg = OmegaConf.to_object(raw)
ru = resource.getrusage(resource.RUSAGE_SELF)
before = ru.ru_utime + ru.ru_stime
print("start", flush=True)
summary = run_bench(cfg, None, verbose=False)
ru = resource.getrusage(resource.RUSAGE_SELF)
out = {"cpu_s": ru.ru_utime + ru.ru_stime - before, "cbjax": cbjax.__file__}
out.update({k: summary.get(k) for k in ("output_tokens", "num_finished", "num_http_errors", "ttft_s_p50", "itl_s_p50")})
print("result " + json.dumps(out), flush=True)
"""


def extract(rev: str, into: Path) -> Path:
    """REV's tree (`git archive`), as a plain folder to run its cbjax from."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_client(checkout: Path, server: subprocess.Popen, overrides: list[str]) -> dict:
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", CLIENT, str(checkout / "configs"), *overrides]
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, text=True)
    result, server_before = None, None
    for line in proc.stdout:
        if line.startswith("start"):
            server_before = serve_process.cpu_s(server.pid)
        elif line.startswith("result "):
            result = json.loads(line[7:])
            result["server_cpu_s"] = serve_process.cpu_s(server.pid) - server_before
    if proc.wait() != 0 or result is None:
        raise SystemExit(f"the client in {checkout} failed ({proc.returncode})")
    if not result["cbjax"].startswith(str(checkout)):
        raise SystemExit(f"the client meant for {checkout} imported {result['cbjax']}")
    if result["num_http_errors"]:
        raise SystemExit(f"the client in {checkout} saw {result['num_http_errors']} failed requests")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="e374f09", help="the commit whose cbjax-bench to compare against")
    parser.add_argument("--rate", type=float, default=80.0, help="Poisson arrivals, requests per second")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "client_cpu")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: workload.* for the client, the rest for the server")
    args = parser.parse_args(argv)
    workload = [o for o in args.overrides if o.startswith(("workload.", "workload=", "seed="))]
    server_overrides = [o for o in args.overrides if o not in workload]
    client = [f"workload.num_requests={args.num_requests}", "workload.arrival=poisson", f"workload.rate={args.rate}", *workload]
    names = {"old": f"hand-written ({args.old})", "new": "aiohttp (this checkout)"}
    results: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="cbjax-old-") as tmp:
        checkouts = {"old": extract(args.old, Path(tmp)), "new": ROOT}
        server, url = serve_process.start(["executor=sim", "model=tiny", "hardware=a100_80gb", "executor.pace=realtime",
                                           f"hydra.run.dir={args.out / 'server'}", *server_overrides], ROOT)  # fmt: skip
        try:
            for i in range(args.repeats):
                for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                    r = run_client(checkouts[name], server, [f"bench.url={url}", *client])
                    results[name].append(r)
                    print(f"repeat {i + 1} {names[name]}: TTFT p50 {r['ttft_s_p50'] * 1e3:.2f} ms, ITL p50 {r['itl_s_p50'] * 1e3:.2f} ms, "
                          f"{r['cpu_s'] / r['output_tokens'] * 1e6:.1f} us/token client, "
                          f"{r['server_cpu_s'] / r['output_tokens'] * 1e6:.1f} us/token server, {r['num_finished']} finished", flush=True)  # fmt: skip
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)

    def med(runs: list[dict], f) -> float:
        return statistics.median(f(r) for r in runs)

    print(f"\nmedians of {args.repeats}, {args.num_requests} requests at {args.rate}/s")
    for name, runs in results.items():
        print(f"{names[name]:>28}: TTFT p50 {med(runs, lambda r: r['ttft_s_p50']) * 1e3:.2f} ms, "
              f"ITL p50 {med(runs, lambda r: r['itl_s_p50']) * 1e3:.2f} ms, "
              f"client {med(runs, lambda r: r['cpu_s'] / r['output_tokens']) * 1e6:.1f} us/token, "
              f"server {med(runs, lambda r: r['server_cpu_s'] / r['output_tokens']) * 1e6:.1f} us/token")  # fmt: skip
    diffs = [(new["ttft_s_p50"] - old["ttft_s_p50"]) * 1e3 for old, new in zip(results["old"], results["new"])]
    print(f"TTFT p50, aiohttp minus hand-written: {statistics.median(diffs):+.2f} ms (median of the pairs; "
          f"each: {', '.join(f'{d:+.2f}' for d in diffs)} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
