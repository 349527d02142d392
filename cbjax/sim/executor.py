"""SimExecutor: runs a schedule on a virtual clock; each request generates its target length."""

from __future__ import annotations

from typing import Optional

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
    engine and turns it on (`cbjax.app.run.build_executor`).

    `acceptance` (speculative decoding, `cbjax.sim.acceptance`): how many of each decode's
    drafts are accepted, asked per request and decode step, which this executor counts."""

    virtual_clock = True

    def __init__(self, cost_model: CostModel, pipelined: bool = False, acceptance: Optional[object] = None):
        self.cost_model = cost_model
        self.pipelined = pipelined
        self.acceptance = acceptance
        self._decode_steps: dict[str, int] = {}  # request id -> its decode steps so far

    def timeline(self) -> Timeline:
        return Timeline(self.cost_model)

    def execute(self, plan: Schedule) -> StepOutput:
        if self.acceptance is None:
            return _NO_TOKENS
        steps, accepted = self._decode_steps, None
        for i, row in enumerate(plan.scheduled):
            if not row.is_decode:
                break  # decodes come first
            rid = row.request_id
            j = steps.get(rid, 0)
            steps[rid] = j + 1
            if row.num_drafts:
                if accepted is None:
                    accepted = [0] * len(plan.scheduled)
                accepted[i] = self.acceptance.accepted(rid, j, row.num_drafts)
        return _NO_TOKENS if accepted is None else StepOutput(None, num_accepted=accepted)
