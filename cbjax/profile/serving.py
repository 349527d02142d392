"""Time the engine inside its own serving loop: each iteration's `execute` as the loop calls it,
and the loop's host time around it (scheduling, postprocess, stats), as `cbjax.app.run.run_single`
serves. The grid times steps back to back on fixed batches; these iterations are what a run
pays, and the profile's step terms are fitted on them (`cbjax.profile.served_fit`).
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_right
from collections import deque
from typing import Any, Callable, Optional

from cbjax.config import LengthConfig, RunConfig, WorkloadConfig
from cbjax.config.workload import SharedPrefixConfig
from cbjax.core.plan import Schedule, StepOutput
from cbjax.profile.anchor import anchor_record, anchor_spec, time_anchor
from cbjax.core.request import Request
from cbjax.profile.residuals import regime_of
from cbjax.layout.shapes import ShapePlan
from cbjax.sim.launch_terms import rows_left
from cbjax.sim.profiled import COLD_TERMS, step_features, steps_since_larger

# Poisson runs at these shares of the saturated request rate: light, medium and heavy load.
POISSON_SHARES = (0.3, 0.6, 0.9)
# The prefix-cached burst's shared prefixes (`serving_runs`).
PREFIX_GROUPS = 4
# Round r of the served workloads draws with seeds offset by this times r (`serving_runs`).
ROUND_SEED_STRIDE = 1000
# the served run the profile and the calibration time as the anchor of the machine's speed
# (`cbjax.profile.anchor`): round 0's closed-loop burst of whole prompts
ANCHOR_RUN = "fcfs_chunked_off"
# The most served rounds `serving_round_count` extends to.
MAX_SERVING_ROUNDS = 32
# The served rounds' contexts cycle over this many rounds (`serving_runs`): rounds are added in
# whole cycles, so that the fitted and held-out rounds keep spanning long and short contexts alike.
ROUND_CYCLE = 4


class TimedExecutor:
    """Passes each iteration to `inner` and records its rows and clock: `rows_at` (before the
    recorder's own bookkeeping), `start`/`end` (around `inner.execute`; when `inner` is
    pipelined, at `launch` and after `collect`), `launched` (when `inner.launch` returned: its
    host part, packing the rows and dispatching, is over), `idle`: whether the loop turned
    more than once before it (`tick`): it idled waiting for an arrival, or took one in (each
    arrival adds a turn), `arrived`: when each arrival reached the scheduler (which asks
    `validate` of every request it is handed that passes its own checks), and `dispatch`: the
    seconds the engine's launch spent in its step call (`Launched.dispatch_s`; None for another
    executor's handle)."""

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
        self.arrived: list[float] = []
        self.dispatch: list[Optional[float]] = []
        self._turns = 0

    def tick(self) -> None:
        """Called by the loop on every turn (`cbjax.engine.offline.serve`'s `tick`)."""
        self._turns += 1

    def validate(self, req: Request) -> Optional[str]:
        self.arrived.append(time.perf_counter())
        return self.inner.validate(req)

    def timeline(self) -> None:
        return None  # the engine's wall clock

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        """The engine is warm already: the profile warmed it before the grid."""

    def restart_compile_count(self) -> None:
        self.inner.restart_compile_count()

    def export_kv(self, pages):
        return self.inner.export_kv(pages)

    def import_kv(self, request_id: str, kv) -> None:
        self.inner.import_kv(request_id, kv)

    def host_load_times(self) -> tuple[float, float]:
        return self.inner.host_load_times()

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
        self.dispatch.append(dispatch_s(launched))
        return launched

    def collect(self, launched) -> StepOutput:
        out = self.inner.collect(launched)
        self.end.append(time.perf_counter())
        return out

    @property
    def makespan(self) -> float:
        """Seconds from the first launch to the last collect (0 before any iteration)."""
        return self.end[-1] - self.start[0] if self.end else 0.0

    def metrics(self) -> dict:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()


def dispatch_s(launched) -> Optional[float]:
    """The seconds a launch spent in the engine's step call, from its handle; None for a handle
    that is not the engine's."""
    from cbjax.runtime.executor import Launched

    return launched.dispatch_s if isinstance(launched, Launched) else None


def serving_runs(
    cfg: RunConfig, saturated_req_s: Optional[float] = None, round_: int = 0
) -> list[tuple[str, RunConfig]]:
    """The profile's own served workloads (apart from experiments/calibrate.py's), uniform prompts
    up to half of max_model_len (rounds 2 and 3 of every 4: an eighth) and uniform outputs up to
    an eighth, under fcfs. The burst regime: 3 x slots requests at t=0 with chunked prefill
    (mixed steps) and without (whole prompts), a static batch, and prompts behind PREFIX_GROUPS
    shared prefixes with the prefix cache on (prefills over cached context). Given the engine's
    saturated request rate, also 2 x slots Poisson arrivals at 30%, 60% and 90% of it (the
    light, medium and heavy regimes, few rows at a time as open-loop runs have:
    `cbjax.profile.residuals.regime_of`). Each round `round_` draws its
    own requests and arrivals (seeds offset by ROUND_SEED_STRIDE x round): a round held out of
    the fit is then other requests, not a re-timing of the same ones."""
    # the prefix cache is on in fcfs_prefix alone, so the fit can tell the loop's prefix-cache
    # work (launch_cached_seq_s) from a row's
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False))
    seed = cfg.seed + ROUND_SEED_STRIDE * round_
    length = cfg.model.max_model_len
    slots = cfg.scheduler.max_num_seqs
    # rounds 0 and 1 prompt up to half of max_model_len, rounds 2 and 3 up to an eighth, and so
    # on: the fitted (even) and held-out (odd) rounds both span long and short contexts, so that
    # the served fit can tell a KV page's cost from a bucket's intercept
    longest = length // 2 if (round_ // 2) % 2 == 0 else length // 8
    wl = WorkloadConfig(
        num_requests=3 * slots, vocab_size=cfg.model.vocab_size,
        prompt_len=LengthConfig(dist="uniform", low=min(8, longest), high=max(8, longest), max=max(8, longest)),
        output_len=LengthConfig(dist="uniform", low=min(8, length // 2), high=max(8, length // 8), max=max(8, length // 8)),
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
    # prompts behind shared prefixes with the prefix cache on: prefills of a few new tokens over
    # a long cached context, so the fit can tell a KV page's cost from a new token's (a whole
    # prompt's prefill reads as many pages as its tokens fill), and the loop's prefix-cache work
    half = max(8, longest // 2)
    prefixed = dataclasses.replace(
        wl, name="shared_prefix", prompt_len=LengthConfig(dist="uniform", low=min(8, half), high=half, max=half),
        shared_prefix=SharedPrefixConfig(num_groups=PREFIX_GROUPS, prefix_len=half, zipf_s=1.0),
    )  # fmt: skip
    sched = dataclasses.replace(cfg.scheduler, name="fcfs", chunked_prefill=True, static_padding=False)
    cache = dataclasses.replace(cfg.cache, prefix_caching=True)
    runs.append(("fcfs_prefix", dataclasses.replace(cfg, scheduler=sched, workload=prefixed, cache=cache, seed=seed + 104)))
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
    from cbjax.engine.offline import serve
    from cbjax.report.service import ServiceLog
    from cbjax.sim.pricing import build_scheduler
    from cbjax.workload import build_workload

    timed = TimedExecutor(executor)
    scheduler = build_scheduler(cfg, timed)
    serve(build_workload(cfg.workload, cfg.seed), scheduler, timed, on_step=ServiceLog().on_step, tick=timed.tick)
    return timed


def served_points(
    label: str, timed: TimedExecutor, shapes: ShapePlan, native: bool = False, prefix_caching: bool = False
) -> tuple[list[dict], list[tuple[int, float]]]:
    """(steps, gaps): per iteration its features, the seconds `execute` took as the loop called
    it, whether the loop idled before it, and whether the run had the prefix cache on
    (`prefix_caching`, a feature of the launch fit); per iteration but the last whose next one the
    loop went to straight away, (its rows, the loop's host seconds until that `execute`, the
    recorder's own bookkeeping excluded).

    Pipelined serving overlaps the loop's host work with the step in flight: an iteration's
    seconds are then its share of the wall clock, from its launch or the previous step's end
    (whichever is later) to its own end, and there are no gaps. The loop collects a step only
    after it has committed the previous one and planned and launched the next, so a step's share
    is the longer of its device time and that host time. Where the step was launched while its
    predecessor was in flight and the next one while it was, the point records the host time
    (`host_s`, from its share's start to the next launch's return), the next plan's rows,
    prefill rows and tokens (`next_rows`, `next_prefill_rows`, `next_tokens`) and how many of its
    requests the next plan does not carry on (`left`, `rows_left`): `served_fit.fit_launch`'s
    features), how many arrivals reached the scheduler between the step's launch and the next
    plan (`arrivals`: that host time holds their intake), the next launch's step call
    (`next_dispatch_s`, where the engine's handle gives it: where the host and the device share
    a CPU core, a call that finds the device idle holds the loop while the step runs) and how
    long the collect then waited (`collect_wait_s`: about nothing when the host time set the
    share, `served_fit.censored`). Every pipelined point says whether its step
    was launched with nothing in flight (`alone`: its share holds its own launch) and whether it
    was collected with nothing launched behind it (`uncovered`: its share is the device's
    remainder alone, `served_fit.fit_drain`)."""
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
            "since_larger": steps_since_larger(recent, bucket), "prefix_caching": prefix_caching,
        })  # fmt: skip
        recent.appendleft(bucket)
    if timed.pipelined:
        # a step launched with nothing in flight (`alone`: the run's first, or after a collect
        # with nothing launched behind it) has its own launch in its share; one collected with
        # nothing launched behind it (`uncovered`: the last before an idle loop or the run's
        # end) only the device's remainder of its work (`served_fit.fit_drain`); the step after
        # an uncovered one is alone
        for i, step in enumerate(steps):
            step["alone"] = i == 0 or steps[i - 1]["uncovered"]
            step["uncovered"] = i == len(steps) - 1 or timed.start[i + 1] >= timed.end[i]
    # pipelined, step i launched while step i-1 was in flight (its share starts at i-1's end) and
    # step i+1 while step i was: the loop's host time in between set step i's share or hid behind it
    for i in range(1, len(steps) - 1):
        if timed.start[i] < timed.end[i - 1] and timed.start[i + 1] < timed.end[i] and len(timed.launched) > i + 1:
            nxt = steps[i + 1]
            steps[i].update({
                "next_rows": nxt["rows"], "next_prefill_rows": nxt["prefill_rows"], "next_tokens": nxt["tokens"],
                "left": rows_left(steps[i]["rows"], timed.rows[i + 1]),
                "arrivals": bisect_right(timed.arrived, timed.rows_at[i + 1]) - bisect_right(timed.arrived, timed.launched[i]),
                "host_s": timed.launched[i + 1] - starts[i], "collect_wait_s": timed.end[i] - timed.launched[i + 1],
            })  # fmt: skip
            if len(timed.dispatch) > i + 1 and timed.dispatch[i + 1] is not None:
                steps[i]["next_dispatch_s"] = timed.dispatch[i + 1]
    gaps = [
        (n, nxt - end)
        for n, end, nxt, idle in zip(timed.num_scheduled, timed.end, timed.rows_at[1:], timed.idle[1:])
        if not idle and not timed.pipelined
    ]
    return steps, gaps


def serving_round_count(min_rounds: int, first_round_s: float, min_s: float, cap: int = MAX_SERVING_ROUNDS) -> int:
    """How many rounds to serve: `min_rounds`, or, when that many rounds of `first_round_s` each
    fall short of `min_s` seconds, as many more whole ROUND_CYCLEs as reach it, up to `cap`
    (never below `min_rounds`).

    Why: a tiny model's served run lasts about a second, and this VM's speed moves 5-10% from
    one second to the next, so one run's mean step error is mostly the moment it ran at. A
    regime's held-out residual over two such runs, and the fit over two others, then move by
    several points from one profile to the next; more rounds average the moments out. A model
    whose runs last tens of seconds averages them within each run and keeps `min_rounds`."""
    if min_s <= 0 or first_round_s <= 0 or min_rounds * first_round_s >= min_s:
        return min_rounds
    need = -(-(min_s - min_rounds * first_round_s) // first_round_s)  # more rounds, rounded up
    cycles = -(-int(need) // ROUND_CYCLE)
    return max(min_rounds, min(min_rounds + ROUND_CYCLE * cycles, cap))


def anchor_rounds(rounds: int, timings: int = 4) -> set[int]:
    """The rounds the anchor is timed before (it is timed after the last too): `timings` of them
    spread evenly from round 0, or every round when there are no more than that. The anchor's
    spread (`cbjax.profile.anchor.steady`) then compares as many timings however many rounds."""
    return {rounds * k // timings for k in range(timings)} if rounds > timings else set(range(rounds))


def held_out_round(r: int, rounds: int) -> bool:
    """Whether served round `r` of `rounds` is held out of the fit, its steps kept for the residual
    table (`cbjax.profile.residuals`): the odd rounds, when there are at least two (one round:
    none is held out, and the table is in-sample)."""
    return rounds >= 2 and r % 2 == 1


def measure_serving(
    executor, cfg: RunConfig, shapes: ShapePlan, rounds: int = 1, native: bool = False, min_s: float = 0.0,
    each_round: Optional[Callable[[int], None]] = None,
) -> dict[str, Any]:
    """Serve the profile's workloads (`serving_runs`) on the warm engine, `rounds` times over, or
    more when `min_s` asks for it (`serving_round_count`, from round 0's wall time): the bursts
    first, then the Poisson runs at shares of the first burst's request rate (set in the first
    round). Before the `anchor_rounds` and after the last it times the anchor
    (`cbjax.profile.anchor`: round 0's ANCHOR_RUN burst, served ANCHOR_RUNS times a timing).
    Returns the served steps for the fit, loop gaps for `served_fit.fit_loop`, per run its
    round, iterations, makespan and time in execute, the anchor's record (`anchor_record`) and
    the rounds served. `native`: the engine's attention is `native` (its features, see
    `cbjax.sim.profiled.step_features`). `each_round(r)` runs after round r's workloads (what
    else the profile times in every round, at the speeds the rounds meet)."""
    steps, gaps, runs = [], [], []
    saturated: Optional[float] = None
    anchor_cfg = dict(serving_runs(cfg, None, 0))[ANCHOR_RUN]
    timings = []
    planned = rounds  # round 0 is neither held out nor skips its anchor, whatever count it settles

    def anchor_makespan() -> float:
        return serve_timed(executor, anchor_cfg).makespan

    r = 0
    t_start = time.perf_counter()
    while r < rounds:
        if r in anchor_rounds(rounds):
            timings.append(time_anchor(anchor_makespan))
        todo = serving_runs(cfg, saturated, r)
        i = 0
        while i < len(todo):  # the list grows by the Poisson runs after the first burst
            label, run_cfg = todo[i]
            i += 1
            t0 = time.perf_counter()
            timed = serve_timed(executor, run_cfg)
            s, g = served_points(label, timed, shapes, native, run_cfg.cache.prefix_caching)
            for x in s:
                x["round"] = r
                x["held_out"] = held_out_round(r, rounds)
            steps += s
            gaps += g
            makespan = timed.makespan
            runs.append({
                "run": label, "round": r, "iterations": len(s), "makespan_s": makespan,
                "execute_s": float(sum(x["measured_s"] for x in s)), "loop_s": float(sum(x for _, x in g)),
                "wall_s": time.perf_counter() - t0,
            })  # fmt: skip
            if len(runs) == 1 and makespan > 0:  # the same bursts first, then the Poisson runs
                saturated = run_cfg.workload.num_requests / makespan
                todo = serving_runs(cfg, saturated, r)
        if each_round is not None:
            each_round(r)
        if r == 0:  # round 0's wall time (its anchor timing included) sets the count
            rounds = serving_round_count(planned, time.perf_counter() - t_start, min_s)
        r += 1
    timings.append(time_anchor(anchor_makespan))
    return {"steps": steps, "gaps": gaps, "runs": runs, "anchor": anchor_record(anchor_spec(anchor_cfg), timings),
            "rounds": rounds}  # fmt: skip
