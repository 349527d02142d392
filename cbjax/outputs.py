"""Run files that survive interruption: atomic writes, a live request log, and a stop flag for signals."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from cbjax.request import Request


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary name beside `path`, then rename it into place, so `path`
    is either absent, its old content, or complete; never cut short."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class RequestLog:
    """`requests.jsonl.partial`: one JSON row per request as it finishes, flushed at least
    every `flush_s` seconds (checked on each write and each `tick`). After a crash it holds
    every request that had finished; a completed run replaces it with requests.jsonl."""

    SUFFIX = ".partial"

    def __init__(self, path: Path, make_row: Callable[[Request], dict[str, Any]], flush_s: float = 1.0):
        self.path = path.with_name(path.name + self.SUFFIX)
        self.make_row = make_row
        self.flush_s = flush_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")
        self._dirty = False
        self._last_flush = time.monotonic()

    def write(self, req: Request) -> None:
        self._file.write(json.dumps(self.make_row(req)) + "\n")
        self._dirty = True
        self.tick()

    def tick(self) -> None:
        if self._dirty and time.monotonic() - self._last_flush >= self.flush_s:
            self._file.flush()
            self._dirty = False
            self._last_flush = time.monotonic()

    def close(self, remove: bool = True) -> None:
        self._file.close()
        if remove:
            self.path.unlink(missing_ok=True)


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
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, lambda signum, frame: self.set(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
