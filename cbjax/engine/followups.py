"""Later turns of multi-turn sessions, held until the turn before them ends (no jax).

A request with `pause_s` set is a later turn of a session: it arrives `pause_s` seconds after
the turn before it (same `session_id`, `turn` one less) ends, on the run's clock, virtual or
wall. `Followups` holds these turns, keyed by the request each one follows; the drivers
(`cbjax.engine.offline.serve`, `ClusterSim`, `ClusterEngine`) hand it every request as it
ends (`ended`, their finish callback). The turn before ends:

- served: the next turn is released. It arrives at that end plus its pause, and its prompt
  is the conversation so far, that turn's prompt and output, followed by its own new input
  (`prompt_len` new tokens until then). Where the executor produced token ids (the engine),
  `prompt_token_ids` are that turn's prompt ids, its output ids, then the new input's ids,
  drawn from the session's seeded stream (`synthetic_prompt`) at their positions. The
  simulator has no output ids: the prompt stays the session's seeded stream, and the prefix
  cache names a turn's generated pages as pages of that stream (`PrefixCache._chain`), so the
  next turn hits that turn's prompt and output pages, as it does on the engine.
- otherwise (rejected, aborted, failed): the next turn arrives at once and is rejected with
  a reason naming the turn that failed; each later turn follows it the same way.

A released turn joins the pending arrivals in time order, after those due at the same time.
It never arrives before the run's current time: a turn ends at the end of the step that
finished it, or at its own arrival when it is rejected. When the run stops, `close` returns
the turns not yet released: they end `not_arrived`, as every request the run never reached.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Optional, Sequence

import numpy as np

from cbjax.core.request import Request
from cbjax.report.metrics import SERVED


def _arrival(req: Request) -> float:
    return req.arrival_s


def arrivals(
    requests: Sequence[Request], on_finish: Optional[Callable[[Request], None]]
) -> tuple[deque[Request], Optional["Followups"], Optional[Callable[[Request], None]]]:
    """A driver's pending arrivals (those with fixed arrival times, sorted, ties in the given
    order), the later turns they hold (None when there are none), and the finish callback to
    give the loops (`on_finish`, after which the next turn is released)."""
    held = [r for r in requests if r.pause_s is not None]
    if not held:
        return deque(sorted(requests, key=_arrival)), None, on_finish
    pending = deque(sorted((r for r in requests if r.pause_s is None), key=_arrival))
    followups = Followups(requests, held, pending, on_finish)
    return pending, followups, followups.ended


class Followups:
    """The later turns of sessions, released into `pending` as the turns before them end."""

    def __init__(
        self,
        requests: Sequence[Request],
        held: Sequence[Request],
        pending: deque[Request],
        on_finish: Optional[Callable[[Request], None]] = None,
    ):
        self.pending = pending
        self.on_finish = on_finish
        self.closed = False
        turns: dict[tuple[str, int], Request] = {}
        for req in requests:
            if req.session_id is not None:
                key = (req.session_id, req.turn)
                if key in turns:
                    raise ValueError(
                        f"requests {turns[key].request_id} and {req.request_id} are both turn {req.turn} "
                        f"of session {req.session_id!r}"
                    )
                turns[key] = req
        self._next: dict[Request, Request] = {}  # a turn -> the held turn that follows it
        for req in held:
            if req.session_id is None or req.turn < 1:
                raise ValueError(
                    f"request {req.request_id}: pause_s {req.pause_s} is set, but it is not a later turn "
                    f"of a session (session_id {req.session_id!r}, turn {req.turn})"
                )
            prev = turns.get((req.session_id, req.turn - 1))
            if prev is None:
                raise ValueError(
                    f"request {req.request_id}: turn {req.turn} of session {req.session_id!r} follows turn "
                    f"{req.turn - 1}, which is not among the requests"
                )
            self._next[prev] = req
        self._unreleased: dict[Request, None] = dict.fromkeys(held)
        self._causes: dict[str, str] = {}  # session -> why its later turns are rejected

    def ended(self, req: Request) -> None:
        """`req` ended (any fate): report it, then release the turn that follows it, if any."""
        if self.on_finish is not None:
            self.on_finish(req)
        nxt = self._next.pop(req, None)
        if nxt is None or self.closed or req.finish_s is None:
            return
        del self._unreleased[nxt]
        if req.finish_reason in SERVED:
            nxt.arrival_s = req.finish_s + nxt.pause_s
            continue_conversation(req, nxt)
        else:
            cause = self._causes.get(req.session_id)
            if cause is None:
                detail = req.reject_reason or req.error
                cause = f"session {req.session_id}: turn {req.turn} ended {req.finish_reason.value}" + (
                    f" ({detail})" if detail else ""
                )
                self._causes[req.session_id] = cause
            nxt.arrival_s = req.finish_s
            own = f"; {nxt.input_error}" if nxt.input_error else ""
            nxt.input_error = f"{cause}, so turn {nxt.turn} was never sent{own}"
        self._insert(nxt)

    def _insert(self, req: Request) -> None:
        pending, t = self.pending, req.arrival_s
        if not pending or pending[-1].arrival_s <= t:
            pending.append(req)
        else:
            pending.insert(bisect.bisect_right(pending, t, key=_arrival), req)

    def close(self) -> list[Request]:
        """Stop releasing; the turns not released yet, in the order they were given."""
        self.closed = True
        out = list(self._unreleased)
        self._unreleased.clear()
        return out


def continue_conversation(prev: Request, nxt: Request) -> None:
    """Make `nxt`'s prompt the conversation so far, `prev`'s prompt and output, followed by
    its own `prompt_len` new tokens (see the module's docstring)."""
    start = prev.num_tokens
    nxt.prompt_len = start + nxt.prompt_len
    synthetic = prev.synthetic_prompt or nxt.synthetic_prompt
    if prev.num_generated and len(prev.output_token_ids) == prev.num_generated:  # real token ids
        if nxt.prompt_token_ids is not None:  # its new input's own ids
            new = list(nxt.prompt_token_ids)
        elif synthetic is not None:
            seed, vocab = synthetic
            new = np.random.default_rng(seed).integers(0, vocab, size=nxt.prompt_len)[start:].tolist()
        else:
            new = []
        if len(new) != nxt.prompt_len - start:
            nxt.input_error = (
                f"session {nxt.session_id}: turn {nxt.turn} has {len(new)} new input ids, expected "
                f"{nxt.prompt_len - start}"
            )
            new = new[: nxt.prompt_len - start]
        nxt.prompt_token_ids = prev.prompt_ids() + list(prev.output_token_ids) + new
        nxt.prompt_len = len(nxt.prompt_token_ids)
    elif synthetic is not None:
        nxt.synthetic_prompt = synthetic
        nxt.prompt_token_ids = None
    else:
        nxt.input_error = (
            f"session {nxt.session_id}: turn {nxt.turn} continues a conversation whose tokens are simulated; "
            "the simulator continues only a seeded synthetic prompt"
        )
