"""A draft model's proposals in a simulated step's time (`spec.method=draft`; no jax).

Before a step, the draft model proposes its drafts in one device call, one pass of the draft
per draft, as the engine's drafter runs them (`cbjax.runtime.draft`):

- a separate draft model (`spec.draft_model`), with its own K/V, first runs the step's whole
  batch with the drafts left out (every row's tokens, prompts and chunks included, in every
  step that has rows, drafting or not: its K/V must hold every token the target's does), then
  pass j = 1 .. max(num_drafts) over the rows with at least j drafts, each one token at
  `num_computed + j` (the last pass writes the last draft's K/V, needed once it is accepted);
- the target's first layers (`spec.draft_layers`), which share the target's K/V, run
  max(num_drafts) passes, pass j over the rows with more than j drafts, each one token at
  `num_computed + j`.

The passes are priced with the draft's own architecture (`cbjax.config.spec.draft_model_config`)
by the roofline on the run's hardware, or, for the `profiled` model (fitted on the target
alone), as the target's step of the same rows scaled by the draft's share of the target's
parameters (`cbjax.sim.cost.make_cost_model` builds it).
"""

from __future__ import annotations

from typing import Callable

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.timing import NO_CONTEXT, StepContext, StepTime


def proposal_steps(plan: Schedule, separate: bool = False) -> list[Schedule]:
    """The draft model's passes before `plan`'s step (see the module docstring); `separate`: a
    draft model with K/V of its own."""
    rows = [s for s in plan.scheduled if s.num_drafts]
    out = []
    if separate and plan.scheduled:
        batch = [s._replace(num_new_tokens=s.num_new_tokens - s.num_drafts, num_drafts=0) for s in plan.scheduled]
        out.append(Schedule(plan.num_slots, batch, page_size=plan.page_size))
    first = 1 if separate else 0
    for j in range(first, max((s.num_drafts for s in rows), default=0) + first):
        step = [ScheduledRequest(s.request_id, s.slot, s.num_computed + j, 1, True)
                for s in rows if s.num_drafts + first > j]  # fmt: skip
        out.append(Schedule(plan.num_slots, step, page_size=plan.page_size))
    return out


class WithDraftModel:
    """`cost` plus the draft model's passes, each priced by `draft_step(plan)` seconds, as
    device time before the step; `separate`: a draft model with K/V of its own."""

    def __init__(self, cost, draft_step: Callable[[Schedule], float], separate: bool = False):
        self.cost = cost
        self.name = cost.name
        self.history = cost.history
        self.draft_step = draft_step
        self.separate = separate

    def draft_s(self, plan: Schedule) -> float:
        return sum(self.draft_step(step) for step in proposal_steps(plan, self.separate))

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        t = self.cost(plan, ctx)
        extra = self.draft_s(plan)
        if not extra:
            return t
        drain = t.drain_s + extra if t.drain_s is not None else None
        return t._replace(device_s=t.device_s + extra, drain_s=drain)  # the copies and launch as `cost` priced them
