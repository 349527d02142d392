"""SimExecutor: runs a schedule on a virtual clock; each request generates its target length."""

from __future__ import annotations

from cbjax.core.executor import SyncExecutor
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.timing import CostModel
from cbjax.sim.timeline import Timeline

_NO_TOKENS = StepOutput(None)


class SimExecutor(SyncExecutor):
    """The simulator side of the executor interface: tokens are not materialised (None), and
    the steps' time is `cost_model`'s, laid out by a `Timeline`.

    `pipelined`: the loop plans step t + 1 while step t runs, as the engine does with
    `executor.async_scheduling` (`cbjax.sim.timeline`): a request arriving during step t waits
    for step t + 1, already planned, before its own. The `profiled` cost model predicts that
    engine and turns it on (`cbjax.app.run.build_executor`)."""

    virtual_clock = True

    def __init__(self, cost_model: CostModel, pipelined: bool = False):
        self.cost_model = cost_model
        self.pipelined = pipelined

    def timeline(self) -> Timeline:
        return Timeline(self.cost_model)

    def execute(self, plan: Schedule) -> StepOutput:
        return _NO_TOKENS
