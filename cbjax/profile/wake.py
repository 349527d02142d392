"""The loop's wake timed where a run pays for it, and the wake terms fitted on it (no jax at import).

A request that arrives at an idle loop waits, before its first token, for more than its step:
the loop's sleep overshoots the arrival, its plan and launch run with nothing in flight to hide
them, and on a CPU the threads and caches the step uses have gone cold. `measure_wake` times the
executor's own share of that (a step after a sleep against the same step hot); the serving loop
adds the rest. `measure_served_wake` serves lone requests on the warm engine, each arriving
after the loop idled a set time, and records each one's TTFT (the profile does so once in each
of its serving rounds, so that they meet the machine's speeds the served fit meets); `fit_served_wake` fits `wake_s`,
`wake_token_s` and `wake_ramp_s` (`cbjax.sim.profiled.wake_cost`) on what those TTFTs hold beyond the
simulator's, serving the same requests with no wake.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import numpy as np

from cbjax.core.plan import Schedule
from cbjax.core.request import Request
from cbjax.layout.shapes import ShapePlan
from cbjax.profile.fit import nnls
from cbjax.sim.profiled import ProfiledCost, model_coefficients

# the idle times the lone requests arrive after (seconds): short ones trace the wake's ramp
IDLES_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
# prompt lengths per idle time, as fractions of the step's token budget (at least 8 tokens)
PROMPT_SHARES = (0.05, 0.25, 0.5, 1.0)
REPEATS = 1  # per serving round: the profile serves them once a round (`merge_wake`)
# each lone request's tokens: its first comes from a step the next one (a decode) is launched
# behind, as a served request's does
OUTPUT_TOKENS = 2
# the ramps the fit tries: this many quantiles of the measured idle times
RAMP_CANDIDATES = 32
# the idle before each request of the first pass, which times each lone step's TTFT
FIRST_PASS_IDLE_S = 0.02
# lone requests the fit needs; with fewer, the wake timed on the executor alone stays
MIN_WAKE_REQUESTS = 12


def wake_prompts(cfg) -> list[int]:
    """The lone requests' prompt lengths: PROMPT_SHARES of the step's token budget or a quarter
    of a context, whichever is less (what a request arriving alone brings in the runs the
    simulator is judged on; a context's single long prefill is the step model's to price),
    each once per idle time and repeat."""
    budget = min(cfg.scheduler.max_num_batched_tokens, cfg.model.max_model_len // 4)
    lengths = [max(8, min(budget, int(budget * share))) for share in PROMPT_SHARES]
    return [n for _ in range(REPEATS) for _ in IDLES_S for n in lengths]


def lone_requests(lengths: list[int], arrivals: list[float], vocab_size: int, seed: int) -> list[Request]:
    """Requests of `lengths` prompt tokens arriving at `arrivals`, each generating OUTPUT_TOKENS."""
    return [
        Request(request_id=f"wake{i}", arrival_s=t, prompt_len=n, target_output_len=OUTPUT_TOKENS,
                synthetic_prompt=(seed + i, vocab_size))
        for i, (n, t) in enumerate(zip(lengths, arrivals))
    ]  # fmt: skip


def lone_config(cfg):
    """`cfg` as lone requests are served: the prefix cache and the host tier off."""
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False, host_pages=0))


def serve_first_pass(executor, run_cfg, lengths: list[int], seed: int) -> list[Request]:
    """Lone requests of `lengths` prompt tokens arriving FIRST_PASS_IDLE_S apart, served by
    `executor` under `run_cfg` (`lone_config`'s); returns them, served."""
    from cbjax.engine.offline import serve
    from cbjax.sim.pricing import build_scheduler

    requests = lone_requests(lengths, list(np.arange(1, len(lengths) + 1) * FIRST_PASS_IDLE_S), run_cfg.model.vocab_size, seed)
    serve(requests, build_scheduler(run_cfg, executor), executor)
    return requests


def measure_served_wake(executor, cfg, round_: int = 0) -> dict[str, Any]:
    """Lone requests served by the warm engine `executor` under `cfg`'s scheduler, the prefix
    cache and host tier off: a first pass with FIRST_PASS_IDLE_S between them times each one,
    a second makes each arrive IDLES_S after the one before it ended. {"settings": what the
    simulator needs to serve them again, "requests": per request of both passes its `pass`
    (2 * `round_` and the next), `prompt_len`, `arrival_s`, `ttft_s` and `idle_s` (its arrival
    less the previous request's end; None where that one had not ended)}. Each round draws its
    own prompts."""
    from cbjax.engine.offline import serve
    from cbjax.sim.pricing import build_scheduler

    run_cfg = lone_config(cfg)
    lengths = wake_prompts(run_cfg)
    vocab = run_cfg.model.vocab_size
    seed = cfg.seed + 2 * len(lengths) * round_
    first = serve_first_pass(executor, run_cfg, lengths, seed)
    took = [r.finish_s - r.arrival_s if r.finish_s is not None else FIRST_PASS_IDLE_S for r in first]
    idles = [IDLES_S[(i // len(PROMPT_SHARES)) % len(IDLES_S)] for i in range(len(lengths))]
    arrivals = list(np.cumsum([idles[0]] + [t + idle for t, idle in zip(took[:-1], idles[1:])]))
    second = lone_requests(lengths, arrivals, vocab, seed + len(lengths))
    serve(second, build_scheduler(run_cfg, executor), executor)
    rows = []
    for k, run in enumerate((first, second)):
        end: Optional[float] = 0.0
        for r in run:
            idle = r.arrival_s - end if end is not None and r.arrival_s > end else None
            end = r.finish_s
            ttft = r.first_token_s - r.arrival_s if r.first_token_s is not None else None
            rows.append({"pass": 2 * round_ + k, "prompt_len": r.prompt_len, "arrival_s": float(r.arrival_s), "ttft_s": ttft,
                         "idle_s": idle})  # fmt: skip
    sched = run_cfg.scheduler
    settings = {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_model_len": run_cfg.model.max_model_len, "pipelined": bool(executor.pipelined)}  # fmt: skip
    return {"settings": settings, "requests": rows}


def merge_wake(records: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """One record of several rounds' `measure_served_wake` records (None for none)."""
    if not records:
        return None
    return {"settings": records[0]["settings"], "requests": [r for rec in records for r in rec["requests"]]}


def lone_predictions(record: dict[str, Any], coefficients: dict, shapes: ShapePlan, native: bool) -> list[Optional[float]]:
    """Each request's TTFT in `record` (`measure_served_wake`'s) as the simulator serves it with
    no wake: each pass's requests at their arrivals, the steps priced by `ProfiledCost` under
    `coefficients` on the simulator's own loop and timeline."""
    from cbjax.config import CacheConfig, SchedulerConfig
    from cbjax.engine.offline import serve
    from cbjax.scheduler.core import Scheduler
    from cbjax.sim.executor import SimExecutor

    settings, rows = record["settings"], record["requests"]
    cost = ProfiledCost({**model_coefficients(coefficients), "wake_s": 0.0, "wake_token_s": 0.0}, shapes, native)
    out: list[Optional[float]] = []
    for k in sorted({r["pass"] for r in rows}):
        mine = [r for r in rows if r["pass"] == k]
        requests = lone_requests([r["prompt_len"] for r in mine], [r["arrival_s"] for r in mine], 1 << 15, 0)
        pages = sum(-(-(r["prompt_len"] + OUTPUT_TOKENS) // shapes.page_size) for r in mine) + 1
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=settings["max_num_seqs"], max_num_batched_tokens=settings["max_num_batched_tokens"]),
            CacheConfig(page_size=shapes.page_size, num_pages=pages, prefix_caching=False), settings["max_model_len"],
        )  # fmt: skip
        serve(requests, scheduler, SimExecutor(cost, pipelined=settings["pipelined"]))
        out += [r.first_token_s - r.arrival_s if r.first_token_s is not None else None for r in requests]
    return out


def l1_nonnegative(x: np.ndarray, y: np.ndarray, rounds: int = 20) -> np.ndarray:
    """Non-negative c minimising sum |y - x @ c| (least squares reweighted by 1 / |residual|):
    the median's fit, which an odd stalled request does not move."""
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0] = 1.0
    w = np.ones(len(y))
    floor = max(1e-9, float(np.median(np.abs(y))) * 1e-3)
    for _ in range(rounds):
        c = nnls(x / scale * w[:, None], y * w) / scale
        w = 1.0 / np.sqrt(np.maximum(np.abs(y - x @ c), floor))
    return c


def fit_wake(idle_s: list[float], tokens: list[int], extra_s: list[float]) -> dict[str, float]:
    """`wake_s`, `wake_token_s` and `wake_ramp_s` of `(wake_s + wake_token_s * tokens) *
    min(1, idle / wake_ramp_s)` over the (idle, step tokens, extra seconds) triples: per ramp
    among RAMP_CANDIDATES quantiles of the idles, the two levels non-negative on absolute error
    (`l1_nonnegative`); the ramp whose fit errs least."""
    idle = np.asarray(idle_s, float)
    n = np.asarray(tokens, float)
    extra = np.asarray(extra_s, float)
    best = None
    for ramp in np.unique(np.quantile(idle, np.linspace(0.0, 1.0, RAMP_CANDIDATES))):
        share = np.minimum(1.0, idle / max(ramp, 1e-9))
        features = np.stack([share, share * n], axis=1)
        level = l1_nonnegative(features, extra)
        loss = float(np.abs(extra - features @ level).sum())
        if best is None or loss < best[0]:
            best = (loss, level, float(ramp))
    _, level, ramp = best
    return {"wake_s": float(level[0]), "wake_token_s": float(level[1]), "wake_ramp_s": ramp}


def fit_served_wake(
    record: Optional[dict[str, Any]], coefficients: dict, shapes: Optional[ShapePlan], native: bool = False
) -> dict[str, float]:
    """`wake_s`, `wake_token_s` and `wake_ramp_s` fitted on what the lone requests' TTFT in `record`
    (`measure_served_wake`'s) holds beyond the simulator's with no wake (`lone_predictions`),
    against each one's idle time; each request's `predicted_s` and `wake_extra_s` are written
    into it. Empty with fewer than MIN_WAKE_REQUESTS requests that arrived at an idle loop, or no
    shape plan: the wake timed on the executor alone stays."""
    rows = (record or {}).get("requests") or []
    if sum(1 for r in rows if r["idle_s"] is not None and r["ttft_s"] is not None) < MIN_WAKE_REQUESTS or shapes is None:
        return {}
    for r, pred in zip(rows, lone_predictions(record, coefficients, shapes, native)):
        r["predicted_s"] = pred
        ok = r["idle_s"] is not None and r["ttft_s"] is not None and pred is not None
        r["wake_extra_s"] = float(r["ttft_s"] - pred) if ok else None
    lone = [r for r in rows if r["wake_extra_s"] is not None]
    return fit_wake([r["idle_s"] for r in lone], [r["prompt_len"] for r in lone], [r["wake_extra_s"] for r in lone])


def measure_wake(
    execute, plans: list[Schedule], repeats: int, idles: tuple[float, float] = (0.001, 0.02)
) -> dict[str, Any]:
    """What the first step after the loop idled costs over the same step run hot (XLA's CPU
    threads and caches go cold, and the loop's sleep overshoots): per idle length, the median
    over `plans` x `repeats` of (sleep + step wall) - idle - the step hot. `wake_s` is the
    long idle's; `wake_ramp_s` the idle at which it is reached, from the short idle's share of it."""
    extra: dict[float, list[float]] = {idle: [] for idle in idles}
    for _ in range(repeats):
        for idle in idles:
            for plan in plans:
                execute(plan)
                t0 = time.perf_counter()
                execute(plan)
                hot = time.perf_counter() - t0
                t0 = time.perf_counter()
                time.sleep(idle)
                execute(plan)
                extra[idle].append(time.perf_counter() - t0 - idle - hot)
    short, long = (max(0.0, float(np.median(extra[i]))) for i in idles)
    ramp = idles[1] if short <= 0 else min(idles[1], max(idles[0], idles[0] * long / short))
    return {"wake_s": long, "wake_ramp_s": ramp, "by_idle_s": {str(i): float(np.median(extra[i])) for i in idles}}
