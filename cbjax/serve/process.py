"""cbjax-serve as a child process, for scripts and tests: start it, learn its URL, read its CPU
(its engine process's included).

cbjax-serve prints one line on stderr once its socket listens (`LISTENING`, written by
`cbjax.serve.cli`); `start` waits for it and reads the URL from it (with `server.port=0` the
port is the one the system picked). No jax or hydra here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Optional, Sequence

LISTENING = "cbjax-serve: listening on {url}/v1"
STDERR_LINES = 20  # of a server that exits before listening, kept for the error
_LISTENING = re.compile(re.escape(LISTENING).replace(re.escape("{url}"), r"(http://\S+)"))


def start(overrides: Sequence[str], cwd: Path, env: Optional[dict] = None) -> tuple[subprocess.Popen, str]:
    """`python -m cbjax.serve server.port=0 OVERRIDES` in `cwd`; returns the process and its
    /v1 base URL once it listens. Its stderr is drained on a thread from then on. Should it exit
    first, the RuntimeError ends with the last lines it wrote there (its error names the key)."""
    cmd = [sys.executable, "-m", "cbjax.serve", "server.port=0", *overrides]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: deque[str] = deque(maxlen=STDERR_LINES)
    for line in proc.stderr:
        match = _LISTENING.match(line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, match.group(1) + "/v1"
        said.append(line)
    raise RuntimeError(f"cbjax-serve exited {proc.wait()} before listening: {' '.join(cmd)}\n{''.join(said).rstrip()}")


def cpu_s(pid: int) -> Optional[float]:
    """A process's CPU seconds so far (user + system, all threads), its live child processes'
    included (cbjax-serve's engine process), from /proc; None without it."""
    total = _own_cpu_s(pid)
    if total is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        total += cpu_s(int(child)) or 0.0
    return total


def _own_cpu_s(pid: int) -> Optional[float]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
