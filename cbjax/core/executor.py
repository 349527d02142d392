"""The executor contract shared by the simulator and the JAX engine (no jax here).

`EngineLoop` (cbjax.engine.loop) and the run layer call an executor only through these methods.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol, runtime_checkable

from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request

__all__ = ["Executor", "Launched", "Schedule", "StepOutput", "SyncExecutor"]


@runtime_checkable
class Launched(Protocol):
    """A step dispatched by `Executor.launch`, its tokens not read yet."""

    start: float  # time.perf_counter() at launch


@runtime_checkable
class Executor(Protocol):
    # True: time advances by `duration_s` (simulation). False: the loop reads the wall clock.
    virtual_clock: bool
    # True: the loop may launch step t+1 before it collects step t (`launch`/`collect`).
    pipelined: bool
    # True: plans must carry token ids (`ScheduledRequest.token_ids`); a simulator reads none.
    reads_token_ids: bool

    def validate(self, req: Request) -> Optional[str]:
        """Executor-specific reason to reject a request (e.g. a token id out of vocabulary)."""

    def warmup(self) -> None:
        """Compile every shape before the clock starts."""

    def execute(self, plan: Schedule) -> StepOutput:
        """Run one iteration of the plan to completion."""

    def launch(self, plan: Schedule) -> Launched:
        """Dispatch one iteration and return at once; `collect` reads its result."""

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched iteration's result."""

    def metrics(self) -> dict[str, Any]:
        """The executor's counters for summary.json (may be empty)."""

    def close(self) -> None:
        """Release what the executor holds (other processes of a multi-host run stop stepping)."""


class SyncLaunched:
    """`SyncExecutor.launch`'s handle: the step already ran."""

    __slots__ = ("out", "start")

    def __init__(self, out: StepOutput, start: float):
        self.out, self.start = out, start


class SyncExecutor:
    """A base for executors that run each step to completion in `execute` (the simulator, test
    doubles): `launch` runs it, `collect` returns its result; nothing to warm up, count or close."""

    virtual_clock = True
    pipelined = False
    reads_token_ids = False

    def validate(self, req: Request) -> Optional[str]:
        return None

    def warmup(self) -> None:
        """Nothing to compile."""

    def execute(self, plan: Schedule) -> StepOutput:
        raise NotImplementedError

    def launch(self, plan: Schedule) -> SyncLaunched:
        start = time.perf_counter()
        return SyncLaunched(self.execute(plan), start)

    def collect(self, launched: SyncLaunched) -> StepOutput:
        return launched.out

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing held."""
