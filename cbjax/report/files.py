"""Run files that survive interruption: atomic writes, a live request log, and a stop flag for signals."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from cbjax.core.request import Request

log = logging.getLogger("cbjax")


def unwritable(directory: Path) -> Optional[str]:
    """None when `directory` exists (or could be made) and takes a new file; else why not, as
    one line naming the path. Checked before a run, so an output folder that cannot be written
    fails before any work rather than after it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"cannot write the output folder {directory}: {e.strerror or e}"
    return None


def read_json(path: str | Path) -> Any:
    """The JSON document at `path`. Raises ValueError, one line naming `path` and why, when it
    cannot be read or parsed: a script turns it into a usage error naming its flag."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({getattr(e, 'strerror', None) or e})") from e


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` (its folder made if missing), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


class OutputError(OSError):
    """A run file that could not be written; its message is one line naming the file."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary name beside `path`, then rename it into place, so `path`
    is either absent, its old content, or complete; never cut short. Raises OutputError
    naming `path` when the folder cannot take it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from e
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
        self._file: Optional[Any] = open(self.path, "w")
        self._dirty = False
        self._last_flush = time.monotonic()

    def write(self, req: Request) -> None:
        if self._file is None:
            return
        self._guard(lambda: self._file.write(json.dumps(self.make_row(req)) + "\n"))
        self._dirty = True
        self.tick()

    def tick(self) -> None:
        if self._file is not None and self._dirty and time.monotonic() - self._last_flush >= self.flush_s:
            self._guard(self._file.flush)
            self._dirty = False
            self._last_flush = time.monotonic()

    def _guard(self, op: Callable[[], Any]) -> None:
        """Run a write; a failing disk or folder stops the live log (one notice), not the run,
        whose final files are written (or fail, naming the folder) at its end."""
        try:
            op()
        except OSError as e:
            log.warning(f"cbjax: {self.path}: live request log stopped: {e.strerror or e}")
            self._discard()

    def _discard(self) -> None:
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass

    def close(self, remove: bool = True) -> None:
        if self._file is not None:
            self._discard()
        if remove:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:  # its folder is gone or no longer a folder: nothing left to remove
                pass
