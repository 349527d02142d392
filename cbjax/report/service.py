"""Per-client service over time (VTC's measure) and a summary restricted to a time window.

The serving loop reports each iteration to a `ServiceLog` once the scheduler has recorded its
tokens. Service is what a client received: `metrics.service_weights.input` per prompt token
the first time it is processed (a recompute after preemption is not service again; a
prefix-cache hit counts as processed by the iteration that admits the request) plus
`metrics.service_weights.output` per generated token, each at the end of the iteration that
produced it.

`metrics.window_s = [start, end]` restricts the summary. Work counts when it ends inside the
window, arrivals when they fall inside it:
- Request fields (num_requests and each fate's count, TTFT, TPOT, E2E and queueing
  percentiles, normalized_latency_s_per_token, slo_attainment) describe the requests that
  arrive in [start, end), with their whole latency even when they finish after `end`; as over
  the whole run, slo_attainment leaves out those an interrupted run never reached
  (not_arrived).
- Token and rate fields (output_tokens, throughput_tok_s, client_service) count tokens from
  iterations that end in (start, end], per second of `end - start`, whatever the fate of the
  request that made them (the whole run's output_tokens counts served requests' only);
  throughput_req_s and goodput_req_s count served requests that finish in (start, end].
- Iteration fields (iterations, mean_batch_size, peak_batch_size, slot_utilization,
  mean_batched_tokens) average the iterations that end in (start, end].
- Every other field (makespan, KV occupancy, preemptions, the executor's counters, the
  time-between-tokens percentiles, TTFT by turn) stays whole-run.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

from cbjax.config import MetricsConfig
from cbjax.core.results import RunResult
from cbjax.report.metrics import SERVED, _percentiles, meets_slo, normalized_latency, request_latencies
from cbjax.core.request import FinishReason, Request, Status
from cbjax.core.plan import Schedule

_FINISHED = Status.FINISHED


class ServiceLog:
    """Iteration end times and batch sizes, and per (iteration, client) the tokens served."""

    def __init__(self) -> None:
        self.end_s: list[float] = []
        self.batch: list[int] = []
        self.batched_tokens: list[int] = []
        self.events: list[tuple[int, str, int, int]] = []  # (iteration, client, prompt, generated)
        self._prompt_done: dict[Request, int] = {}
        self._generated: dict[Request, int] = {}

    def on_step(self, plan: Schedule, end_s, num_batched_tokens: int, requests: list[Request]) -> None:
        """Record one iteration after `Scheduler.postprocess` has run on `plan`, whose
        scheduled requests are `requests`; a decode stretch (`plan.num_steps` > 1, `end_s` the
        steps' ends) records each of its steps."""
        if plan.num_steps > 1:
            self._stretch(len(plan.scheduled), end_s, num_batched_tokens, requests)
            return
        self._step(len(plan.scheduled), end_s, num_batched_tokens, requests)

    def _stretch(self, rows: int, ends, num_batched_tokens: int, requests: list[Request]) -> None:
        """A decode stretch's steps: in each but the last every request generated one token and
        none ended (`cbjax.scheduler.stretch`); the last is an ordinary step."""
        counts: dict[str, int] = {}  # client -> its requests, in order of first appearance
        for req in requests:
            counts[req.client_id] = counts.get(req.client_id, 0) + 1
        inner = len(ends) - 1
        first = len(self.end_s)
        self.end_s.extend(ends[:-1])
        self.batch.extend([rows] * inner)
        self.batched_tokens.extend([num_batched_tokens] * inner)
        served = list(counts.items())
        if len(served) == 1:  # most stretches serve one client
            client, n = served[0]
            self.events.extend([(it, client, 0, n) for it in range(first, first + inner)])
        else:
            self.events.extend([(it, client, 0, n) for it in range(first, first + inner) for client, n in served])
        generated = self._generated
        for req in requests:
            generated[req] = req.num_generated - 1
        self._step(rows, ends[-1], num_batched_tokens, requests)

    def _step(self, rows: int, end_s: float, num_batched_tokens: int, requests: list[Request]) -> None:
        it = len(self.end_s)
        self.end_s.append(end_s)
        self.batch.append(rows)
        self.batched_tokens.append(num_batched_tokens)
        prompt_done, generated = self._prompt_done, self._generated
        served: Optional[dict[str, list[int]]] = None  # client -> [prompt, generated], once a 2nd client serves
        first = None  # the first served client's (client, [prompt, generated]): most steps serve one
        for req in requests:
            prompt = req.prompt_len if req.num_computed > req.prompt_len else req.num_computed
            new_prompt = prompt - prompt_done.get(req, 0)
            new_tokens = req.num_generated - generated.get(req, 0)
            if req.status is _FINISHED:
                prompt_done.pop(req, None)
                generated.pop(req, None)
            else:
                if new_prompt > 0:
                    prompt_done[req] = prompt
                if new_tokens > 0:
                    generated[req] = req.num_generated
            if new_prompt > 0 or new_tokens > 0:
                client = req.client_id
                if first is None:
                    first = (client, [0, 0])
                    entry = first[1]
                elif served is None and client == first[0]:
                    entry = first[1]
                else:
                    if served is None:
                        served = {first[0]: first[1]}
                    entry = served.get(client)
                    if entry is None:
                        entry = served[client] = [0, 0]
                if new_prompt > 0:
                    entry[0] += new_prompt
                if new_tokens > 0:
                    entry[1] += new_tokens
        if served is not None:
            for client, (prompt, new) in served.items():
                self.events.append((it, client, prompt, new))
        elif first is not None:
            self.events.append((it, first[0], first[1][0], first[1][1]))

    def event_arrays(self) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
        """(end time f64[n], client per event, prompt tokens i64[n], generated tokens i64[n])."""
        ends = np.asarray(self.end_s, dtype=np.float64)
        its = np.asarray([e[0] for e in self.events], dtype=np.int64)
        times = ends[its] if its.size else np.zeros(0)
        clients = [e[1] for e in self.events]
        prompt = np.asarray([e[2] for e in self.events], dtype=np.int64)
        generated = np.asarray([e[3] for e in self.events], dtype=np.int64)
        return times, clients, prompt, generated


def client_ids(requests: list[Request]) -> list[str]:
    """Client ids in order of first arrival."""
    return list(dict.fromkeys(r.client_id for r in sorted(requests, key=lambda r: r.arrival_s)))


def client_service(
    log: ServiceLog, clients: list[str], metrics: MetricsConfig, start: float, end: float
) -> dict[str, float]:
    """Per client, weighted service from iterations ending in (start, end], per second."""
    w = metrics.service_weights
    totals = dict.fromkeys(clients, 0.0)
    end_s = log.end_s
    for it, name, p, g in log.events:  # Python numbers: a loop over numpy scalars is slower
        if start < end_s[it] <= end:
            totals[name] = totals.get(name, 0.0) + w.input * p + w.output * g
    span = end - start
    return {name: total / span if span > 0 else 0.0 for name, total in totals.items()}


def service_series(log: ServiceLog, clients: list[str], metrics: MetricsConfig, span_s: float) -> list[dict[str, Any]]:
    """Rows of client_service.csv: per bin (t_start, t_end] and client, tokens and service rate."""
    bin_s = metrics.series_bin_s or (span_s / 100 if span_s > 0 else 1.0)
    num_bins = max(1, int(np.ceil(span_s / bin_s - 1e-9)))
    sums: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    end_s = log.end_s
    for it, name, p, g in log.events:  # Python numbers: a loop over numpy scalars is slower
        k = min(num_bins - 1, max(0, math.ceil(end_s[it] / bin_s - 1e-9) - 1))  # t in (k*bin, (k+1)*bin]
        sums[(k, name)][0] += p
        sums[(k, name)][1] += g
    w = metrics.service_weights
    rows = []
    for k in range(num_bins):
        for name in clients:
            p, g = sums.get((k, name), (0, 0))
            service = w.input * p + w.output * g
            rows.append(
                {
                    "t_start_s": k * bin_s,
                    "t_end_s": (k + 1) * bin_s,
                    "client_id": name,
                    "prompt_tokens": p,
                    "output_tokens": g,
                    "service": service,
                    "service_per_s": service / bin_s,
                }
            )
    return rows


def write_service_series(out_dir: Path, rows: list[dict[str, Any]]) -> Path:
    path = out_dir / "client_service.csv"
    fields = ["t_start_s", "t_end_s", "client_id", "prompt_tokens", "output_tokens", "service", "service_per_s"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def window_fields(
    result: RunResult,
    log: ServiceLog,
    start: float,
    end: float,
    slo_ttft_s: Optional[float] = None,
    slo_tpot_s: Optional[float] = None,
) -> dict[str, Any]:
    """The summary fields the window restricts (rules in the module docstring)."""
    span = end - start
    arrived = [r for r in result.requests if start <= r.arrival_s < end]
    served = [r for r in arrived if r.finish_reason in SERVED]
    out: dict[str, Any] = {
        "window_s": [start, end],
        "num_requests": len(arrived),
        "num_finished": len(served),
        "num_rejected": sum(r.finish_reason is FinishReason.REJECTED for r in arrived),
        "num_aborted": sum(r.finish_reason is FinishReason.ABORTED for r in arrived),
        "num_not_arrived": sum(r.finish_reason is FinishReason.NOT_ARRIVED for r in arrived),
        "num_errors": sum(r.finish_reason is FinishReason.ERROR for r in arrived),
        "num_max_model_len": sum(r.finish_reason is FinishReason.MAX_MODEL_LEN for r in arrived),
    }
    lat = [request_latencies(r) for r in served]
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        _percentiles(key, [x[key] for x in lat if x[key] is not None], out)
    out["normalized_latency_s_per_token"] = normalized_latency(served, lat)
    submitted = [r for r in arrived if r.finish_reason is not FinishReason.NOT_ARRIVED]
    times, _, _, generated = log.event_arrays()
    out_tokens = int(generated[(times > start) & (times <= end)].sum())
    finishing = [r for r in result.requests if r.finish_reason in SERVED and start < r.finish_s <= end]
    ends = np.asarray(log.end_s, dtype=np.float64)
    inside = (ends > start) & (ends <= end)
    batch = np.asarray(log.batch)[inside]
    iters = int(inside.sum())
    out.update(
        {
            "output_tokens": out_tokens,
            "throughput_tok_s": out_tokens / span,
            "throughput_req_s": len(finishing) / span,
            "goodput_req_s": sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in finishing) / span,
            "slo_attainment": (
                sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in submitted) / len(submitted) if submitted else 0.0
            ),
            "iterations": iters,
            "mean_batch_size": float(batch.mean()) if iters else 0.0,
            "peak_batch_size": int(batch.max()) if iters else 0,
            "slot_utilization": float(batch.mean()) / result.num_slots if iters else 0.0,
            "mean_batched_tokens": float(np.asarray(log.batched_tokens)[inside].mean()) if iters else 0.0,
        }
    )
    return out


def service_summary(result: RunResult, log: ServiceLog, metrics: MetricsConfig, slo) -> dict[str, Any]:
    """client_service over the run (or the window), plus the window's fields when one is set."""
    clients = client_ids(result.requests)
    if metrics.window_s is None:
        return {"client_service": client_service(log, clients, metrics, 0.0, result.makespan_s)}
    start, end = metrics.window_s
    out = window_fields(result, log, start, end, slo.ttft_s, slo.tpot_s)
    out["client_service"] = client_service(log, clients, metrics, start, end)
    return out
