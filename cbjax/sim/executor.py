"""SimExecutor: runs a schedule on a virtual clock; each request generates its target length."""

from __future__ import annotations

from typing import Callable

from cbjax.executor import SyncExecutor
from cbjax.plan import Schedule, StepOutput


class SimExecutor(SyncExecutor):
    """The simulator side of the executor interface. Tokens are not materialised (None)."""

    virtual_clock = True

    def __init__(self, cost_model: Callable[[Schedule], float]):
        self.cost_model = cost_model

    def execute(self, plan: Schedule) -> StepOutput:
        return StepOutput(None, self.cost_model(plan))  # token_ids, duration_s (positional: once per step)
