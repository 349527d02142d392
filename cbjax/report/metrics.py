"""Per-request latencies and per-run summary metrics, computed from a finished run."""

from __future__ import annotations

import math
from collections import Counter
from operator import attrgetter
from typing import Any, Optional

import numpy as np

from cbjax.core.results import RunResult
from cbjax.core.request import FinishReason, Request

PERCENTILES = (50, 90, 99)
KV_SHARES = (
    "kv_share_token_states",
    "kv_share_reserved",
    "kv_share_internal_frag",
    "kv_share_external_frag",
    "kv_share_free",
)
SERVED = (FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP, FinishReason.MAX_MODEL_LEN)
_FATE = attrgetter("finish_reason")


def request_latencies(req: Request) -> dict[str, Any]:
    """TTFT, TPOT, end-to-end latency and queueing delay in seconds (None where undefined)."""
    served = req.finish_reason in SERVED
    ttft = req.first_token_s - req.arrival_s if served and req.first_token_s is not None else None
    e2e = req.finish_s - req.arrival_s if served else None
    tpot = None
    if served and req.num_generated > 1:
        tpot = (req.finish_s - req.first_token_s) / (req.num_generated - 1)
    queue = req.scheduled_s - req.arrival_s if req.scheduled_s is not None else None
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "queue_s": queue}


def request_row(req: Request) -> dict[str, Any]:
    """One line of requests.jsonl."""
    row = {
        "request_id": req.request_id,
        "arrival_s": req.arrival_s,
        "prompt_len": req.prompt_len,
        "output_len": req.num_generated,
        "first_token_s": req.first_token_s,
        "finish_s": req.finish_s,
        "finish_reason": req.finish_reason.value if req.finish_reason else None,
        "reject_reason": req.reject_reason,
        "error": req.error,
        "original_request_id": req.original_request_id,
        "preemptions": req.num_preemptions,
        "target_output_len": req.target_output_len,
        "max_tokens": req.sampling.max_tokens,
        "priority": req.priority,
        "client_id": req.client_id,
        "scheduled_s": req.scheduled_s,
        "session_id": req.session_id,
        "turn": req.turn,
    }
    row.update(request_latencies(req))
    if req.prefix_hit_tokens_host is not None:  # a run with a host KV tier
        row["prefix_hit_tokens_device"] = req.prefix_hit_tokens_device
        row["prefix_hit_tokens_host"] = req.prefix_hit_tokens_host
        row["kv_load_s"] = req.kv_load_s
    if req.spec_steps is not None:  # the run speculated
        row["spec_proposed"] = req.spec_proposed
        row["spec_accepted"] = req.spec_accepted
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            row[key] = None  # JSON has no NaN
    return row


def _percentiles(prefix: str, values: list[float], out: dict[str, Any]) -> None:
    arr = np.asarray(values, dtype=np.float64)
    at = np.percentile(arr, PERCENTILES) if arr.size else [None] * len(PERCENTILES)  # one partition for all
    for p, value in zip(PERCENTILES, at):
        out[f"{prefix}_p{p}"] = None if value is None else float(value)
    out[f"{prefix}_mean"] = float(arr.mean()) if arr.size else None


def meets_slo(req: Request, ttft_s: Optional[float], tpot_s: Optional[float]) -> bool:
    """Served, with TTFT and TPOT within their targets (a one-token request has no TPOT; one
    served without a token, as a stream that stopped before any text, is held to the TTFT
    target by when its empty answer ended)."""
    return req.finish_reason in SERVED and _within_slo(request_latencies(req), ttft_s, tpot_s)


def _within_slo(lat: dict[str, Any], ttft_s: Optional[float], tpot_s: Optional[float]) -> bool:
    """A served request's latencies (`request_latencies`) within the targets."""
    if ttft_s is not None:
        first = lat["ttft_s"] if lat["ttft_s"] is not None else lat["e2e_s"]
        if first > ttft_s:
            return False
    return tpot_s is None or lat["tpot_s"] is None or lat["tpot_s"] <= tpot_s


def summarize(
    result: RunResult, window_iterations: int = 1000, slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None
) -> dict[str, Any]:
    """Flat run-level metrics for summary.json.

    Goodput counts requests meeting both SLOs per second of makespan; attainment is their
    share of all submitted requests (a rejected request misses; one that had not arrived when
    an interrupted run stopped was never submitted)."""
    reqs = result.requests
    stats = result.stats
    served = [r for r in reqs if r.finish_reason in SERVED]
    out_tokens = sum(r.num_generated for r in served)
    makespan = result.makespan_s
    iters = stats.iterations
    fates = Counter(map(_FATE, reqs))
    summary: dict[str, Any] = {
        "num_requests": len(reqs),
        "num_finished": len(served),
        "num_rejected": fates[FinishReason.REJECTED],
        "num_aborted": fates[FinishReason.ABORTED],
        "num_not_arrived": fates[FinishReason.NOT_ARRIVED],
        "num_errors": fates[FinishReason.ERROR],
        "num_max_model_len": fates[FinishReason.MAX_MODEL_LEN],
        "iterations": iters,
        "makespan_s": makespan,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
        "throughput_req_s": len(served) / makespan if makespan > 0 else 0.0,
    }
    lat = [request_latencies(r) for r in served]
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        _percentiles(key, [x[key] for x in lat if x[key] is not None], summary)
    # time between tokens: every gap between consecutive tokens of a request (a decode stalled
    # by a prefill or a preemption shows here; tpot averages it away)
    _percentiles("tbt_s", result.tbt_s, summary)
    summary.update(ttft_by_turn(reqs, served))
    good = sum(_within_slo(x, slo_ttft_s, slo_tpot_s) for x in lat)  # meets_slo: only served requests meet it
    submitted = len(reqs) - fates[FinishReason.NOT_ARRIVED]
    summary.update(
        {
            "num_slots": result.num_slots,
            "slot_utilization": stats.occupied_slot_iterations / (iters * result.num_slots) if iters else 0.0,
            "mean_batch_size": stats.occupied_slot_iterations / iters if iters else 0.0,
            "peak_batch_size": stats.batch_peak,
            "mean_batched_tokens": stats.batched_tokens / iters if iters else 0.0,
            "kv_pages_used_mean": stats.pages_used_sum / iters if iters else 0.0,
            "kv_pages_used_peak": stats.pages_used_peak,
            "kv_token_utilization": stats.kv_util_sum / iters if iters else 0.0,
            "preemptions": result.preemptions,
            "window_iterations": window_iterations,
            "finished_in_window": sum(1 for it in stats.finish_iteration.values() if it <= window_iterations),
            "goodput_req_s": good / makespan if makespan > 0 else 0.0,
            "slo_attainment": good / submitted if submitted else 0.0,
            "wall_s": result.wall_s,
            "scheduler_host_s": stats.schedule_s + stats.postprocess_s,
        }
    )
    summary.update(kv_shares(result))
    summary["normalized_latency_s_per_token"] = normalized_latency(served, lat)
    summary.update(result.extra)
    return summary


def ttft_by_turn(reqs: list[Request], served: list[Request]) -> dict[str, Any]:
    """TTFT of served requests by their turn in a session, when any request is a session's:
    `ttft_s_p50_by_turn`, `ttft_s_p99_by_turn` and `ttft_s_mean_by_turn`, lists indexed by
    turn (0 first), up to the last turn any request has, each entry None where no request of
    that turn was served; `served_by_turn` counts them. `prefill_tok_s_by_turn` is a turn's
    prefill throughput: its served requests' prompt tokens, the conversation so far included,
    over their summed TTFT (CachedAttention's prompt prefilling throughput, queueing included);
    `prefill_tok_s` the same over every turn. All None for a run without sessions."""
    keys = ("ttft_s_p50_by_turn", "ttft_s_p99_by_turn", "ttft_s_mean_by_turn", "served_by_turn")
    if not any(r.session_id is not None for r in reqs):
        return dict.fromkeys(keys + ("prefill_tok_s_by_turn", "prefill_tok_s"))
    by_turn: list[list[float]] = [[] for _ in range(max(r.turn for r in reqs) + 1)]
    prompt_tokens = [0] * len(by_turn)
    for r in served:
        ttft = request_latencies(r)["ttft_s"]
        if ttft is not None:
            by_turn[r.turn].append(ttft)
            prompt_tokens[r.turn] += r.prompt_len
    out: dict[str, Any] = {}
    for key, stat in zip(keys, (lambda a: np.percentile(a, 50), lambda a: np.percentile(a, 99), np.mean)):
        out[key] = [float(stat(np.asarray(v))) if v else None for v in by_turn]
    out["served_by_turn"] = [len(v) for v in by_turn]
    out["prefill_tok_s_by_turn"] = [n / sum(v) if v and sum(v) > 0 else None for n, v in zip(prompt_tokens, by_turn)]
    total_s = sum(sum(v) for v in by_turn)
    out["prefill_tok_s"] = sum(prompt_tokens) / total_s if total_s > 0 else None
    return out
def spec_summary(result: RunResult) -> dict[str, Any]:
    """summary.json's speculative-decoding fields, over every request of the run: drafts
    proposed and accepted, the acceptance rate (accepted over proposed), verifications (decode
    steps that verified a draft), the tokens a verification yields on average (its accepted
    drafts plus the target's own token: (1 - a^(k+1)) / (1 - a) for k drafts each accepted with
    probability a), and tokens generated per iteration."""
    proposed = accepted = verifications = steps = generated = 0
    for req in result.requests:
        generated += req.num_generated
        proposed += req.spec_proposed
        accepted += req.spec_accepted
        if req.spec_steps:
            steps += len(req.spec_steps)
            verifications += sum(1 for p, _ in req.spec_steps if p)
    iters = result.stats.iterations
    return {
        "spec_proposed_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed else None,
        "spec_verifications": verifications,
        "spec_decode_steps": steps,
        "spec_mean_accepted_per_step": (accepted + verifications) / verifications if verifications else None,
        "tokens_per_iteration": generated / iters if iters else 0.0,
    }


def kv_shares(result: RunResult) -> dict[str, float]:
    """Shares of the whole KV pool (usable pages x page_size slots), each averaged over
    iterations, as `PageAllocator.slot_breakdown` defines them; they sum to 1. A run of no
    iterations had its whole pool free."""
    iters = result.stats.iterations
    if not iters:
        return {key: float(key == "kv_share_free") for key in KV_SHARES}
    return {key: total / iters for key, total in zip(KV_SHARES, result.stats.kv_share_sums)}


def normalized_latency(served: list[Request], lat: Optional[list[dict[str, Any]]] = None) -> Optional[float]:
    """Mean over served requests of end-to-end latency / output length (Orca's and vLLM's
    normalized latency, s/token); None when nothing was served. `lat`: their `request_latencies`."""
    lat = [request_latencies(r) for r in served] if lat is None else lat
    values = [x["e2e_s"] / r.num_generated for r, x in zip(served, lat) if r.num_generated]
    return float(np.mean(values)) if values else None
