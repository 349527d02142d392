"""Time an executor over the grid, time swap copies, fit the cost model, write profile.json and a plot.

`measure_steps` needs only the executor interface (`execute(plan) -> StepOutput`), so a synthetic
executor with hand-set costs checks the fit; the swap timing needs the JAX engine's `HostSwap`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from cbjax.config import RunConfig
from cbjax.profile.grid import GridPoint, build_schedule
from cbjax.request import Request
from cbjax.runtime.shapes import ShapePlan
from cbjax.sim.fit import fit_costs, relative_errors
from cbjax.sim.profiled import STEP_TERMS, SWAP_TERMS, bucket_intercept, predict, profile_key, step_features


def measure_steps(execute: Callable, points: list[GridPoint], shapes: ShapePlan, num_pages: int, vocab_size: int,
                  repeats: int) -> list[dict[str, Any]]:  # fmt: skip
    """Per grid point: its features and the median (and range) of `repeats` step durations, after
    one untimed call (a new batch rewrites the packer's per-slot buffers; a steady run does not)."""
    plans = [build_schedule(p, shapes, num_pages, vocab_size) for p in points]
    times: list[list[float]] = []
    for plan in plans:
        execute(plan)
        times.append([execute(plan).duration_s for _ in range(repeats)])
    out = []
    for point, plan, ts in zip(points, plans, times):
        tokens = sum(n for n, _ in point.rows)
        out.append({
            "kind": point.kind, "rows": len(point.rows), "tokens": tokens, "bucket": shapes.bucket(tokens),
            "features": step_features(plan.cost_rows(), shapes)[1],
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
                req = Request("swap", 0.0, 1)
                t0 = time.perf_counter()
                swap.swap_out(executor.cache, [(req, pages)])
                if direction == "in":
                    t0 = time.perf_counter()
                    executor.cache = swap.swap_in(executor.cache, [(req, pages)])
                    executor.cache.k.block_until_ready()
                else:
                    swap._host.clear()
                times.append(time.perf_counter() - t0)
            out.append({"direction": direction, "pages": count, "measured_s": statistics.median(times)})
    return out


def measure_buckets(run_empty: Callable[[int], float], buckets: Sequence[int], repeats: int) -> dict[int, float]:
    """Each bucket's fixed cost: the median seconds of `run_empty(bucket)`, its program run on an
    all-padding batch (no rows, no tiles), after one untimed call."""
    out = {}
    for b in buckets:
        run_empty(b)
        out[b] = statistics.median(run_empty(b) for _ in range(repeats))
    return out


def engine_empty_step(executor) -> Callable[[int], float]:
    """`run_empty` for the JAX engine: one step on `packer.empty(bucket)`, read back to the host."""

    def run(bucket: int) -> float:
        batch = executor.packer.empty(bucket)
        t0 = time.perf_counter()
        np.asarray(executor._step(batch))
        return time.perf_counter() - t0

    return run


def measure_loop(executor, cfg: RunConfig) -> dict[str, Any]:
    """The serving loop's time per iteration outside `execute` (scheduling, postprocess, stats),
    which the engine's wall clock pays and a simulated step does not: fcfs serves 2 x slots short
    requests, all at t=0, on the engine; (makespan - time in execute) / iterations."""
    from cbjax.config import LengthConfig, WorkloadConfig
    from cbjax.engine import serve
    from cbjax.scheduler import Scheduler
    from cbjax.workload import build_workload

    length = cfg.model.max_model_len
    wl = WorkloadConfig(
        num_requests=2 * cfg.scheduler.max_num_seqs, vocab_size=cfg.model.vocab_size,
        prompt_len=LengthConfig(dist="uniform", low=4, high=max(4, length // 8)),
        output_len=LengthConfig(dist="uniform", low=4, high=max(4, min(64, length // 4))),
    )  # fmt: skip
    sched = dataclasses.replace(cfg.scheduler, name="fcfs")
    scheduler = Scheduler(sched, cfg.cache, length, validate=executor.validate)
    result = serve(build_workload(wl, cfg.seed), scheduler, executor)
    iters = result.stats.iterations
    loop_s = max(0.0, (result.makespan_s - result.stats.busy_s) / iters) if iters else 0.0
    return {"iterations": iters, "makespan_s": result.makespan_s, "execute_s": result.stats.busy_s, "loop_s": loop_s}


def fit_profile(
    steps: list[dict], swaps: list[dict], bucket_s: dict[int, float], loop_s: float = 0.0
) -> tuple[dict[str, Any], dict[str, float]]:
    """(coefficients, residuals): the timed bucket costs, the STEP_TERMS fitted on top of them and
    the swap terms, each fitted non-negative on relative error."""
    x = [s["features"] for s in steps]
    y = [s["measured_s"] for s in steps]
    coef = fit_costs(x, y, offsets=[bucket_intercept(bucket_s, s["bucket"]) for s in steps])
    coefficients: dict[str, Any] = {"bucket_s": {str(b): float(v) for b, v in sorted(bucket_s.items())}}
    coefficients.update({k: float(c) for k, c in zip(STEP_TERMS, coef)})
    predicted = [predict({**coefficients, "bucket_s": bucket_s}, s["bucket"], s["features"]) for s in steps]
    err = relative_errors(predicted, y)
    for s, p, e in zip(steps, predicted, err):
        s["predicted_s"] = float(p)
        s["rel_error"] = float(e)
    swap_coef = fit_costs([[1.0, s["pages"]] for s in swaps], [s["measured_s"] for s in swaps]) if swaps else [0.0, 0.0]
    coefficients.update({k: float(c) for k, c in zip(SWAP_TERMS, swap_coef)})
    coefficients["loop_s"] = float(loop_s)
    residuals = {"median_rel_error": float(np.median(err)), "max_rel_error": float(np.max(err)), "num_points": len(y)}
    return coefficients, residuals


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
        "made_for": profile_key(cfg.model, cfg.cache.page_size, cfg.scheduler.max_num_seqs, cfg.cache.num_pages),
        "model": cfg.model.name,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "token_buckets": list(shapes.token_buckets),
        "formula": "bucket_s[bucket] + iter_s + seq_s*rows + (single_chunk_s + single_chunk_token_s*bucket)"
        "*single_steps + (block_chunk_s + block_chunk_token_s*bucket)*block_steps"
        " (+ swap_iter_s + swap_page_s*pages when the step swaps) + loop_s",
        "coefficients": coefficients,
        "residuals": residuals,
        "steps": steps,
        "swaps": swaps,
        **extra,
    }


def plot_profile(path: Path, steps: list[dict]) -> Path:
    """Predicted against measured step time, one colour per batch kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for kind in sorted({s["kind"] for s in steps}):
        pts = [s for s in steps if s["kind"] == kind]
        ax.scatter([1e3 * s["measured_s"] for s in pts], [1e3 * s["predicted_s"] for s in pts], label=kind, s=18)
    lo = 1e3 * min(min(s["measured_s"], s["predicted_s"]) for s in steps)
    hi = 1e3 * max(max(s["measured_s"], s["predicted_s"]) for s in steps)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    plot_profile(out_dir / "profile.png", profile["steps"])
    return path
