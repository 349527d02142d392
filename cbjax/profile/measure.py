"""Time an executor over the grid, time swap copies, fit the cost model, write profile.json and a plot.

`measure_steps` needs only a step timer (`time_step(plan) -> seconds`, `wall_time_of` an
executor's `execute`), so a synthetic one with hand-set costs checks the fit; the swap timing needs the JAX engine's `HostSwap`;
the served iterations and the loop's host time come from `cbjax.profile.serving`, their fits
from `cbjax.profile.served_fit`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cbjax.config import RunConfig
from cbjax.core.plan import Schedule
from cbjax.profile.grid import GridPoint, build_schedule
from cbjax.profile.launch_residuals import launch_residuals
from cbjax.profile.residuals import held_out_residuals
from cbjax.profile.served_fit import (
    fit_collect, fit_drain, fit_launch, fit_loop, fit_served, held_floor, own_launch, predicted_launch,
)  # fmt: skip
from cbjax.layout.shapes import ShapePlan
from cbjax.profile.copies import fit_served_copies
from cbjax.profile.fit import fit_costs
from cbjax.profile.wake import fit_served_wake
from cbjax.sim.profiled import (
    STEP_TERMS, SWAP_DIRECTION_TERMS, SWAP_TERMS, bucket_intercept, cold_cost, drain_share, predict, profile_key,
    step_features, wake_cost,
)  # fmt: skip


def wall_time_of(execute: Callable) -> Callable[[Schedule], float]:
    """A step timer over `execute`: the wall seconds one call takes, its tokens on the host."""

    def time_step(plan: Schedule) -> float:
        t0 = time.perf_counter()
        execute(plan)
        return time.perf_counter() - t0

    return time_step


def measure_steps(time_step: Callable[[Schedule], float], points: list[GridPoint], shapes: ShapePlan, num_pages: int,
                  vocab_size: int, repeats: int, native: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Per grid point: its features and the median (and range) of `repeats` step durations. The
    repeats go round the whole grid, so a slow spell of the machine spreads over every point
    rather than landing on one; in each round a point runs once untimed, then timed (a small
    step right after a large one runs ~0.5 ms slower on a CPU, its caches cold)."""
    plans = [build_schedule(p, shapes, num_pages, vocab_size) for p in points]
    times: list[list[float]] = [[] for _ in plans]
    for _ in range(repeats):
        for plan, ts in zip(plans, times):
            time_step(plan)
            ts.append(time_step(plan))
    out = []
    for point, plan, ts in zip(points, plans, times):
        tokens = sum(n for n, _ in point.rows)
        out.append({
            "kind": point.kind, "source": "grid", "rows": len(point.rows), "tokens": tokens,
            "bucket": shapes.bucket(tokens), "features": step_features(plan.cost_rows(), shapes, native)[1],
            "measured_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
        })  # fmt: skip
    return out


def measure_swaps(executor, repeats: int) -> list[dict[str, Any]]:
    """Median seconds of a swap-out and of a swap-in of a few page counts on the JAX engine: the
    smallest, a middle and the largest of its swap widths (copies of exactly a width: no padding)."""
    from cbjax.runtime.swap import HostSwap

    widths = executor._swap.widths
    counts = sorted({widths[0], widths[len(widths) // 2], widths[-1]})
    swap = HostSwap(counts)
    executor.cache = swap.warmup(executor.cache)
    out = []
    for count in counts:
        pages = [1 + i for i in range(count)]
        for direction in ("out", "in"):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                swap.swap_out(executor.cache, [("swap", pages)])
                if direction == "in":
                    t0 = time.perf_counter()
                    executor.cache = swap.swap_in(executor.cache, [("swap", pages)])
                    executor.cache.k.block_until_ready()
                else:
                    swap._host.clear()
                times.append(time.perf_counter() - t0)
            out.append({"direction": direction, "pages": count, "measured_s": statistics.median(times)})
    return out


def measure_buckets(run_empty: Callable[[int], float], buckets: Sequence[int], repeats: int) -> dict[int, float]:
    """Each bucket's fixed cost: the median seconds of `run_empty(bucket)`, its program run on an
    all-padding batch (no rows, no tiles), over `repeats` rounds of all buckets, each run once
    untimed then timed (as `measure_steps` does)."""
    times: dict[int, list[float]] = {b: [] for b in buckets}
    for _ in range(repeats):
        for b in buckets:
            run_empty(b)
            times[b].append(run_empty(b))
    return {b: statistics.median(ts) for b, ts in times.items()}


def engine_empty_step(executor) -> Callable[[int], float]:
    """`run_empty` for the JAX engine: pack `packer.empty(bucket)` and run one step on it, read back
    to the host. The packing is timed too: its arrays (tile lists at their static capacity) grow
    with the bucket, as they do in `execute`."""

    def run(bucket: int) -> float:
        t0 = time.perf_counter()
        np.asarray(executor._step(executor.packer.empty(bucket)))
        return time.perf_counter() - t0

    return run


def fit_swaps(swaps: list[dict]) -> dict[str, float]:
    """The swap terms (fixed, per page) over every timed copy, and each direction's own: the
    host KV tier's stores are swap-outs' copies, its loads swap-ins'. None timed: all 0."""

    def fit(rows: list[dict]) -> list[float]:
        if not rows:
            return [0.0, 0.0]
        return [float(c) for c in fit_costs([[1.0, s["pages"]] for s in rows], [s["measured_s"] for s in rows])]

    out = dict(zip(SWAP_TERMS, fit(swaps)))
    out.update(zip(SWAP_DIRECTION_TERMS[:2], fit([s for s in swaps if s["direction"] == "out"])))
    out.update(zip(SWAP_DIRECTION_TERMS[2:], fit([s for s in swaps if s["direction"] == "in"])))
    return out


def fit_profile(
    steps: list[dict],
    swaps: list[dict],
    bucket_s: dict[int, float],
    served: Optional[list[dict]] = None,
    gaps: Optional[list[tuple[int, float]]] = None,
    wake: Optional[dict[str, Any]] = None,
    fit_cold: bool = False,
    served_terms: bool = False,
    served_weighting: str = "absolute",
    copies: Optional[list[dict]] = None,
    served_wake: Optional[dict[str, Any]] = None,
    shapes: Optional[ShapePlan] = None,
    native: bool = False,
    fit_held: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(coefficients, residuals): the timed bucket costs and the STEP_TERMS fitted on top of them
    over the grid (non-negative, on relative error: a 1 ms step counts as much as a 1 s one), the
    grid model, whose step terms the model keeps; then the served steps' fixed costs and cold
    terms over them, `fit_served` on the served iterations (steps as the serving loop runs them;
    none served: the grid model), the launch terms (`fit_launch`: a pipelined loop's host time
    before it collects the step in flight), the swap terms (the host tier's from `copies`, timed while serving: `cbjax.profile.copies`), the loop's (`fit_loop`) and the wake's: fitted on the lone requests
    `served_wake` served (`cbjax.profile.wake`, under the engine's `shapes` and `native`
    attention), else `wake` timed on the executor alone.
    A served step's prediction is what the simulator charges its share: the longer of its own
    time and that host time where it recorded one, the drain (`fit_drain`) where nothing was
    launched behind it, its own launch first where nothing was in flight, the wake after an
    idle loop.
    Residuals: the grid model's relative error per grid point and its coefficients; per served
    iteration the model's, and the served runs' total time (steps and loop) predicted against
    measured, by the model and by the grid model."""
    served = served or []
    coef = fit_costs(
        [s["features"] for s in steps], [s["measured_s"] for s in steps],
        offsets=[bucket_intercept(bucket_s, s["bucket"]) for s in steps],
    )  # fmt: skip
    grid = {"bucket_s": bucket_s, "bucket_scale": 1.0, **{k: float(c) for k, c in zip(STEP_TERMS, coef)}}
    coefficients: dict[str, Any] = {"bucket_s": {str(b): float(v) for b, v in sorted(bucket_s.items())}}
    coefficients.update({k: grid[k] for k in STEP_TERMS})
    launch = fit_launch(served, served_weighting, fit_held)
    coefficients.update(fit_served(served, bucket_s, grid, fit_cold, served_terms, served_weighting, launch))
    coefficients.update(launch)
    coefficients.update(fit_drain(served, launch, served_weighting))
    coefficients.update(fit_swaps(swaps))
    coefficients.update(fit_served_copies(copies or []))  # the tier's copies as a run pays them, where timed
    coefficients.update(fit_loop(gaps or []))
    coefficients["wake_s"] = float(wake["wake_s"]) if wake else 0.0
    coefficients["wake_ramp_s"] = float(wake["wake_ramp_s"]) if wake else 1.0
    coefficients["wake_token_s"] = 0.0  # timed on the executor alone, the wake has no per-token term
    coefficients.update(fit_served_wake(served_wake, coefficients, shapes, native))
    numeric = {**coefficients, "bucket_s": bucket_s,
               "served_bucket_s": {int(b): v for b, v in coefficients["served_bucket_s"].items()}}  # fmt: skip
    for s in steps:
        s["predicted_s"] = float(predict(grid, s["bucket"], s["features"]))
    # each served step's own time as the simulator charges it (`cbjax.sim.profiled`): its cost,
    # the wake after an idle loop; and, pipelined, the next launch's host time
    own = []
    floor = held_floor(served) if fit_held else None
    for s in served:
        s["grid_model_s"] = float(predict(grid, s["bucket"], s["features"]))
        step = predict(numeric, s["bucket"], s["features"]) + cold_cost(coefficients, s.get("since_larger", 0))
        if s.get("idle"):
            step += wake_cost(coefficients, s.get("idle_s", 0.0), s.get("tokens", 0))
        own.append(step)
        if "host_s" in s:
            s["launch_predicted_s"] = float(predicted_launch(coefficients, s, floor))
    # the collect share, on the steps a plan with prefill rows was launched behind
    behind = [i for i, s in enumerate(served)
              if "host_s" in s and s["next_prefill_rows"] and not s.get("idle") and not s.get("held_out")]  # fmt: skip
    coefficients.update(fit_collect(
        np.array([own[i] for i in behind]), np.array([served[i]["launch_predicted_s"] for i in behind]),
        np.array([served[i]["measured_s"] for i in behind]), served_weighting,
    ))  # fmt: skip
    for s, step in zip(served, own):
        if "host_s" in s:  # pipelined: collected only after the loop launched the next step
            host = s["launch_predicted_s"]
            if s["next_prefill_rows"]:
                host += coefficients.get("collect_prefill_share", 0.0) * step
            step = max(step, host)
        if s.get("uncovered") and "drain_s" in coefficients:  # ... the drain with nothing behind it
            step = drain_share(coefficients["drain_s"], step)
        s["predicted_s"] = float(step + own_launch(coefficients, s))  # ... after its launch with none before
    for s in steps + served:
        s["rel_error"] = float(abs(s["predicted_s"] - s["measured_s"]) / s["measured_s"])
    grid_err = [s["rel_error"] for s in steps]
    fitted = [s for s in served if not s.get("held_out")]  # the served totals below: the fit's own steps
    residuals: dict[str, Any] = {
        "median_rel_error": float(np.median(grid_err)), "max_rel_error": float(np.max(grid_err)), "num_points": len(steps),
        "grid_coefficients": {k: grid[k] for k in STEP_TERMS},
    }  # fmt: skip
    busy = [s for s in fitted if not s.get("idle")]
    if busy:
        loop = sum(g for _, g in gaps or [])
        measured = sum(s["measured_s"] for s in busy) + loop
        predicted = sum(s["predicted_s"] for s in busy) + sum(
            coefficients["loop_s"] + coefficients["loop_seq_s"] * n for n, _ in gaps or []
        )  # fmt: skip
        grid_only = sum(s["grid_model_s"] for s in busy) + loop
        residuals["served"] = {
            "median_rel_error": float(np.median([s["rel_error"] for s in busy])),
            "num_points": len(busy),
            # what a run's throughput sees: its steps and loop time added up, predicted over measured
            "total_error": float((predicted - measured) / measured),
            # the same with the grid model's steps (timed back to back): the serving loop's effect
            "grid_model_total_error": float((grid_only - measured) / measured),
        }
    # per regime and bucket, so opposite biases cannot cancel, on the steps the fit did not see;
    # a biased regime fails the profile
    residuals["by_regime"] = held_out_residuals(served)
    residuals["launch"] = launch_residuals(served)
    return coefficients, residuals


class OthersLoad:
    """The share of the machine's CPU time that other processes took while the profile ran:
    (all cores' busy time - this process's CPU time) / (wall time x cores), from /proc/stat
    (Linux); None elsewhere. The load average can't tell: by the profile's end its own threads
    dominate it, and at its start it still carries the previous command's."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> Optional[tuple[float, float, float]]:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)  # less idle and iowait
        t = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic()

    def share(self) -> Optional[float]:
        end = self._sample()
        if self.start is None or end is None:
            return None
        return others_share(end[0] - self.start[0], end[1] - self.start[1], end[2] - self.start[2], os.cpu_count() or 1)


def others_share(busy_s: float, own_cpu_s: float, wall_s: float, cores: int) -> float:
    """Other processes' share of `cores` over `wall_s`: the machine's busy CPU seconds less our own."""
    if wall_s <= 0:
        return 0.0
    return min(1.0, max(0.0, (busy_s - own_cpu_s) / (wall_s * cores)))


def machine() -> dict[str, Any]:
    """The machine and software the profile was measured on."""
    import jax
    import jaxlib

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "load_average": list(os.getloadavg()),
    }  # fmt: skip


def build_profile(cfg: RunConfig, shapes: ShapePlan, steps, swaps, coefficients, residuals, extra) -> dict[str, Any]:
    return {
        "made_for": profile_key(cfg.model, cfg.cache.page_size, cfg.scheduler.max_num_seqs),
        "num_pages": cfg.cache.num_pages,  # for the record: a run may use another page pool
        "model": cfg.model.name,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "token_buckets": list(shapes.token_buckets),
        "formula": "step + loop_s + loop_seq_s*requests, step = fixed(bucket) + iter_s + seq_s*rows + token_s*tokens"
        " + (single_chunk_s + single_chunk_token_s*bucket)*single_steps + (block_chunk_s + block_chunk_token_s*bucket)*block_steps"
        " + single_page_s*single_pages + block_page_s*block_pages, fixed(bucket) = served_bucket_s[bucket] where"
        " served, else bucket_scale*bucket_s[bucket] (+ cold_s, cold2_s, cold3_s or cold4_s on the 1st to 4th step"
        " after the last larger bucket's step)"
        " (+ swap_iter_s + swap_page_s*pages when the step swaps)"
        " (+ (wake_s + wake_token_s*tokens)*min(1, idle/wake_ramp_s) on the first step after the loop idled)",
        "coefficients": coefficients,
        "residuals": residuals,
        "steps": steps,
        "swaps": swaps,
        **extra,
    }


def plot_profile(path: Path, steps: list[dict], served: Sequence[dict] = ()) -> Path:
    """Predicted against measured step time: grid points one colour per batch kind, served
    iterations small and grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    if served:
        ax.scatter([1e3 * s["measured_s"] for s in served], [1e3 * s["predicted_s"] for s in served],
                   label="served", s=4, color="0.6", alpha=0.5)  # fmt: skip
    for kind in sorted({s["kind"] for s in steps}):
        pts = [s for s in steps if s["kind"] == kind]
        ax.scatter([1e3 * s["measured_s"] for s in pts], [1e3 * s["predicted_s"] for s in pts], label=kind, s=18)
    every = list(steps) + list(served)
    lo = 1e3 * min(min(s["measured_s"], s["predicted_s"]) for s in every)
    hi = 1e3 * max(max(s["measured_s"], s["predicted_s"]) for s in every)
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("profiled cost model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_profile(out_dir: Path, profile: dict[str, Any]) -> Path:
    """profile.png, then profile.json, atomically and last: a profile.json in `out_dir` is a
    whole profile, never one cut short by an interrupt or a full disk."""
    from cbjax.report.files import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    plot_profile(out_dir / "profile.png", profile["steps"], profile.get("served", ()))
    atomic_write_text(path, json.dumps(profile, indent=2) + "\n")
    return path
