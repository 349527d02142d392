"""One profiling run: build the JAX engine for a config, warm it up, time the grid and swaps, fit, write."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from cbjax.config import RunConfig
from cbjax.profile.grid import GRIDS, profile_grid
from cbjax.profile.served_fit import SERVED_WEIGHTINGS


@dataclass
class ProfileRunConfig(RunConfig):
    """The `cbjax` run config plus the profile's own knobs (Hydra config `configs/profile.yaml`)."""

    grid: str = "full"  # full | small (a few points, for tests)
    # pin the profile to the first N CPUs this process may use (`cbjax.profile.pinning`): the
    # profile then describes the engine run so; null: unpinned
    cores: Optional[int] = None
    repeats: int = 5  # timed calls per grid point; the median is fitted
    # times the served workloads are served, each round with its own requests and arrivals; the
    # odd rounds are held out of the fit and the residual table is computed on them alone
    # (`cbjax.profile.serving.held_out_round`)
    serving_rounds: int = 4
    # ... or more, in whole cycles of 4, until the rounds take about this many seconds (estimated
    # from round 0; `cbjax.profile.serving.serving_round_count`): a tiny model's runs last about a
    # second each, so four rounds measure four moments of the machine; 0: serving_rounds exactly
    serving_min_s: float = 40.0
    # the CPU term set: what a CPU's threads and caches add to a step after the loop idled (the
    # wake) and in the steps after a larger one (the cold terms), and the prefill step's compute
    # that holds the core a prefill plan's launch needs (the held terms); null:
    # measured and fitted when the engine runs on a CPU, left 0 on an accelerator
    cpu_terms: Optional[bool] = None
    # with the CPU term set on, fit the cold terms (a served step's extra cost 1-4 steps after a
    # larger bucket's) on the served steps, beside the intercepts and the served step terms; off:
    # they stay 0
    fit_cold: bool = True
    # fit the per-row, per-page and per-block-step terms on the served steps beside their intercepts
    # (cbjax.profile.served_fit.SERVED_STEP_TERMS); off: the grid's
    served_terms: bool = True
    # how the served fit weighs its steps (cbjax.profile.served_fit.SERVED_WEIGHTINGS): mean_relative
    # makes each served bucket's mean signed relative error zero (what the residual table
    # reports), absolute fits the steps' summed time (what a run's makespan adds up), balanced
    # takes the mean of the two fits (each criterion then off by half of what parts them).
    # mean_relative by default: the long tail of served step times on a shared VM is spells of
    # the machine (streaks of slow steps), which the anchor keeps out of the calibration's
    # judged runs too (`cbjax.profile.anchor`); a fit on the summed time prices them into every step
    served_weighting: str = "mean_relative"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grid not in GRIDS:
            raise ValueError(f"grid: unknown value {self.grid!r}; choose one of {', '.join(GRIDS)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats!r}")
        if self.serving_rounds < 1:
            raise ValueError(f"serving_rounds must be >= 1, got {self.serving_rounds!r}")
        if not self.serving_min_s >= 0:
            raise ValueError(f"serving_min_s must be >= 0 seconds, got {self.serving_min_s!r}")
        if self.served_weighting not in SERVED_WEIGHTINGS:
            raise ValueError(
                f"served_weighting: unknown value {self.served_weighting!r}; choose one of {', '.join(SERVED_WEIGHTINGS)}"
            )
        if self.executor.name != "jax":
            raise ValueError(f"executor.name: the profile times the engine (executor=jax), got {self.executor.name!r}")


def executor_backend() -> str:
    """The platform the engine's jax runs on: cpu, gpu or tpu."""
    import jax

    return jax.default_backend()


def run_profile(cfg: ProfileRunConfig, out_dir: Path) -> dict[str, Any]:
    """Profile the engine `cfg` describes; writes profile.json and profile.png to `out_dir`.
    With `cfg.cores`, the process is pinned first (before jax starts)."""
    from cbjax.profile.pinning import pin

    pinning = pin(cfg.cores)
    from cbjax.profile.measure import (
        OthersLoad, build_profile, engine_empty_step, fit_profile, machine, measure_buckets, measure_steps,
        measure_swaps, wall_time_of, write_profile,
    )  # fmt: skip
    from cbjax.profile.copies import measure_served_copies
    from cbjax.profile.grid import build_schedule
    from cbjax.profile.serving import measure_serving
    from cbjax.profile.wake import measure_served_wake, measure_wake, merge_wake
    from cbjax.app.run import build_executor, resolve

    t0 = time.perf_counter()
    load_at_start = list(os.getloadavg())
    others = OthersLoad()  # other processes' CPU while the profile runs (the load average mixes in its own)
    cfg = resolve(cfg)
    executor = build_executor(cfg)
    executor.warmup(sampling=False)  # every request the profile serves is greedy: no sampler to compile
    warmup_s = time.perf_counter() - t0
    shapes = executor.shapes
    say = print if cfg.progress else (lambda *a, **k: None)
    points = profile_grid(shapes, cfg.model.max_model_len, cfg.grid, cfg.spec.num_tokens if cfg.spec.enabled else 0)
    say(f"timing {len(points)} grid steps x {cfg.repeats} ...", flush=True)
    native = executor.attention == "native"  # its decode pass is costed per group, not per loop step
    steps = measure_steps(
        wall_time_of(executor.execute), points, shapes, cfg.cache.num_pages, cfg.model.vocab_size, cfg.repeats, native
    )
    bucket_s = measure_buckets(engine_empty_step(executor), shapes.token_buckets, cfg.repeats)
    say("timing swap copies ...", flush=True)
    swaps = measure_swaps(executor, cfg.repeats)
    cpu_terms = executor_backend() == "cpu" if cfg.cpu_terms is None else cfg.cpu_terms
    wake = None
    if cpu_terms:
        say("timing steps after an idle loop ...", flush=True)
        small = sorted(
            (p for p in points if sum(n for n, _ in p.rows) <= 4 * shapes.num_rows), key=lambda p: sum(n for n, _ in p.rows)
        )
        wake_plans = [
            build_schedule(p, shapes, cfg.cache.num_pages, cfg.model.vocab_size) for p in small[:: max(1, len(small) // 3)]
        ]
        wake = measure_wake(executor.execute, wake_plans, cfg.repeats)
    say("serving the profile's workloads (and lone requests after an idle loop) ...", flush=True)
    lone: list[dict] = []  # each serving round's lone requests after an idle loop (the wake's fit)
    serving = measure_serving(
        executor, cfg, shapes, cfg.serving_rounds, native, min_s=cfg.serving_min_s,
        each_round=(lambda r: lone.append(measure_served_wake(executor, cfg, r))) if cpu_terms else None,
    )  # fmt: skip
    served_wake = merge_wake(lone)
    copies = []
    if not cfg.spec.enabled:  # a speculating engine's copies move its draft pool too: timed alone
        say("timing the host tier's copies while serving ...", flush=True)
        copies = measure_served_copies(executor, cfg)
    coefficients, residuals = fit_profile(
        steps, swaps, bucket_s, serving["steps"], serving["gaps"], wake, fit_cold=cpu_terms and cfg.fit_cold,
        served_terms=cfg.served_terms, served_weighting=cfg.served_weighting, copies=copies,
        served_wake=served_wake, shapes=shapes, native=native, fit_held=cpu_terms,
    )
    extra = {
        "attention": executor.attention,
        "matmul": executor.matmul,
        "machine": {**machine(), "load_average_at_start": load_at_start, "others_cpu_share": others.share()},
        "serving": serving["runs"],
        "anchor": serving["anchor"],
        "wake": wake,
        "served_wake": served_wake,
        "served": serving["steps"],
        "grid": cfg.grid,
        "repeats": cfg.repeats,
        "serving_rounds": serving["rounds"],  # served, not asked for (`serving_min_s` may add rounds)
        "serving_min_s": cfg.serving_min_s,
        "gaps": serving["gaps"],
        "served_copies": copies,
        "cpu_terms": cpu_terms,
        "pinning": pinning,
        "fit_cold": cpu_terms and cfg.fit_cold,
        "served_terms": cfg.served_terms,
        "served_weighting": cfg.served_weighting,
        "warmup_s": warmup_s,
        "profile_s": time.perf_counter() - t0,
        "config": dataclasses.asdict(cfg.executor),
    }
    profile = build_profile(cfg, shapes, steps, swaps, coefficients, residuals, extra)
    write_profile(out_dir, profile)
    return profile
