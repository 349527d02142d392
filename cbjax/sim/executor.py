"""SimExecutor: runs a schedule on a virtual clock; each request generates its target length."""

from __future__ import annotations

from typing import Callable, Optional

from cbjax.plan import Schedule, StepOutput
from cbjax.request import Request


class SimExecutor:
    """The simulator side of the executor interface. Tokens are not materialised (None)."""

    virtual_clock = True

    def __init__(self, cost_model: Callable[[Schedule], float]):
        self.cost_model = cost_model

    def validate(self, req: Request) -> Optional[str]:
        return None

    def warmup(self) -> None:
        """Nothing to compile."""

    def execute(self, plan: Schedule) -> StepOutput:
        return StepOutput(token_ids=None, duration_s=self.cost_model(plan))
