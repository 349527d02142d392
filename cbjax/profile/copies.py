"""The host KV tier's copies timed where a run pays for them, and the tier's copy terms fitted
on them (no jax at import).

`cbjax.profile.measure.measure_swaps` times swap copies alone, back to back on an idle engine.
While serving, a step's tier copies run between steps, often the first device calls after the
loop idled, and on a CPU they cost several times that, as a served step costs more than the
same step timed back to back (`cbjax.profile.served_fit`). `measure_served_copies` serves a
small multi-turn workload with the host tier on the warm engine, its device pool small enough
that turns store pages to the host and load them back, and records each step's copies;
`fit_served_copies` fits the tier's terms (`swap_out_*`, `swap_in_*`, as `cbjax.sim.profiled`
prices a step's stores and loads) on them. Preemption's swap terms (`swap_iter_s`,
`swap_page_s`) stay those timed alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cbjax.config import LengthConfig, PauseConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.profile.fit import fit_costs
from cbjax.sim.profiled import SWAP_DIRECTION_TERMS

# steps of each direction (storing, loading) the fit needs; with fewer, the terms timed alone stay
MIN_SERVED_COPIES = 8
SESSIONS = 20  # the served workload's conversations, 3-5 turns each
HOST_PAGES = 256


def served_copies_config(cfg: RunConfig) -> RunConfig:
    """The profile's run `cfg` serving SESSIONS conversations at 6 a second, 3-5 turns each (a
    turn adds up to max_model_len / 16 tokens and generates up to 32), pauses of 0.4 s on
    average, under fcfs with the prefix cache on, a device pool of half a context and 4 pages
    and HOST_PAGES host pages: later turns find their history in the host tier."""
    ctx, ps = cfg.model.max_model_len, cfg.cache.page_size
    workload = WorkloadConfig(
        name="sessions", num_sessions=SESSIONS, arrival="poisson", rate=6.0, vocab_size=cfg.model.vocab_size,
        turns=LengthConfig(dist="uniform", low=3, high=5, max=5),
        prompt_len=LengthConfig(dist="uniform", low=8, high=max(8, ctx // 16), max=max(8, ctx // 16)),
        output_len=LengthConfig(dist="uniform", low=4, high=min(32, max(4, ctx // 16))),
        pause=PauseConfig(dist="exponential", mean=0.4, max=3.0),
    )  # fmt: skip
    pages = min(-(-ctx // ps) // 2 + 4, cfg.cache.num_pages)
    cache = dataclasses.replace(cfg.cache, num_pages=pages, prefix_caching=True, host_pages=HOST_PAGES)
    scheduler = SchedulerConfig(name="fcfs", max_num_seqs=cfg.scheduler.max_num_seqs,
                                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens)  # fmt: skip
    return dataclasses.replace(cfg, workload=workload, cache=cache, scheduler=scheduler, seed=cfg.seed + 1)


def measure_served_copies(executor, cfg: RunConfig) -> list[dict[str, Any]]:
    """Each step's host-tier copies while the warm JAX engine `executor` serves
    `served_copies_config(cfg)` (twice: the first compiles the copy widths it meets, the second
    is timed): {"stores", "loads" (pages), "measured_s" (seconds of the step's copies)}. The
    engine's own tier, if any, is put back afterwards."""
    from cbjax.profile.serving import serve_timed
    from cbjax.runtime.host_tier import HostPages

    run_cfg = served_copies_config(cfg)
    tier = HostPages(executor._swap)
    before = executor._host_tier
    executor._host_tier = tier
    try:
        serve_timed(executor, run_cfg)
        tier.timings = []
        serve_timed(executor, run_cfg)
    finally:
        executor._host_tier = before
    return [{"stores": s, "loads": n, "measured_s": t} for s, n, t in tier.timings]


def fit_served_copies(rows: list[dict[str, Any]]) -> dict[str, float]:
    """SWAP_DIRECTION_TERMS fitted on served copies (`measure_served_copies`'s rows) as the
    profiled model prices them: per direction a fixed cost when the step copies that way and a
    cost per page; non-negative, on absolute error (a run pays their sum). Empty when fewer than
    MIN_SERVED_COPIES steps stored or loaded: the terms timed alone stay."""
    if sum(1 for r in rows if r["stores"]) < MIN_SERVED_COPIES or sum(1 for r in rows if r["loads"]) < MIN_SERVED_COPIES:
        return {}
    features = [[float(r["stores"] > 0), r["stores"], float(r["loads"] > 0), r["loads"]] for r in rows]
    coef = fit_costs(features, [r["measured_s"] for r in rows], relative=False)
    return {k: float(c) for k, c in zip(SWAP_DIRECTION_TERMS, coef)}
