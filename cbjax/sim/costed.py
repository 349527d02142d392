"""An executor timed by a cost model: the real engine's steps and tokens on a virtual clock.

`CostTimed(engine, cost)` runs every step on `engine` (its tokens, its K/V) while the loop's
time is `cost`'s, laid out by a `Timeline` as the simulator's is. A run through it makes
exactly the simulator's scheduling decisions on the same arrivals (when the tokens end
requests where the simulator's lengths do: `ignore_eos`), so a cluster of engines on it
routes every request as the simulated cluster does (`tests/test_cluster_decisions.py`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cbjax.core.executor import Executor
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request
from cbjax.core.timing import CostModel
from cbjax.sim.timeline import Timeline


class CostTimed:
    """`engine`'s steps, one at a time, on `cost`'s clock."""

    virtual_clock = True
    pipelined = False

    def __init__(self, engine: Executor, cost: CostModel):
        self.engine, self.cost = engine, cost
        self.reads_token_ids = engine.reads_token_ids

    def timeline(self) -> Timeline:
        return Timeline(self.cost)

    def validate(self, req: Request) -> Optional[str]:
        return self.engine.validate(req)

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        self.engine.warmup(sampling=sampling, kv_transfer=kv_transfer)

    def restart_compile_count(self) -> None:
        self.engine.restart_compile_count()

    def execute(self, plan: Schedule) -> StepOutput:
        return self.engine.execute(plan)

    def launch(self, plan: Schedule) -> Any:
        return self.engine.launch(plan)

    def collect(self, launched: Any) -> StepOutput:
        return self.engine.collect(launched)

    def export_kv(self, pages: Sequence[int]) -> Any:
        return self.engine.export_kv(pages)

    def import_kv(self, request_id: str, kv: Any) -> None:
        self.engine.import_kv(request_id, kv)

    def metrics(self) -> dict[str, Any]:
        return self.engine.metrics()

    def host_load_times(self) -> tuple[float, float]:
        return self.engine.host_load_times()

    def close(self) -> None:
        self.engine.close()
