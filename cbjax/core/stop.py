"""A stop flag set by SIGINT or SIGTERM: the serving loop ends at its next iteration boundary."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional


class StopFlag:
    """Set by SIGINT or SIGTERM while `catching` is active: the serving loop stops at the next
    iteration boundary, aborts what is in flight and the run saves its files."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.count = 0

    def is_set(self) -> bool:
        return self.signum is not None

    def set(self, signum: int = signal.SIGINT) -> None:
        if self.signum is None:
            self.signum = signum
        self.count += 1

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @contextmanager
    def catching(self) -> Iterator["StopFlag"]:
        """Route SIGINT and SIGTERM to this flag. Further signals are only counted, so nothing
        (the save included) is cut off midway; the previous handlers come back afterwards."""
        with signals_to(lambda signum, frame: self.set(signum)):
            yield self


@contextmanager
def signals_to(handler: Any) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` (a signal handler, or `signal.SIG_DFL`) while the
    block runs, and the previous handlers come back after. Off the main thread, where Python
    cannot set handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
