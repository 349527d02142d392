"""One benchmark: build the workload, send it, and write requests.jsonl and summary.json in
cbjax's schema (so collect_sweep and the comparison scripts read a real server's runs)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Optional

from cbjax.bench.client import apply, itls, run_load
from cbjax.bench.config import BenchConfig
from cbjax.bench.stream import Timing
from cbjax.core.results import IterationStats, RunResult
from cbjax.report.metrics import summarize
from cbjax.report.reasons import format_reasons
from cbjax.core.stop import StopFlag
from cbjax.report.tables import markdown_table, write_run
from cbjax.core.request import FinishReason, Request
from cbjax.workload import build_workload
from cbjax.workload.trace import encode_text_prompts

log = logging.getLogger("cbjax")

# summary.json keys that describe the server's iterations and KV cache, which a client cannot
# see: left out rather than written as zeros
SERVER_SIDE = (
    "iterations", "num_slots", "slot_utilization", "mean_batch_size", "peak_batch_size", "mean_batched_tokens",
    "kv_pages_used_mean", "kv_pages_used_peak", "kv_token_utilization", "preemptions", "window_iterations",
    "finished_in_window", "scheduler_host_s", "queue_s_p50", "queue_s_p90", "queue_s_p99", "queue_s_mean",
    "kv_share_token_states", "kv_share_reserved", "kv_share_internal_frag", "kv_share_external_frag", "kv_share_free",
    "prefix_cache_hit_rate", "prefix_cache_hit_tokens", "prefix_cache_evictions", "swap_preemptions", "swapped_out_pages",
)  # fmt: skip


def bench_summary(cfg: BenchConfig, requests: list[Request], timings: dict[Request, Timing], wall_s: float,
                  interrupted: bool = False, model: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    """summarize() over what the client saw, naming `model`, the one the requests asked for. ITL
    is the time between tokens (tbt_s, also written as itl_s); the makespan runs from the start
    to the end of the last request sent (a workload line rejected unsent ends at its own
    timestamp, which the load may never reach)."""
    gaps = [gap for t in timings.values() for gap in itls(t)]
    makespan = max((r.finish_s for r in requests if r in timings and r.finish_s is not None), default=0.0)
    result = RunResult(requests=requests, stats=IterationStats(), num_slots=0, makespan_s=makespan,
                       preemptions=0, wall_s=wall_s, tbt_s=gaps)  # fmt: skip
    summary = summarize(result, 1, cfg.slo.ttft_s, cfg.slo.tpot_s)
    for key in SERVER_SIDE:
        summary.pop(key, None)
    for key in ("p50", "p90", "p99", "mean"):
        summary[f"itl_s_{key}"] = summary[f"tbt_s_{key}"]
    summary["num_http_errors"] = sum(1 for t in timings.values() if t.error is not None and not t.aborted)
    b = cfg.bench
    summary.update({"client": "cbjax-bench", "url": b.url, "model": model if model is not None else b.model, "endpoint": b.endpoint,
                    "mode": "open" if b.concurrency is None else "closed", "concurrency": b.concurrency,
                    "seed": cfg.seed, "interrupted": interrupted})  # fmt: skip
    return summary


def run_bench(cfg: BenchConfig, out_dir: Optional[Path] = None, *, verbose: bool = True,
              stop: Optional[StopFlag] = None) -> dict[str, Any]:  # fmt: skip
    """Send the workload and write its run files. A signal during the load (SIGINT, SIGTERM:
    it sets `stop`) ends it early; the requests sent get their rows, those in flight
    `aborted`, and summary.json says `interrupted: true`."""
    stop = stop if stop is not None else StopFlag()
    requests = build_workload(cfg.workload, cfg.seed)
    if any(r.pause_s is not None for r in requests):
        raise ValueError(
            f"workload={cfg.workload.name}: its sessions' later turns arrive when the turn before them ends, and "
            "cbjax-bench sends every request at a fixed time; serve sessions with cbjax (simulator or engine)"
        )
    if cfg.bench.prompt == "ids":
        encode_text_prompts(requests, None, where="cbjax-bench (bench.prompt=ids)")
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="bench", mininterval=0.5, leave=False)
    bad = [r for r in requests if r.input_error is not None]
    for req in bad:  # the workload's own errors (a bad trace line): not sent, rejected by name
        req.finish_reason, req.reject_reason, req.finish_s = FinishReason.REJECTED, req.input_error, req.arrival_s
    good = [r for r in requests if r.input_error is None]
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            timings, wall, model = runner.run(run_load(cfg.bench, good, progress=bar.update if bar else None, stop=stop))
    finally:  # an error's line then starts on a line of its own
        if bar is not None:
            bar.close()
    for req, timing in timings.items():
        apply(req, timing)
    rows = [r for r in requests if r in timings or r.input_error is not None]  # not sent (bench.duration_s): no row
    summary = bench_summary(cfg, rows, timings, wall, interrupted=stop.is_set(), model=model)
    if out_dir is not None:
        extra = lambda r: {"itl_s": itls(timings[r]) if r in timings else [], "http_status": timings[r].status if r in timings else None}  # noqa: E731
        write_run(out_dir, cfg, summary, rows, extra_rows=extra)
    if verbose:
        reasons = format_reasons(rows)
        log.info(format_client_summary(summary) + (f"\n\n{reasons}" if reasons else ""))
    return summary


def _loop_factory():
    """uvloop's event loop where it is installed (the bench extra brings it): the client's own
    time per chunk is part of every latency it measures. None: asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def format_client_summary(summary: dict[str, Any]) -> str:
    def triple(key: str) -> str:
        vals = [summary.get(f"{key}_p{p}") for p in (50, 90, 99)]
        return " / ".join("-" if v is None else f"{v * 1e3:.1f}" for v in vals) + " ms"

    rows = [
        ("requests (finished / errors)", f"{summary['num_requests']} ({summary['num_finished']} / {summary['num_http_errors']})"),
        ("makespan", f"{summary['makespan_s']:.3f} s"),
        ("throughput", f"{summary['throughput_tok_s']:.1f} tok/s, {summary['throughput_req_s']:.3f} req/s"),
        ("TTFT p50 / p90 / p99", triple("ttft_s")),
        ("TPOT p50 / p90 / p99", triple("tpot_s")),
        ("ITL p50 / p90 / p99", triple("itl_s")),
        ("e2e p50 / p90 / p99", triple("e2e_s")),
        ("goodput", f"{summary['goodput_req_s']:.3f} req/s ({summary['slo_attainment']:.1%} within the SLO)"),
    ]
    return markdown_table(["metric", f"cbjax-bench ({summary['mode']} loop)"], rows)
