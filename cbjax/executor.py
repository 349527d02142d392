"""The executor interface shared by the simulator and the JAX engine."""

from __future__ import annotations

from typing import Optional, Protocol

from cbjax.plan import Schedule, StepOutput
from cbjax.request import Request

__all__ = ["Executor", "Schedule", "StepOutput"]


class Executor(Protocol):
    # True: time advances by `duration_s` (simulation). False: the loop reads the wall clock.
    virtual_clock: bool

    def validate(self, req: Request) -> Optional[str]:
        """Executor-specific reason to reject a request (e.g. a token id out of vocabulary)."""

    def warmup(self) -> None:
        """Compile every shape before the clock starts."""

    def execute(self, plan: Schedule) -> StepOutput:
        """Run one iteration of the plan."""
