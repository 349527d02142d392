"""The executor contract shared by the simulator and the JAX engine (no jax here).

The loop, the drivers, the server and the clusters call an executor only through the members
declared here; nothing outside an executor's own package probes it for others.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request
from cbjax.core.timing import Timeline

__all__ = ["Executor", "Launched", "Schedule", "StepOutput", "SyncExecutor"]


@runtime_checkable
class Launched(Protocol):
    """A step dispatched by `Executor.launch`, its tokens not read yet."""

    start: float  # time.perf_counter() at launch


@runtime_checkable
class Executor(Protocol):
    # True: the loop's time is simulated (`timeline`). False: the loop reads the wall clock.
    virtual_clock: bool
    # True: the loop may launch step t+1 before it collects step t (`launch`/`collect`).
    pipelined: bool
    # True: plans must carry token ids (`ScheduledRequest.token_ids`); a simulator reads none.
    reads_token_ids: bool

    def timeline(self) -> Optional[Timeline]:
        """A new timeline for one loop's steps on a virtual clock; None on the wall clock."""

    def validate(self, req: Request) -> Optional[str]:
        """Executor-specific reason to reject a request (e.g. a token id out of vocabulary)."""

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        """Compile every shape before the clock starts: the sampler too if a request may
        sample, the KV copies if prefilled requests move between replicas."""

    def restart_compile_count(self) -> None:
        """Compiles after warmup count from now (several replicas warmed up in one process)."""

    def execute(self, plan: Schedule) -> StepOutput:
        """Run one iteration of the plan to completion."""

    def launch(self, plan: Schedule) -> Launched:
        """Dispatch one iteration and return at once; `collect` reads its result."""

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched iteration's result."""

    def export_kv(self, pages: Sequence[int]) -> Any:
        """The K/V of `pages` as host data, for another replica's `import_kv`."""

    def import_kv(self, request_id: str, kv: Any) -> None:
        """Hold `kv` (from `export_kv`) as request `request_id`'s host copy, which its
        admission swaps in."""

    def metrics(self) -> dict[str, Any]:
        """The executor's counters for summary.json (may be empty)."""

    def host_load_times(self) -> tuple[float, float]:
        """(load_s, prefetch_s): the seconds the host KV tier's loads and prefetches of the step
        launched last took, as measured here ((0.0, 0.0) where nothing measures them)."""

    def close(self) -> None:
        """Release what the executor holds (other processes of a multi-host run stop stepping)."""


class SyncLaunched:
    """`SyncExecutor.launch`'s handle: the step already ran."""

    __slots__ = ("out", "start")

    def __init__(self, out: StepOutput, start: float):
        self.out, self.start = out, start


class SyncExecutor:
    """A base for executors that run each step to completion in `execute` (the simulator, test
    doubles): `launch` runs it, `collect` returns its result; nothing to warm up, count or close,
    and no K/V to move (its requests' K/V is simulated)."""

    virtual_clock = True
    pipelined = False
    reads_token_ids = False

    def timeline(self) -> Optional[Timeline]:
        return None

    def validate(self, req: Request) -> Optional[str]:
        return None

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        """Nothing to compile."""

    def restart_compile_count(self) -> None:
        """Nothing compiles."""

    def execute(self, plan: Schedule) -> StepOutput:
        raise NotImplementedError

    def launch(self, plan: Schedule) -> SyncLaunched:
        start = time.perf_counter()
        return SyncLaunched(self.execute(plan), start)

    def collect(self, launched: SyncLaunched) -> StepOutput:
        return launched.out

    def export_kv(self, pages: Sequence[int]) -> Any:
        return None

    def import_kv(self, request_id: str, kv: Any) -> None:
        """Nothing to hold."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def host_load_times(self) -> tuple[float, float]:
        return 0.0, 0.0

    def close(self) -> None:
        """Nothing held."""
