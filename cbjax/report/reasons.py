"""Why requests did not run, for the console: their reasons grouped, the most common first."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from cbjax.core.request import FinishReason, Request

# Reasons that differ only in their numbers (a line, a request id, a length) are one reason.
_NUMBER = re.compile(r"\d+")


def format_reasons(requests: Iterable[Request], *, top: int = 3, width: int = 300) -> str:
    """A few lines under a run's table: for the rejected requests, then for those that ended in
    an error, how many there were and their `top` most common reasons, each with its count and
    its first request's reason in full (cut at `width` characters). Empty when every request
    ran. The table gives only counts; without these lines a run whose every request was
    refused (a trace read in the wrong format, a KV pool too small) says nothing of why."""
    requests = list(requests)
    lines: list[str] = []
    for verb, field, finish in (("rejected", "reject_reason", FinishReason.REJECTED),
                                ("failed", "error", FinishReason.ERROR)):  # fmt: skip
        reasons = [getattr(r, field) or "no reason given" for r in requests if r.finish_reason is finish]
        if reasons:
            lines.extend(_grouped(verb, reasons, top, width))
    return "\n".join(lines)


def _grouped(verb: str, reasons: list[str], top: int, width: int) -> list[str]:
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    for reason in reasons:
        key = _NUMBER.sub("#", reason)
        counts[key] += 1
        first.setdefault(key, reason)
    n = len(reasons)
    head = f"{n} request{'s' if n != 1 else ''} {verb}"
    lines = [f"{head}; the most common reasons (each request's is in requests.jsonl):"]
    shown = counts.most_common(top if len(counts) > top + 1 else top + 1)  # one left over: shown too
    rest = n - sum(c for _, c in shown)
    pad = len(str(max(shown[0][1], rest)))
    for key, count in shown:
        lines.append(f"  {count:>{pad}} x {_cut(first[key], width)}")
    if rest:
        others = len(counts) - len(shown)  # at least 2: a lone one is shown
        lines.append(f"  {rest:>{pad}} x other reasons ({others} different)")
    return lines


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
