"""Time the engine inside its own serving loop: each iteration's `execute` as the loop calls it,
and the loop's host time around it (scheduling, postprocess, stats), as `cbjax.run.run_single`
serves. The grid times steps back to back on fixed batches; these iterations are what a run
pays, and the profile's step terms are fitted on them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from typing import Any, Optional

import numpy as np

from cbjax.config import LengthConfig, RunConfig, WorkloadConfig
from cbjax.plan import Schedule, StepOutput
from cbjax.request import Request
from cbjax.profile.residuals import MIN_STEPS, regime_of
from cbjax.layout.shapes import ShapePlan
from cbjax.sim.fit import WEIGHTINGS, fit_costs, nnls
from cbjax.sim.profiled import (
    COLD_TERMS, LAUNCH_TERMS, STEP_TERMS, bucket_intercept, step_features, step_terms, steps_since_larger,
)  # fmt: skip

# A bucket gets its own served intercept (`served_bucket_s`) from this many served iterations on.
MIN_SERVED = MIN_STEPS
# Poisson runs at these shares of the saturated request rate: light, medium and heavy load.
POISSON_SHARES = (0.3, 0.6, 0.9)
# Round r of the served workloads draws with seeds offset by this times r (`serving_runs`).
ROUND_SEED_STRIDE = 1000
# A pipelined collect that waited less than this found its step done: the copy and bookkeeping
# alone, so the loop's host time, not the step, set the step's share (`censored`).
COLLECT_FLOOR_S = 50e-6
# Host times over this multiple of what their plan explains are stalls (a garbage collection, the
# VM held back), not the loop's work: `fit_launch` leaves them out, as one would swamp a least-squares fit.
HOST_STALL = 5.0


class TimedExecutor:
    """Passes each iteration to `inner` and records its rows and clock: `rows_at` (before the
    recorder's own bookkeeping), `start`/`end` (around `inner.execute`; when `inner` is
    pipelined, at `launch` and after `collect`), `launched` (when `inner.launch` returned: its
    host part, packing the rows and dispatching, is over), and `idle`: whether the loop idled
    waiting for an arrival before it (it turned more than once: `tick`)."""

    virtual_clock = False

    def __init__(self, inner):
        self.inner = inner
        self.pipelined = inner.pipelined
        self.reads_token_ids = inner.reads_token_ids
        self.rows: list[list[tuple[int, int, bool]]] = []
        self.num_scheduled: list[int] = []
        self.rows_at: list[float] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.launched: list[float] = []
        self.idle: list[bool] = []
        self.idle_s: list[float] = []  # from the previous iteration's end to this one's rows (0 for the first)
        self._turns = 0

    def tick(self) -> None:
        """Called by the loop on every turn (`cbjax.engine.serve`'s `tick`)."""
        self._turns += 1

    def validate(self, req: Request) -> Optional[str]:
        return self.inner.validate(req)

    def warmup(self) -> None:
        """The engine is warm already: the profile warmed it before the grid."""

    def execute(self, plan: Schedule) -> StepOutput:
        return self.collect(self.launch(plan))

    def launch(self, plan: Schedule):
        self.rows_at.append(time.perf_counter())
        self.idle.append(self._turns > 1)
        self.idle_s.append(self.rows_at[-1] - self.end[-1] if self.end else 0.0)
        self._turns = 0
        self.rows.append(plan.cost_rows())
        self.num_scheduled.append(plan.num_scheduled)
        self.start.append(time.perf_counter())
        launched = self.inner.launch(plan)
        self.launched.append(time.perf_counter())
        return launched

    def collect(self, launched) -> StepOutput:
        out = self.inner.collect(launched)
        self.end.append(time.perf_counter())
        return out

    def metrics(self) -> dict:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()


def serving_runs(
    cfg: RunConfig, saturated_req_s: Optional[float] = None, round_: int = 0
) -> list[tuple[str, RunConfig]]:
    """The profile's own served workloads (apart from experiments/calibrate.py's), uniform prompts
    up to a quarter of max_model_len and uniform outputs up to an eighth, under fcfs: 3 x slots
    requests at t=0 with chunked prefill (mixed steps) and without (whole prompts), and a static
    batch (the burst regime); given the engine's saturated request rate, also 2 x slots Poisson
    arrivals at 30%, 60% and 90% of it (the light, medium and heavy regimes, few rows at a time
    as open-loop runs have: `cbjax.profile.residuals.regime_of`). Each round `round_` draws its
    own requests and arrivals (seeds offset by ROUND_SEED_STRIDE x round): a round held out of
    the fit is then other requests, not a re-timing of the same ones."""
    seed = cfg.seed + ROUND_SEED_STRIDE * round_
    length = cfg.model.max_model_len
    slots = cfg.scheduler.max_num_seqs
    wl = WorkloadConfig(
        num_requests=3 * slots, vocab_size=cfg.model.vocab_size,
        prompt_len=LengthConfig(dist="uniform", low=min(8, length // 2), high=max(8, length // 2)),
        output_len=LengthConfig(dist="uniform", low=min(8, length // 2), high=max(8, length // 8)),
    )  # fmt: skip
    runs = []
    for i, chunked in enumerate((True, False)):
        sched = dataclasses.replace(cfg.scheduler, name="fcfs", chunked_prefill=chunked, static_padding=False)
        runs.append(
            (
                f"fcfs_chunked_{'on' if chunked else 'off'}",
                dataclasses.replace(cfg, scheduler=sched, workload=wl, seed=seed + 101 + i),
            )
        )
    # static batches: whole prompts together, then decodes thinning out as the batch's requests end
    sched = dataclasses.replace(cfg.scheduler, name="static", chunked_prefill=False, static_padding=False)
    runs.append(("static", dataclasses.replace(cfg, scheduler=sched, workload=wl, seed=seed + 103)))
    if saturated_req_s:
        sched = dataclasses.replace(cfg.scheduler, name="fcfs", chunked_prefill=True, static_padding=False)
        for i, share in enumerate(POISSON_SHARES):
            light = dataclasses.replace(wl, num_requests=2 * slots, arrival="poisson", rate=share * saturated_req_s)
            runs.append(
                (
                    f"fcfs_poisson_{round(100 * share)}pct",
                    dataclasses.replace(cfg, scheduler=sched, workload=light, seed=seed + 201 + i),
                )
            )
    return runs


def serve_timed(executor, cfg: RunConfig) -> TimedExecutor:
    """Serve `cfg`'s workload on the warm `executor` with the loop `run_single` runs (its
    service log included); returns the recorder."""
    from cbjax.engine import serve
    from cbjax.scheduler import Scheduler
    from cbjax.service import ServiceLog
    from cbjax.workload import build_workload

    timed = TimedExecutor(executor)
    scheduler = Scheduler(
        cfg.scheduler, cfg.cache, cfg.model.max_model_len, validate=timed.validate,
        eos_token_id=cfg.model.eos_token_id, vocab_size=cfg.model.vocab_size,
    )  # fmt: skip
    serve(build_workload(cfg.workload, cfg.seed), scheduler, timed, on_step=ServiceLog().on_step, tick=timed.tick)
    return timed


def served_points(
    label: str, timed: TimedExecutor, shapes: ShapePlan, native: bool = False
) -> tuple[list[dict], list[tuple[int, float]]]:
    """(steps, gaps): per iteration its features, the seconds `execute` took as the loop called
    it, and whether the loop idled before it; per iteration but the last whose next one the
    loop went to straight away, (its rows, the loop's host seconds until that `execute`, the
    recorder's own bookkeeping excluded).

    Pipelined serving overlaps the loop's host work with the step in flight: an iteration's
    seconds are then its share of the wall clock, from its launch or the previous step's end
    (whichever is later) to its own end, and there are no gaps. The loop collects a step only
    after it has committed the previous one and planned and launched the next, so a step's share
    is the longer of its device time and that host time. Where the step was launched while its
    predecessor was in flight and the next one while it was, the point records the host time
    (`host_s`, from its share's start to the next launch's return), the next plan's rows,
    prefill rows and tokens (`next_rows`, `next_prefill_rows`, `next_tokens`: `fit_launch`'s
    features) and how long the collect then waited (`collect_wait_s`: about nothing when the
    host time set the share, `censored`)."""
    steps = []
    recent: deque[int] = deque(maxlen=len(COLD_TERMS))  # the previous iterations' buckets, latest first
    starts = timed.start
    if timed.pipelined:
        starts = [max(t0, prev) for t0, prev in zip(timed.start, [float("-inf")] + timed.end[:-1])]
    for rows, t0, t1, idle, idle_s in zip(timed.rows, starts, timed.end, timed.idle, timed.idle_s):
        bucket, features = step_features(rows, shapes, native)
        kind = "decode" if all(n == 1 for n, _, _ in rows) else "prefill" if all(n > 1 for n, _, _ in rows) else "mixed"
        steps.append({
            "kind": kind, "source": label, "regime": regime_of(label), "rows": len(rows),
            "prefill_rows": sum(1 for _, _, decode in rows if not decode), "tokens": sum(n for n, _, _ in rows),
            "bucket": bucket, "features": features, "measured_s": t1 - t0, "idle": idle,
            "idle_s": max(0.0, idle_s) if idle else 0.0,
            "since_larger": steps_since_larger(recent, bucket),
        })  # fmt: skip
        recent.appendleft(bucket)
    # pipelined, step i launched while step i-1 was in flight (its share starts at i-1's end) and
    # step i+1 while step i was: the loop's host time in between set step i's share or hid behind it
    for i in range(1, len(steps) - 1):
        if timed.start[i] < timed.end[i - 1] and timed.start[i + 1] < timed.end[i] and len(timed.launched) > i + 1:
            nxt = steps[i + 1]
            steps[i].update({
                "next_rows": nxt["rows"], "next_prefill_rows": nxt["prefill_rows"], "next_tokens": nxt["tokens"],
                "host_s": timed.launched[i + 1] - starts[i], "collect_wait_s": timed.end[i] - timed.launched[i + 1],
            })  # fmt: skip
    gaps = [
        (n, nxt - end)
        for n, end, nxt, idle in zip(timed.num_scheduled, timed.end, timed.rows_at[1:], timed.idle[1:])
        if not idle and not timed.pipelined
    ]
    return steps, gaps


def fit_loop(gaps: list[tuple[int, float]]) -> dict[str, float]:
    """loop_s + loop_seq_s * rows, the loop's host seconds after an iteration of `rows`
    scheduled requests (postprocess, stats, the next schedule): non-negative least squares on
    absolute error, so the fit keeps the mean a run's wall clock adds up."""
    if not gaps:
        return {"loop_s": 0.0, "loop_seq_s": 0.0}
    a = np.array([[1.0, float(n)] for n, _ in gaps])
    y = np.array([g for _, g in gaps])
    scale = a.max(axis=0)
    coef = nnls(a / scale, y) / scale
    return {"loop_s": float(coef[0]), "loop_seq_s": float(coef[1])}


# Step terms `fit_served` can refit on the served steps (`served_terms`): per row and per KV page.
SERVED_STEP_TERMS = ("seq_s", "single_page_s", "block_page_s")
# How `fit_served` weighs the served steps: `cbjax.sim.fit.WEIGHTINGS`, or "balanced", the mean
# of the "absolute" and "mean_relative" fits' coefficients.
SERVED_WEIGHTINGS = WEIGHTINGS + ("balanced",)


def fit_served(
    served: list[dict],
    bucket_s: dict[int, float],
    grid_model: dict[str, float],
    fit_cold: bool = False,
    served_terms: bool = False,
    weighting: str = "absolute",
) -> dict[str, Any]:
    """`served_bucket_s`, `bucket_scale` and the COLD_TERMS, fitted on the served iterations
    (those after an idle loop left out: `wake_s` charges them) over the step terms of the
    `grid_model` (STEP_TERMS: the per-row, per-chunk and per-page costs, which the grid measures
    over wide ranges of rows, contexts and prompts that served runs hardly span).

    Each bucket with at least MIN_SERVED served iterations gets its own served fixed cost
    (`served_bucket_s`): a bucket's program costs more between the loop's host work than back to
    back, and not by one factor for all (small decodes about the same, mixed steps a quarter
    more). The served steps of rarer buckets share one scale of the grid's timed bucket costs
    (`bucket_scale`; with none, the served buckets' mean ratio to the grid's timing).

    With `fit_cold` the COLD_TERMS are fitted too: what a served step pays more 1 .. 4 steps after
    the last step of a larger bucket (grid steps run after themselves; a small step right after
    a large one runs slower, its caches cold). Fitted over pooled intercepts alone, they also
    took in whatever else makes a static batch's decodes fast (its cold steps are in the fcfs
    runs, its warm ones in the static run: docs/CALIBRATION.md, History); with `served_terms`
    a thinning static batch is charged by its rows instead, which is why the profile fits both
    by default. Off, they stay 0.

    With `served_terms` the SERVED_STEP_TERMS (per row, per page read) are fitted on the served
    steps too, beside the intercepts, instead of taken from the grid: a sparse light-load batch
    and a full burst then share one per-row cost fitted where runs have them, not one
    intercept per bucket pooled over both (issue 35). They are returned under their names.

    A pipelined step whose share the loop's host time set (`censored`) while the next plan held
    a prefill is left out: its share is that launch's host time, which `fit_launch` fits and
    the simulator charges as the longer of the two (`cbjax.engine.EngineLoop._launch_virtual`);
    fitted here too, it would raise every step of its bucket. A censored step before a decode
    stays in: its share is the loop's steady host time, what the engine's step costs when the
    host is the slower side.

    Non-negative least squares, weighted by `weighting` (SERVED_WEIGHTINGS). "absolute" fits the
    summed time, as a run's makespan adds the steps up (thousands of small decode steps and a few
    large prefills weigh what they cost); "mean_relative" makes each bucket's mean signed relative
    error zero, the figure the profile's residual table judges (`cbjax.profile.residuals`). Where
    the step times spread with a long tail (a slow step now and then), the two part: the first
    leaves the mean relative error positive by about the tail's weight, the second the summed
    time short by as much. "balanced" (the profile's default) takes the mean of their
    coefficients, so each criterion is off by about half of it. Steps marked `held_out` are left
    out (the residual table's). None served: no served intercepts, scale 1, no cold terms."""
    points = [
        s for s in served
        if not s.get("idle") and not s.get("held_out") and not (censored(s) and s.get("next_prefill_rows", 0))
    ]  # fmt: skip
    if not points:
        return {"served_bucket_s": {}, "bucket_scale": 1.0, **dict.fromkeys(COLD_TERMS, 0.0)}
    counts = Counter(s["bucket"] for s in points)
    own = sorted(b for b, n in counts.items() if n >= MIN_SERVED)  # buckets with a served intercept
    refit = SERVED_STEP_TERMS if served_terms else ()
    idx = [STEP_TERMS.index(k) for k in refit]
    base = len(own) + 1 + len(COLD_TERMS)
    x = np.zeros((len(points), base + len(refit)))  # own intercepts, bucket_scale, cold terms, refitted terms
    for i, s in enumerate(points):
        for j, k in enumerate(idx):
            x[i, base + j] = s["features"][k]
        if s["bucket"] in own:
            x[i, own.index(s["bucket"])] = 1.0
        else:
            x[i, len(own)] = bucket_intercept(bucket_s, s["bucket"])
        if fit_cold and s.get("since_larger", 0):
            x[i, len(own) + s["since_larger"]] = 1.0
    kept = {**grid_model, **dict.fromkeys(refit, 0.0)}  # the grid's terms but those refitted here
    terms = np.array([step_terms(kept, s["features"]) for s in points])
    y = np.array([s["measured_s"] for s in points])
    used = np.any(x != 0, axis=0)
    coef = np.zeros(x.shape[1])
    if weighting not in SERVED_WEIGHTINGS:
        raise ValueError(f"served_weighting: unknown value {weighting!r}; choose one of {', '.join(SERVED_WEIGHTINGS)}")
    if weighting == "balanced":  # halfway between the two criteria (see above)
        coef[used] = sum(fit_costs(x[:, used], y, offsets=terms, weighting=w) for w in ("absolute", "mean_relative")) / 2
    else:
        coef[used] = fit_costs(x[:, used], y, offsets=terms, weighting=weighting)
    served_fixed = {b: float(c) for b, c in zip(own, coef)}
    scale = float(coef[len(own)])
    if not used[len(own)]:  # every served step has its bucket's own intercept
        scale = float(np.mean([served_fixed[b] / bucket_intercept(bucket_s, b) for b in own]))
    out: dict[str, Any] = {"served_bucket_s": {str(b): v for b, v in served_fixed.items()}, "bucket_scale": scale}
    out.update({k: float(c) for k, c in zip(COLD_TERMS, coef[len(own) + 1 : base])})
    out.update({k: float(c) for k, c in zip(refit, coef[base:])})
    return out


def censored(point: dict) -> bool:
    """Whether a served step's collect found it done (`COLLECT_FLOOR_S`): its share of the wall
    clock is then the loop's host time, its own time only bounded by it. Steps without a
    recorded collect (one step at a time, or profiles made before it) are not."""
    return point.get("collect_wait_s", float("inf")) < COLLECT_FLOOR_S


def launch_features(rows: int, prefill_rows: int, tokens: int) -> list[float]:
    """The LAUNCH_TERMS' multipliers for a launched plan (`cbjax.sim.profiled.launch_cost`)."""
    return [1.0, float(rows), float(prefill_rows > 0), float(prefill_rows), float(tokens)]


def fit_launch(served: list[dict], weighting: str = "absolute") -> dict[str, float]:
    """The LAUNCH_TERMS, fitted on the served steps that recorded the loop's host time before
    their collect (`host_s`, `served_points`), over the plan launched in it (`launch_features`). Non-negative least squares weighted by `weighting` (as `fit_served`);
    steps held out, after an idle loop, or with a stall (HOST_STALL) are left out. None: all 0."""
    if weighting not in SERVED_WEIGHTINGS:
        raise ValueError(f"served_weighting: unknown value {weighting!r}; choose one of {', '.join(SERVED_WEIGHTINGS)}")
    points = [s for s in served if s.get("host_s", 0.0) > 0 and not s.get("idle") and not s.get("held_out")]
    if not points:
        return dict.fromkeys(LAUNCH_TERMS, 0.0)
    x = np.array([launch_features(s["next_rows"], s["next_prefill_rows"], s["next_tokens"]) for s in points])
    y = np.array([s["host_s"] for s in points])
    ways = ("absolute", "mean_relative") if weighting == "balanced" else (weighting,)

    def fit(keep: np.ndarray) -> np.ndarray:
        coef = np.zeros(x.shape[1])
        used = np.any(x[keep] != 0, axis=0)
        coef[used] = sum(fit_costs(x[keep][:, used], y[keep], weighting=w) for w in ways) / len(ways)
        return coef

    # fit on all, then twice on the steps within HOST_STALL of the last fit's prediction: a stall
    # is far above what its plan explains (a prefill's launch is not, though far above the median)
    coef = fit(np.ones(len(y), bool))
    for _ in range(2):
        coef = fit(y <= HOST_STALL * np.maximum(x @ coef, 1e-12))
    return {k: float(c) for k, c in zip(LAUNCH_TERMS, coef)}


def held_out_round(r: int, rounds: int) -> bool:
    """Whether served round `r` of `rounds` is held out of the fit, its steps kept for the residual
    table (`cbjax.profile.residuals`): the odd rounds, when there are at least two (one round:
    none is held out, and the table is in-sample)."""
    return rounds >= 2 and r % 2 == 1


def measure_serving(
    executor, cfg: RunConfig, shapes: ShapePlan, rounds: int = 1, native: bool = False
) -> dict[str, Any]:
    """Serve the profile's workloads (`serving_runs`) on the warm engine, `rounds` times over: the
    bursts first, then the Poisson runs at shares of the first burst's request rate (set in the
    first round). Returns the served steps for the fit, loop gaps for `fit_loop`, and per run
    its round, iterations, makespan and time in execute. `native`: the engine's attention is
    `native` (its features, see `cbjax.sim.profiled.step_features`)."""
    steps, gaps, runs = [], [], []
    saturated: Optional[float] = None
    for r in range(rounds):
        todo = serving_runs(cfg, saturated, r)
        i = 0
        while i < len(todo):  # the list grows by the Poisson runs after the first burst
            label, run_cfg = todo[i]
            i += 1
            t0 = time.perf_counter()
            timed = serve_timed(executor, run_cfg)
            s, g = served_points(label, timed, shapes, native)
            for x in s:
                x["round"] = r
                x["held_out"] = held_out_round(r, rounds)
            steps += s
            gaps += g
            makespan = timed.end[-1] - timed.start[0] if s else 0.0
            runs.append({
                "run": label, "round": r, "iterations": len(s), "makespan_s": makespan,
                "execute_s": float(sum(x["measured_s"] for x in s)), "loop_s": float(sum(x for _, x in g)),
                "wall_s": time.perf_counter() - t0,
            })  # fmt: skip
            if len(runs) == 1 and makespan > 0:  # the same bursts first, then the Poisson runs
                saturated = run_cfg.workload.num_requests / makespan
                todo = serving_runs(cfg, saturated, r)
    return {"steps": steps, "gaps": gaps, "runs": runs}


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
                hot = execute(plan).duration_s
                t0 = time.perf_counter()
                time.sleep(idle)
                execute(plan)
                extra[idle].append(time.perf_counter() - t0 - idle - hot)
    short, long = (max(0.0, float(np.median(extra[i]))) for i in idles)
    ramp = idles[1] if short <= 0 else min(idles[1], max(idles[0], idles[0] * long / short))
    return {"wake_s": long, "wake_ramp_s": ramp, "by_idle_s": {str(i): float(np.median(extra[i])) for i in idles}}
