"""The profile's fits on the served steps `cbjax.profile.serving` records: the served step
costs (`fit_served`), the pipelined loop's host time before a collect (`fit_launch`) and the
one-step-at-a-time loop's gaps (`fit_loop`). Pure numpy: no jax import.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import numpy as np

from cbjax.profile.residuals import MIN_STEPS
from cbjax.profile.fit import WEIGHTINGS, fit_costs, nnls
from cbjax.sim.launch_terms import HELD_TERMS, LAUNCH_TERMS, held_cost, launch_cost, launch_features
from cbjax.sim.profiled import COLD_TERMS, STEP_TERMS, bucket_intercept, step_terms

# A bucket gets its own served intercept (`served_bucket_s`) from this many served iterations on.
MIN_SERVED = MIN_STEPS
# A pipelined collect that waited less than this found its step done: the copy and bookkeeping
# alone, so the loop's host time, not the step, set the step's share (`censored`).
COLLECT_FLOOR_S = 50e-6
# A launch whose step call took over this multiple of `held_floor` found the device idle and held
# the loop while its step ran (`launch_held`).
HELD_CALL = 2.0
# Host times over this multiple of what their plan explains are stalls (a garbage collection, the
# VM held back), not the loop's work: `fit_launch` leaves them out, as one would swamp a least-squares fit.
HOST_STALL = 5.0


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


# Step terms `fit_served` can refit on the served steps (`served_terms`): per row, per KV page,
# and per block step of the prefill attention (alone and per bucket token): the grid's few large
# mixed steps cannot tell the last two apart, and a served burst's chunked prefills hold most of
# a run's block steps.
SERVED_STEP_TERMS = ("seq_s", "single_page_s", "block_page_s", "block_chunk_s", "block_chunk_token_s")
# How `fit_served` weighs the served steps: `cbjax.profile.fit.WEIGHTINGS`, or "balanced", the mean
# of the "absolute" and "mean_relative" fits' coefficients.
SERVED_WEIGHTINGS = WEIGHTINGS + ("balanced",)


def fit_served(
    served: list[dict],
    bucket_s: dict[int, float],
    grid_model: dict[str, float],
    fit_cold: bool = False,
    served_terms: bool = False,
    weighting: str = "absolute",
    launch: Optional[dict[str, float]] = None,
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

    With `served_terms` the SERVED_STEP_TERMS (per row, per page read, per block step) are fitted on the served
    steps too, beside the intercepts, instead of taken from the grid: a sparse light-load batch
    and a full burst then share one per-row cost fitted where runs have them, not one
    intercept per bucket pooled over both. They are returned under their names.

    A pipelined step whose share the loop's host time set (`censored`) while the next plan held
    a prefill is left out: its share is that launch's host time, which `fit_launch` fits and
    the simulator charges as the longer of the two (`cbjax.sim.timeline.Timeline.launch`);
    fitted here too, it would raise every step of its bucket. A censored step before a decode
    stays in: its share is the loop's steady host time, what the engine's step costs when the
    host is the slower side. A step collected with nothing launched behind it (`uncovered`) is
    left out too: its share is the device's remainder alone, which `fit_drain` fits (a tiny
    model's last decode before an idle loop takes a tenth of a served decode; at a tenth of the
    time, a relative weighting would give it ten times the weight). A step launched with nothing
    in flight (`alone`) has its own launch in its share: the `launch` terms (`fit_launch`'s; none:
    0) are taken off it, as the simulator charges them before the step.

    Non-negative least squares, weighted by `weighting` (SERVED_WEIGHTINGS). "absolute" fits the
    summed time, as a run's makespan adds the steps up (thousands of small decode steps and a few
    large prefills weigh what they cost); "mean_relative" makes each bucket's mean signed relative
    error zero, the figure the profile's residual table judges (`cbjax.profile.residuals`). Where
    the step times spread with a long tail (a slow step now and then), the two part: the first
    leaves the mean relative error positive by about the tail's weight, the second the summed
    time short by as much. "balanced" takes the mean of their coefficients, so each criterion
    is off by about half of it. The profile's default is "mean_relative" (`ProfileRunConfig`).
    Steps marked `held_out` are left out (the residual table's). None served: no served intercepts, scale 1, no cold terms."""
    points = [
        s for s in served
        if not s.get("idle") and not s.get("held_out") and not s.get("uncovered")
        and not (censored(s) and s.get("next_prefill_rows", 0))
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
    terms = np.array([step_terms(kept, s["features"]) + own_launch(launch, s) for s in points])
    y = np.array([s["measured_s"] for s in points])
    coef = fit_weighted(x, y, weighting, offsets=terms)
    served_fixed = {b: float(c) for b, c in zip(own, coef)}
    scale = float(coef[len(own)])
    if not np.any(x[:, len(own)]):  # every served step has its bucket's own intercept
        scale = float(np.mean([served_fixed[b] / bucket_intercept(bucket_s, b) for b in own]))
    out: dict[str, Any] = {"served_bucket_s": {str(b): v for b, v in served_fixed.items()}, "bucket_scale": scale}
    out.update({k: float(c) for k, c in zip(COLD_TERMS, coef[len(own) + 1 : base])})
    out.update({k: float(c) for k, c in zip(refit, coef[base:])})
    return out


def own_launch(launch: Optional[dict[str, float]], point: dict) -> float:
    """The launch host time in a served step's own share: its plan's launch (`launch_cost` of
    the LAUNCH_TERMS `launch`, nothing to retire) where it was launched with nothing in flight
    (`alone`), else 0."""
    if not launch or not point.get("alone"):
        return 0.0
    return launch_cost(launch, point["rows"], point["prefill_rows"], point["tokens"], point.get("prefix_caching", False))


def fit_drain(served: list[dict], launch: Optional[dict[str, float]] = None, weighting: str = "absolute") -> dict[str, float]:
    """`drain_s`: the share of a served step the pipelined loop collected with nothing launched
    behind it (`uncovered`: the last before an idle loop or a run's end), its own launch taken off
    where it was launched with nothing in flight too (`own_launch`). On the engine such a step
    is collected as soon as the device is done with it, where one with a launch behind it is
    collected only after that launch: a tiny model's decode then takes a few hundredths of a
    millisecond, not the loop's tenths. One constant, fitted with `weighting`; the simulator
    charges it as the step's share, never above the step's cost (`ProfiledCost.drain_s`). Steps
    held out or after an idle loop are left out. None of them: {} (the simulator then charges
    such a step its whole cost)."""
    check_weighting(weighting)
    points = [s for s in served if s.get("uncovered") and not s.get("idle") and not s.get("held_out")]
    y = np.array([s["measured_s"] for s in points])
    offsets = np.array([own_launch(launch, s) for s in points])
    keep = y > offsets  # a share shorter than its own predicted launch tells nothing of the drain
    if not np.any(keep):
        return {}
    coef = fit_weighted(np.ones((int(keep.sum()), 1)), y[keep], weighting, offsets=offsets[keep])
    return {"drain_s": float(coef[0])}


def fit_collect(step_s: np.ndarray, launch_s: np.ndarray, measured_s: np.ndarray, weighting: str = "absolute") -> dict[str, float]:
    """`collect_prefill_share`: the share of its own time the step in flight still owes when a
    plan with prefill rows has been launched (`StepTime.collect_share`), fitted on the served
    steps followed by such a plan: each step's share of the wall clock is predicted as max(its
    own time `step_s`, that launch's host time `launch_s` + the term x `step_s`), as the
    simulator charges it. Where the host and the device run on separate hardware it fits near
    0; where they share a core, the launch's host time holds the step back. `weighting`
    (SERVED_WEIGHTINGS) as `fit_served`'s: "absolute" minimises the squared error of the shares
    (what a run's makespan adds up), "mean_relative" makes their mean signed relative error
    nearest 0, "balanced" takes the mean of the two. Searched on a grid of 0.001 from 0 to 2.
    None of them: {} (charged 0)."""
    check_weighting(weighting)
    if not len(measured_s):
        return {}
    grid = np.arange(0.0, 2.0005, 1e-3)
    ways = ("absolute", "mean_relative") if weighting == "balanced" else (weighting,)
    fitted = []
    for way in ways:
        miss = np.maximum(step_s[:, None], launch_s[:, None] + grid[None, :] * step_s[:, None]) - measured_s[:, None]
        err = (miss**2).sum(axis=0) if way == "absolute" else np.abs((miss / measured_s[:, None]).mean(axis=0))
        fitted.append(float(grid[int(np.argmin(err))]))
    return {"collect_prefill_share": sum(fitted) / len(fitted)}


def check_weighting(weighting: str) -> None:
    if weighting not in SERVED_WEIGHTINGS:
        raise ValueError(f"served_weighting: unknown value {weighting!r}; choose one of {', '.join(SERVED_WEIGHTINGS)}")


def fit_weighted(x: np.ndarray, y: np.ndarray, weighting: str, offsets: Optional[np.ndarray] = None) -> np.ndarray:
    """`fit_costs`' non-negative coefficients for the columns of `x` (0 for a column that is all
    0), weighted by `weighting` (SERVED_WEIGHTINGS): "balanced" is the mean of the "absolute" and
    "mean_relative" fits, halfway between the two criteria (`fit_served`)."""
    check_weighting(weighting)
    ways = ("absolute", "mean_relative") if weighting == "balanced" else (weighting,)
    coef = np.zeros(x.shape[1])
    used = np.any(x != 0, axis=0)
    coef[used] = sum(fit_costs(x[:, used], y, offsets=offsets, weighting=w) for w in ways) / len(ways)
    return coef


def censored(point: dict) -> bool:
    """Whether a served step's collect found it done (`COLLECT_FLOOR_S`): its share of the wall
    clock is then the loop's host time, its own time only bounded by it. Steps without a
    recorded collect (one step at a time, or profiles made before it) are not."""
    return point.get("collect_wait_s", float("inf")) < COLLECT_FLOOR_S


def held_floor(served: list[dict]) -> Optional[float]:
    """The median step call (`next_dispatch_s`) of the launches that found the device busy (the
    collect after them waited: not `censored`), which only queue their step; None where no
    launch recorded its call."""
    calls = [s["next_dispatch_s"] for s in served if "next_dispatch_s" in s and "host_s" in s and not censored(s)]
    return float(np.median(calls)) if calls else None


def launch_held(point: dict, floor: Optional[float]) -> bool:
    """Whether a served step's next launch holds a prefill and its step call held the loop while
    the step ran (over HELD_CALL x `floor`, `held_floor`): the HELD_TERMS' launches."""
    return floor is not None and point["next_prefill_rows"] > 0 and point.get("next_dispatch_s", 0.0) > HELD_CALL * floor


def predicted_launch(coefficients: dict, point: dict, floor: Optional[float]) -> float:
    """A served step's next launch as the fitted terms price it: its LAUNCH_TERMS, and its
    HELD_TERMS where that launch was held (`launch_held`)."""
    prefills, tokens = point["next_prefill_rows"], point["next_tokens"]
    host = launch_cost(coefficients, point["next_rows"], prefills, tokens, point.get("prefix_caching", False),
                       point.get("left", 0))  # fmt: skip
    return host + held_cost(coefficients, prefills, tokens) if launch_held(point, floor) else host


def fit_launch(served: list[dict], weighting: str = "absolute", held: bool = True) -> dict[str, float]:
    """The LAUNCH_TERMS and HELD_TERMS, fitted on the served steps that recorded the loop's host
    time before their collect (`host_s`, `served_points`), over the plan launched in it, the
    requests of the step in flight it does not carry on (`launch_features`; a profile recorded
    before `left` fits that term 0) and, for a held launch (`launch_held`), its prefill plan's
    step run in the call's place (fixed and per token; without `held`, the CPU term set, or
    where no launch recorded its step call, they fit 0).
    Non-negative least squares weighted by `weighting` (`fit_weighted`); steps held out, after an idle loop, or with a stall (HOST_STALL) are left out. None: all 0."""
    check_weighting(weighting)
    points = [s for s in served if s.get("host_s", 0.0) > 0 and not s.get("idle") and not s.get("held_out")]
    if not points:
        return dict.fromkeys(LAUNCH_TERMS + HELD_TERMS, 0.0)
    floor = held_floor(served) if held else None
    x = np.array([
        launch_features(s["next_rows"], s["next_prefill_rows"], s["next_tokens"], s.get("prefix_caching", False),
                        s.get("left", 0))
        + ([1.0, float(s["next_tokens"])] if launch_held(s, floor) else [0.0, 0.0])
        for s in points
    ])  # fmt: skip
    y = np.array([s["host_s"] for s in points])
    # fit on all, then twice on the steps within HOST_STALL of the last fit's prediction: a stall
    # is far above what its plan explains (a prefill's launch is not, though far above the median)
    coef = fit_weighted(x, y, weighting)
    for _ in range(2):
        keep = y <= HOST_STALL * np.maximum(x @ coef, 1e-12)
        coef = fit_weighted(x[keep], y[keep], weighting)
    return {k: float(c) for k, c in zip(LAUNCH_TERMS + HELD_TERMS, coef)}
