"""A draft model's proposals in a simulated step's time (`spec.method=draft`; no jax).

Before a step whose decodes verify drafts, the draft model proposes them: `max(num_drafts)`
sequential decode steps of the draft, step j over the rows with more than j drafts, each row
one token at context `num_computed + j` (the proposals run in one device call, one step of the
draft per draft). Those steps are priced with the draft's own architecture
(`cbjax.config.spec.draft_model_config`: `spec.draft_model`'s config, or the target's first
`spec.draft_layers` layers and its head): by the roofline on the run's hardware, or, for the
`profiled` model (fitted on the target alone), as the target's step of the same rows scaled by
the draft's share of the target's parameters (`cbjax.sim.cost.make_cost_model` builds it).
"""

from __future__ import annotations

from typing import Callable

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.timing import NO_CONTEXT, StepContext, StepTime


def proposal_steps(plan: Schedule) -> list[Schedule]:
    """The draft model's decode steps before `plan`'s step (see the module docstring)."""
    rows = [s for s in plan.scheduled if s.num_drafts]
    out = []
    for j in range(max((s.num_drafts for s in rows), default=0)):
        step = [ScheduledRequest(s.request_id, s.slot, s.num_computed + j, 1, True) for s in rows if s.num_drafts > j]
        out.append(Schedule(plan.num_slots, step, page_size=plan.page_size))
    return out


class WithDraftModel:
    """`cost` plus the draft model's proposal steps, each priced by `draft_step(plan)` seconds,
    as device time before the step."""

    def __init__(self, cost, draft_step: Callable[[Schedule], float]):
        self.cost = cost
        self.name = cost.name
        self.history = cost.history
        self.draft_step = draft_step

    def draft_s(self, plan: Schedule) -> float:
        return sum(self.draft_step(step) for step in proposal_steps(plan))

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        t = self.cost(plan, ctx)
        extra = self.draft_s(plan)
        if not extra:
            return t
        drain = t.drain_s + extra if t.drain_s is not None else None
        return t._replace(device_s=t.device_s + extra, drain_s=drain)  # the copies and launch as `cost` priced them
