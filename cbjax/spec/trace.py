"""spec_trace.jsonl: each request's drafts proposed and accepted, step by step (no jax).

Every run with speculation on writes one beside requests.jsonl, one JSON line per request that
decoded:

    {"request_id": "7", "proposed": [3, 3, 0, 2], "accepted": [1, 3, 0, 0]}

`proposed[j]` and `accepted[j]` belong to the request's j-th decode step (the steps after its
prefill, one per verification, those that proposed nothing included): the drafts its row
verified and how many of them, in order, the target accepted. The simulator replays a trace
(`spec.acceptance=trace`): at its j-th decode step a request proposes at most `proposed[j]`
drafts and accepts at most `accepted[j]`, and nothing beyond the trace's steps.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable, NamedTuple

from cbjax.core.request import Request

TRACE_FILE = "spec_trace.jsonl"


class RequestTrace(NamedTuple):
    proposed: tuple[int, ...]
    accepted: tuple[int, ...]

    def at(self, step: int) -> tuple[int, int]:
        """(proposed, accepted) at the request's decode step `step`; (0, 0) beyond the trace."""
        if step < len(self.proposed):
            return self.proposed[step], self.accepted[step]
        return 0, 0


def trace_lines(requests: Iterable[Request]) -> list[str]:
    """The trace's lines for `requests` (those that never decoded are left out)."""
    lines = []
    for req in requests:
        steps = req.spec_steps
        if not steps:
            continue
        proposed = [p for p, _ in steps]
        accepted = [a for _, a in steps]
        lines.append(json.dumps({"request_id": req.request_id, "proposed": proposed, "accepted": accepted}))
    return lines


def read_trace(path: str) -> dict[str, RequestTrace]:
    """request id -> its trace, from a spec_trace.jsonl; errors name spec.acceptance_path and
    the line. A file is parsed once while it is unchanged."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"spec.acceptance_path: no acceptance trace at {p} (a run with speculation on writes {TRACE_FILE})")
    stat = p.stat()
    return _read(p.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read(path: Path, mtime_ns: int, size: int) -> dict[str, RequestTrace]:
    out: dict[str, RequestTrace] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"spec.acceptance_path: {path} line {i}"
        try:
            row = json.loads(line)
            rid, proposed, accepted = str(row["request_id"]), row["proposed"], row["accepted"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a spec trace line ({type(err).__name__}: {err})") from None
        ok = isinstance(proposed, list) and isinstance(accepted, list) and len(proposed) == len(accepted)
        ok = ok and all(isinstance(p, int) and isinstance(a, int) and 0 <= a <= p for p, a in zip(proposed, accepted))
        if not ok:
            raise ValueError(f"{where}: proposed and accepted must be lists of equal length with 0 <= accepted <= proposed")
        if rid in out:
            raise ValueError(f"{where}: request {rid!r} appears twice")
        out[rid] = RequestTrace(tuple(proposed), tuple(accepted))
    return out
