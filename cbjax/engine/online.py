"""The online driver: a loop on its own thread, fed through its `intake` (the server's)."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from cbjax.engine.loop import EngineLoop

IDLE_WAIT_S = 0.05  # an idle loop looks at its stop flag at least this often


def run_online(loop: EngineLoop, stop: threading.Event, poll: Optional[Callable[[float], None]] = None) -> None:
    """Serve submissions until `stop` is set; blocks while idle, wakes on a submission. With
    `poll(timeout_s)` (submissions that come from elsewhere, e.g. another process's pipe), it
    is called before each turn with 0, and while idle in place of the wait: it submits what
    has come, waiting up to timeout_s for something to."""
    intake = loop.intake
    while not stop.is_set():
        if poll is not None:
            poll(0.0)
        loop.boundary()
        if loop.step():
            continue
        # cleared before the inbox is checked again, so a submission in between is not missed
        intake.wake.clear()
        if intake.pending():
            continue
        if poll is not None:
            poll(IDLE_WAIT_S)
        else:
            intake.wake.wait(IDLE_WAIT_S)
    loop.settle()
