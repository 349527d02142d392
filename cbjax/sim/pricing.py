"""A run's step prices for the scheduler's own choices (the `goodput` speculation policy), and
the run's scheduler built with them (no jax)."""

from __future__ import annotations

from typing import Callable, Optional

from cbjax.config import RunConfig
from cbjax.core.plan import Schedule
from cbjax.scheduler.core import Scheduler


def build_scheduler(cfg: RunConfig, executor) -> Scheduler:
    """The scheduler of a run of `cfg` on `executor`: requests checked by `executor.validate`,
    ended by the model's stop token, drafting as `cfg.spec` says, priced by `step_pricer`."""
    return Scheduler(
        cfg.scheduler, cfg.cache, cfg.model.max_model_len, validate=executor.validate,
        eos_token_id=cfg.model.eos_token_id, vocab_size=cfg.model.vocab_size, spec=cfg.spec,
        step_cost=step_pricer(cfg, executor), extra_eos_token_ids=cfg.model.extra_eos_token_ids,
    )  # fmt: skip


def step_pricer(cfg: RunConfig, executor) -> Optional[Callable[[Schedule], float]]:
    """`plan -> seconds` for a run of `cfg` on `executor` while speculating, else None: the
    simulator's own cost model; for the engine, the profiled model where `executor.profile`
    names a profile of it, else the roofline of the run's model and hardware (both with the
    draft model's proposals, `cbjax.sim.drafting`)."""
    if not cfg.spec.enabled:
        return None
    cost = getattr(executor, "cost_model", None) if executor.virtual_clock else None
    if cost is None:
        from cbjax.sim.cost import make_cost_model

        name = "profiled" if cfg.executor.profile else "roofline"
        cost = make_cost_model(
            name, cfg.model, cfg.hardware, scheduler=cfg.scheduler, cache=cfg.cache, executor=cfg.executor,
            overhead=cfg.overhead, spec=cfg.spec,
        )  # fmt: skip
    return lambda plan: cost(plan).total_s
