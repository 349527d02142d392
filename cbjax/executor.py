"""The executor interface shared by the simulator and the JAX engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from cbjax.request import Request
from cbjax.scheduler.core import Schedule


@dataclass
class StepOutput:
    """One iteration's result: a token per scheduled request (`Schedule.requests` order), or
    None when tokens are simulated, and the iteration's duration on the executor's clock.

    `errors` maps an index into `plan.requests` to why that request's step failed (e.g. its
    logits were not finite): the scheduler ends it with finish_reason `error` and its token
    is discarded; the others go on."""

    token_ids: Optional[Sequence[int]]
    duration_s: float
    errors: Optional[dict[int, str]] = None


class Executor(Protocol):
    # True: time advances by `duration_s` (simulation). False: the loop reads the wall clock.
    virtual_clock: bool

    def validate(self, req: Request) -> Optional[str]:
        """Executor-specific reason to reject a request (e.g. a token id out of vocabulary)."""

    def warmup(self) -> None:
        """Compile every shape before the clock starts."""

    def execute(self, plan: Schedule) -> StepOutput:
        """Run one iteration of the plan."""
