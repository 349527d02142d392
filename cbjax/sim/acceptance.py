"""The simulator's acceptance models: how many of a decode's drafts the target accepts (no jax).

A model answers for one verification, named by its request and the request's decode step
(0 first, every decode step counted, those that proposed nothing included), so a request's
draws depend on its own steps only, never on what it was batched with: the same seed gives
the same acceptances whatever the schedule. `spec.acceptance`:

- fixed: each draft is accepted with probability `spec.acceptance_rate`, independently; the
  verification stops at the first rejection;
- per_position: draft i (0 first) with probability `spec.acceptance_rates[i]` (the last rate
  for positions beyond the list), given the drafts before it were accepted;
- trace: what an engine run's `spec_trace.jsonl` says the request accepted at that step,
  at most the drafts verified now (`cbjax.spec.trace`).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from cbjax.config.spec import SpecConfig
from cbjax.spec.trace import RequestTrace, read_trace

_MASK = (1 << 64) - 1
_UNIT = 2.0**-53


def _mix(z: int) -> int:
    """SplitMix64's step: a well-spread 64-bit value from the previous one."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SeededAcceptance:
    """Independent per-draft acceptance, draft i accepted with `rates[min(i, len(rates) - 1)]`,
    drawn from a stream seeded by (`seed`, request id, decode step)."""

    def __init__(self, rates: Sequence[float], seed: int = 0):
        if not rates:
            raise ValueError("spec.acceptance_rates: needs at least one rate")
        self.rates = tuple(float(r) for r in rates)
        self.seed = seed & _MASK
        self._keys: dict[str, int] = {}  # request id -> its stream's key (a stable hash)

    def _key(self, request_id: str) -> int:
        key = self._keys.get(request_id)
        if key is None:
            digest = hashlib.blake2b(request_id.encode(), digest_size=8, key=self.seed.to_bytes(8, "little")).digest()
            key = self._keys[request_id] = int.from_bytes(digest, "little")
        return key

    def accepted(self, request_id: str, step: int, num_drafts: int) -> int:
        rates, last = self.rates, len(self.rates) - 1
        z = _mix(self._key(request_id) ^ _mix(step))
        for i in range(num_drafts):
            z = _mix(z)
            if (z >> 11) * _UNIT >= rates[i if i < last else last]:
                return i
        return num_drafts


class TraceAcceptance:
    """An engine run's acceptances replayed (`spec.acceptance=trace`); a request or step the
    trace does not hold accepts nothing."""

    def __init__(self, trace: dict[str, RequestTrace]):
        self.trace = trace

    def accepted(self, request_id: str, step: int, num_drafts: int) -> int:
        request = self.trace.get(request_id)
        if request is None:
            return 0
        return min(request.at(step)[1], num_drafts)


def make_acceptance(spec: SpecConfig, seed: int = 0) -> Optional[object]:
    """The acceptance model `spec` selects (None while speculation is off); `seed`: the run's."""
    if not spec.enabled:
        return None
    if spec.acceptance == "trace":
        return TraceAcceptance(read_trace(spec.acceptance_path))
    if spec.acceptance == "per_position":
        return SeededAcceptance(spec.acceptance_rates, seed)
    return SeededAcceptance([spec.acceptance_rate], seed)
