"""A step's time: what a cost model returns, and the context the timeline gives it (no jax).

A cost model is a pure function `cost(plan, ctx) -> StepTime`: the same plan in the same
context costs the same whatever was costed before. What the system under study carries from
one step to the next (a step still in flight when the next is launched, an idle wait before
it) reaches the model only through `StepContext`, which the one timeline that owns the
virtual clock fills in (`cbjax.sim.timeline.Timeline`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, runtime_checkable

from cbjax.core.plan import Schedule


class StepContext(NamedTuple):
    """What a step meets when it is launched, as its timeline saw it. (A named tuple: one is
    made per step, and a frozen dataclass costs several times more to build.)"""

    # rows of the step still running when this one is launched (a pipelined loop plans a step
    # while the one before it runs); 0: nothing in flight
    in_flight_rows: int = 0
    # how long the loop waited for an arrival, idle, before planning this step; 0: it did not
    idle_s: float = 0.0
    # the batched tokens of the steps before this one, latest first, as many as the cost model
    # asks for (`CostModel.history`); empty for a model that asks for none
    recent_tokens: tuple[int, ...] = ()


NO_CONTEXT = StepContext()


class StepTime(NamedTuple):
    """One step's seconds, by where they are spent (a named tuple: one is made per step).

    Run to completion, a step takes `total_s`: its device work, the KV copies before it, and
    the serving stack's host time around it. A pipelined loop also needs `launch_s`, its host
    time from collecting the step before to launching this one (the step in flight ends no
    earlier), `drain_s`, the step's share when it is collected with nothing launched
    behind it (None: its whole `total_s`), and `collect_share`: the step in flight is collected
    no earlier than this share of its own `device_s` after this step's launch returns (the
    work it still owes when the launch held the hardware it runs on). `held_s`: what the
    launch takes more when a step is in flight, where the host and the device share a CPU core
    (0 elsewhere): there the step's compute and the host's work take turns on it, whether the
    step call runs the step in its place (it finds the device idle) or queues it.

    The host KV tier's copies (`Schedule.host_copies`): its stores and loads are in `copy_s`,
    the loads' share also in `load_s`; its prefetches take `prefetch_s`, beside the step on the
    copy engine and not in `total_s` (the timeline keeps a prefetched page from being read
    before its copy ends)."""

    device_s: float
    host_s: float = 0.0
    copy_s: float = 0.0
    launch_s: float = 0.0
    drain_s: Optional[float] = None
    load_s: float = 0.0
    prefetch_s: float = 0.0
    collect_share: float = 0.0
    held_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.device_s + self.copy_s + self.host_s


@runtime_checkable
class CostModel(Protocol):
    """A step's time as a pure function of its plan and context."""

    name: str
    # how many earlier steps' batched tokens the model reads from `StepContext.recent_tokens`
    history: int

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime: ...


@runtime_checkable
class Timeline(Protocol):
    """One loop's steps on a virtual clock (`cbjax.sim.timeline.Timeline`)."""

    def run(self, plan: Schedule, start: float) -> tuple[float, float]:
        """A step run to completion from `start`: its (duration, end)."""

    def launch(self, plan: Schedule, start: float) -> Any:
        """A pipelined step planned at `start`; `land` takes the handle."""

    def land(self, step: Any, covered: bool) -> tuple[float, float]:
        """The loop collects `step` (`covered`: the next step was launched first): its span."""
