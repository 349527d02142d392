"""A replica's executor where it runs (a child process, a Ray actor): `ExecutorHost` builds it,
keeps the steps it launched by id, and answers the driver's calls
(`cbjax.cluster.remote.RemoteExecutor`). No jax here: `build` imports it in the replica's own
process, after the process's device settings are in its environment.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any, Callable

from cbjax.config import RunConfig
from cbjax.core.plan import Schedule, StepOutput

# The calls a driver may make (RemoteExecutor's); anything else is refused. The FORWARDED ones
# are the executor's own calls with the driver's arguments; the host's methods answer the others.
FORWARDED: dict[str, Callable[..., Any]] = {
    "restart_compile_count": lambda ex: ex.restart_compile_count(),
    "execute": lambda ex, plan: ex.execute(plan),
    "export_kv": lambda ex, pages: ex.export_kv(pages),
    "import_kv": lambda ex, request_id, kv: ex.import_kv(request_id, kv),
    "metrics": lambda ex: ex.metrics(),
    "close": lambda ex: ex.close(),
}
CALLS = frozenset({"ready", "warmup", "launch", "collect", *FORWARDED})


class ReplicaError(Exception):
    """A failure in a replica, already told in one line (`describe`)."""


def describe(err: BaseException) -> str:
    """One line for `err`: its type, the first line of its message, and where it was raised
    (the innermost frame in cbjax or outside installed packages and the standard library,
    else the innermost)."""
    if isinstance(err, ReplicaError):
        return str(err)
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    library = ("-packages" + os.sep, os.sep + "lib" + os.sep + "python")
    own = [f for f in frames if f"{os.sep}cbjax{os.sep}" in f.filename or not any(p in f.filename for p in library)]
    frame = (own or frames or [None])[-1]
    if frame is not None:
        text += f" ({'/'.join(frame.filename.split(os.sep)[-2:])}:{frame.lineno})"
    return text


class ExecutorHost:
    """One replica's executor, served to a driver. A build that fails is reported to the
    driver's first call (`ready`), as every later one."""

    def __init__(self, build: Callable[[RunConfig], Any], cfg: RunConfig):
        """`build(cfg)`: the executor (`cbjax.app.run.build_executor`, pickled by reference)."""
        self._launched: dict[int, Any] = {}
        self._broken = None
        try:
            self.executor = build(dataclasses.replace(cfg, progress=False))
        except Exception as err:
            self._broken = ReplicaError(describe(err))

    def call(self, name: str, *args: Any) -> Any:
        """Run call `name`; a failure raises `ReplicaError` (its one line)."""
        if self._broken is not None:
            raise self._broken
        if name not in CALLS:
            raise ReplicaError(f"unknown call {name!r}")
        forward = FORWARDED.get(name)
        try:
            return forward(self.executor, *args) if forward is not None else getattr(self, name)(*args)
        except Exception as err:
            raise ReplicaError(describe(err)) from None

    def answer(self, name: str, args: tuple) -> tuple[str, Any]:
        """`call`'s outcome as a reply: ("ok", result) or ("error", one line)."""
        try:
            return "ok", self.call(name, *args)
        except ReplicaError as err:
            return "error", str(err)

    # ---- the calls the host answers itself ----
    def ready(self) -> dict[str, Any]:
        ex = self.executor
        if ex.virtual_clock:
            raise ValueError(f"{type(ex).__name__} runs on a virtual clock; a replica process runs the engine")
        return {
            "virtual_clock": ex.virtual_clock, "pipelined": bool(ex.pipelined), "reads_token_ids": ex.reads_token_ids,
            "pid": os.getpid(),
        }  # fmt: skip

    def warmup(self, sampling: bool, kv_transfer: bool) -> None:
        self.executor.warmup(sampling=sampling, kv_transfer=kv_transfer)

    def launch(self, step: int, plan: Schedule) -> None:
        self._launched[step] = self.executor.launch(plan)

    def collect(self, step: int) -> StepOutput:
        return self.executor.collect(self._launched.pop(step))
