"""SimExecutor: runs a schedule on a virtual clock; each request generates its target length."""

from __future__ import annotations

from typing import Callable

from cbjax.core.executor import SyncExecutor
from cbjax.core.plan import Schedule, StepOutput


class SimExecutor(SyncExecutor):
    """The simulator side of the executor interface. Tokens are not materialised (None).

    `pipelined`: the loop plans step t + 1 while step t runs, as the engine does with
    `executor.async_scheduling` (`cbjax.engine.loop.EngineLoop._launch_virtual`): a request arriving
    during step t waits for step t + 1, already planned, before its own. The `profiled` cost
    model predicts that engine and turns it on (`cbjax.app.run.build_executor`)."""

    virtual_clock = True

    def __init__(self, cost_model: Callable[[Schedule], float], pipelined: bool = False):
        self.cost_model = cost_model
        self.pipelined = pipelined
        # a cost model that knows a step's launch time (`profiled`) delays the step in flight
        self._launch = getattr(cost_model, "launch_s", None) if pipelined else None
        # and one that knows a step's share when nothing is launched behind it shortens that step
        self._drain = getattr(cost_model, "drain_s", None) if pipelined else None

    def execute(self, plan: Schedule) -> StepOutput:
        if self._launch is not None:
            duration = self.cost_model(plan)
            drain = self._drain(plan) if self._drain is not None else None
            return StepOutput(None, duration, launch_s=self._launch(plan), drain_s=drain)
        return StepOutput(None, self.cost_model(plan))  # token_ids, duration_s (positional: once per step)
