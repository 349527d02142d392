"""Benchmark: many concurrent streams against cbjax-serve on the paced simulator, some leaving midway.

    python benchmarks/serve_load.py [--streams 1000] [--leave 0.0] [--max-tokens 32] [OVERRIDE ...]

Starts `cbjax-serve` (paced simulator, 5 ms an iteration, 64 slots unless OVERRIDEs say
otherwise), opens --streams streaming completions at once, and checks the server under load
and disconnects:
- every stream that stays gets exactly --max-tokens tokens (counted from its chunks and from
  its usage) and no error;
- a share --leave of them (every k-th) closes its connection after 10 tokens;
- the server's resident memory after the first 100 completions against at the end;
- /metrics afterwards: 0 running, 0 waiting, 0 KV pages used;
- after SIGTERM, exit code 0 and one requests.jsonl row per stream, with its fate.
Exits 1 if any check fails. The load is bounded: --streams requests, each with a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's cbjax, as the server (run from ROOT) imports it

from cbjax.serve import process as serve_process  # noqa: E402


LEAVE_AFTER = 10  # tokens a leaving stream reads


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


async def load(base: str, args, pid: int) -> dict:
    every = round(1 / args.leave) if args.leave > 0 else 0
    sample_at = min(100, args.streams)  # the completions after which the server's memory is read
    state = {"done": 0, "rss_after_100": None, "sample_at": sample_at, "bad": [], "left": 0}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        leaves = every and i % every == 0
        body = {"prompt": f"stream {i}", "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        tokens, usage = 0, None
        try:
            async with client.stream("POST", f"{base}/completions", json=body) as resp:
                if resp.status_code != 200:
                    state["bad"].append((i, f"HTTP {resp.status_code}"))
                async for line in resp.aiter_lines():
                    # cbjax-serve's chunks: a token's has finish_reason null, the usage chunk no
                    # choices; only the latter is parsed, so the client keeps up with the stream
                    if '"finish_reason": null' in line:
                        tokens += 1
                        if leaves and tokens == LEAVE_AFTER:
                            state["left"] += 1
                            return
                    elif line.startswith("data: {") and '"choices": []' in line:
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            state["bad"].append((i, repr(e)))
        finally:
            state["done"] += 1
            if state["done"] == sample_at:
                state["rss_after_100"] = rss_mib(pid)
        if not leaves and (tokens != args.max_tokens or usage != args.max_tokens):
            state["bad"].append((i, f"{tokens} token chunks, usage {usage}"))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        await asyncio.gather(*(stream(client, i) for i in range(args.streams)))
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--leave", type=float, default=0.0, help="share of streams that leave after 10 tokens (0.2: every fifth)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "serve_load")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for cbjax-serve")
    args = parser.parse_args(argv)
    proc, base = serve_process.start([f"hydra.run.dir={args.out}", "overhead.step_s=0.005", "scheduler.max_num_seqs=64",
                                      *args.overrides], ROOT)  # fmt: skip
    try:
        rss_start = rss_mib(proc.pid)
        t0 = time.perf_counter()
        state = asyncio.run(load(base, args, proc.pid))
        wall = time.perf_counter() - t0
        rss_end = rss_mib(proc.pid)
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics").text
        gauges = {name: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_pages_used")
                  if line.startswith(f"cbjax:{name}{{")}  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    rows = [json.loads(line) for line in (args.out / "requests.jsonl").read_text().splitlines()]
    fates = collections.Counter((r["finish_reason"], r["error"]) for r in rows)
    growth = rss_end / state["rss_after_100"] if state["rss_after_100"] else float("nan")
    print(f"{args.streams} streams ({state['left']} left after {LEAVE_AFTER} tokens) in {wall:.1f} s")
    print(f"errors: {len(state['bad'])} {state['bad'][:5]}")
    print(f"server RSS: start {rss_start:.0f} MiB, after {state['sample_at']} completions {state['rss_after_100']:.0f} MiB, "
          f"end {rss_end:.0f} MiB ({growth:.3f}x)")
    print(f"/metrics after: {gauges}")
    print(f"exit code {code}; requests.jsonl rows {len(rows)}; fates {dict(fates)}")
    ok = (not state["bad"] and growth <= 1.10 and all(v == 0 for v in gauges.values()) and len(gauges) == 3
          and code == 0 and len(rows) == args.streams)  # fmt: skip
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
