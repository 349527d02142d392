"""The scheduler's plans as data: a draft over live requests becomes a `Schedule` (no jax).

The scheduler builds each iteration's plan as a `Draft` of live requests (it preempts and
reorders while planning); `PlanWriter` writes it out as the data-only `Schedule` the executor
sees, and remembers which requests each plan scheduled until its results are recorded. It also
tracks what each running request's slot was last told, so a plan carries a page-table row only
when it changed and sampling knobs only when a request takes its slot.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request


class Draft:
    """A plan while the scheduler builds it, over live requests. (A plain class: one is made
    per iteration, and a dataclass's field defaults cost more to build.)"""

    __slots__ = ("decodes", "prefills", "preempted", "swap_out", "swap_in", "padded_rows")

    def __init__(self) -> None:
        self.decodes: list[Request] = []
        self.prefills: list[Request] = []
        self.preempted: list[Request] = []
        self.swap_out: list[tuple[Request, list[int]]] = []
        self.swap_in: list[tuple[Request, list[int]]] = []
        self.padded_rows: Optional[list[tuple[int, int, bool]]] = None


# Schedule's fields, in order: the writer passes them by position (keywords cost twice as
# much to pass), so a reordering must fail here, at import, not as a wrong plan.
_SCHEDULE_FIELDS = ("num_slots", "scheduled", "preempted", "start_s", "swap_out", "swap_in", "page_size",
                    "step_id", "padded_rows", "num_steps", "host_copies", "swap_drop")  # fmt: skip
if tuple(f.name for f in fields(Schedule)) != _SCHEDULE_FIELDS:
    raise AssertionError("cbjax.scheduler.output: _SCHEDULE_FIELDS differs from Schedule's fields")
# ScheduledRequest's fields, in order: hot paths build a row as a tuple of all of them
# (`new_row(ScheduledRequest, values)` skips the named tuple's Python-level constructor).
ROW_FIELDS = ("request_id", "slot", "num_computed", "num_new_tokens", "is_decode", "token_ids", "feed_previous",
              "page_table", "sampling", "yields", "num_drafts")  # fmt: skip
if ScheduledRequest._fields != ROW_FIELDS:
    raise AssertionError("cbjax.scheduler.output: ROW_FIELDS differs from ScheduledRequest's fields")
new_row = tuple.__new__
_NO_DRAFTS = (0, ())
_NO_IDS = (None, False)  # (token ids, feed_previous) of a plan without ids


class PlanWriter:
    """Drafts -> `Schedule`s for one scheduler over `num_slots` slots and its page allocator."""

    def __init__(self, num_slots: int, allocator):
        self.num_slots = num_slots
        self.allocator = allocator  # page_tables and page_size are read
        # Whether plans carry token ids: the engine reads them; the simulator does not, so a
        # length-only trace never materialises its prompts. EngineLoop sets it from the executor.
        self.token_ids = False
        # speculative decoding: request id -> (drafts, their ids or () when the executor drafts)
        # of the next plan's decodes (`cbjax.scheduler.drafts`)
        self.drafts: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._num_plans = 0
        self._plans: dict[int, list[Request]] = {}  # step_id -> its requests, until done
        self._sent_pages: dict[str, int] = {}  # running request -> page-table length last sent
        self._fresh: set[str] = set()  # requests that take their slot in the next plan

    def admitted(self, request_id: str) -> None:
        """The request takes a slot: the next plan sends its knobs and its whole page table."""
        self._fresh.add(request_id)

    def released(self, request_id: str) -> None:
        """The request left its slot (finished, preempted or aborted)."""
        self._sent_pages.pop(request_id, None)
        self._fresh.discard(request_id)

    def sent_pages(self, request_id: str, num_pages: int) -> None:
        """The request's slot was told a page table of `num_pages` pages (a decode stretch's)."""
        self._sent_pages[request_id] = num_pages

    def requests(self, plan: Schedule) -> list[Request]:
        """The plan's scheduled requests in plan order, until `done`."""
        return self._plans[plan.step_id]

    def done(self, plan: Schedule) -> None:
        """The plan's results are recorded: forget its requests."""
        del self._plans[plan.step_id]

    def write(self, draft: Draft, now: float) -> Schedule:
        self._num_plans += 1
        scheduled: list[ScheduledRequest] = []
        if self.drafts:
            self._draft_entries(draft.decodes, scheduled)
        elif self.token_ids:
            self._entries(draft.decodes, True, scheduled)
        else:
            self._decode_entries(draft.decodes, scheduled)
        if draft.prefills:
            self._entries(draft.prefills, False, scheduled)
        # the draft's own list when it has no prefills: nothing changes it once written
        self._plans[self._num_plans] = draft.decodes + draft.prefills if draft.prefills else draft.decodes
        return Schedule(  # positional (in _SCHEDULE_FIELDS order): keywords cost twice as much
            self.num_slots,
            scheduled,
            [r.request_id for r in draft.preempted] if draft.preempted else [],
            now,
            [(r.request_id, tuple(pages)) for r, pages in draft.swap_out] if draft.swap_out else [],
            [(r.request_id, tuple(pages)) for r, pages in draft.swap_in] if draft.swap_in else [],
            self.allocator.page_size,
            self._num_plans,
            draft.padded_rows,
        )

    def write_continuation(
        self, requests: list[Request], scheduled: list[ScheduledRequest], now: float, num_steps: int = 1
    ) -> Schedule:
        """The plan of a decode stretch's next `num_steps` steps (`cbjax.scheduler.stretch`):
        `scheduled`, one decode per request of `requests`, none of whose page tables or knobs
        changed since it was last sent. Each step counts as a plan (`Schedule.num_steps`)."""
        step_id = self._num_plans + 1
        self._num_plans += num_steps
        self._plans[step_id] = list(requests)
        return Schedule(
            self.num_slots, scheduled, [], now, [], [], self.allocator.page_size, step_id, None, num_steps
        )

    def _entries(self, requests: list[Request], decode: bool, out: list[ScheduledRequest]) -> None:
        """Append the requests' entries to `out` (one call per list: the loop is the hot path)."""
        tables, sent, fresh = self.allocator.page_tables, self._sent_pages, self._fresh
        with_ids = self.token_ids
        append = out.append
        for req in requests:
            rid = req.request_id
            num_pages = len(tables[rid])
            page_table = None
            if sent.get(rid) != num_pages:  # tables only grow while a request runs
                page_table = tuple(tables[rid])
                sent[rid] = num_pages
            sampling = None
            if rid in fresh:
                fresh.discard(rid)
                sampling = req.sampling
            lo, n = req.num_computed, req.num_new_tokens
            token_ids, feed = self._token_ids(req, lo, n) if with_ids else _NO_IDS
            append(new_row(ScheduledRequest, (
                rid, req.slot, lo, n, decode, token_ids, feed, page_table, sampling,
                lo + n >= req.prompt_len + req.num_generated, 0,  # yields: it reaches req.num_tokens
            )))  # fmt: skip

    def _decode_entries(self, requests: list[Request], out: list[ScheduledRequest]) -> None:
        """`_entries(requests, True, out)` for a plan without token ids: each decode processes
        its one last token, so it yields."""
        tables, sent, fresh = self.allocator.page_tables, self._sent_pages, self._fresh
        sent_get, append = sent.get, out.append
        for req in requests:
            rid = req.request_id
            table = tables[rid]
            page_table = None
            if sent_get(rid) != len(table):  # tables only grow while a request runs
                page_table = tuple(table)
                sent[rid] = len(table)
            sampling = None
            if rid in fresh:
                fresh.discard(rid)
                sampling = req.sampling
            append(new_row(ScheduledRequest, (
                rid, req.slot, req.num_computed, 1, True, None, False, page_table, sampling, True, 0,
            )))  # fmt: skip

    def _draft_entries(self, requests: list[Request], out: list[ScheduledRequest]) -> None:
        """`_entries` of decodes some of which verify drafts (`drafts`, emptied): each row is
        written for its own token, then widened by its drafts and their ids."""
        drafts, self.drafts = self.drafts, {}
        start = len(out)
        for req in requests:
            req.num_new_tokens -= drafts.get(req.request_id, _NO_DRAFTS)[0]
        self._entries(requests, True, out)
        for i, req in enumerate(requests):
            d, ids = drafts.get(req.request_id, _NO_DRAFTS)
            if not d:
                continue
            req.num_new_tokens += d
            row = out[start + i]
            token_ids = row.token_ids + ids if row.token_ids is not None else None
            out[start + i] = row._replace(num_new_tokens=row.num_new_tokens + d, token_ids=token_ids, num_drafts=d)

    @staticmethod
    def _token_ids(req: Request, lo: int, n: int) -> tuple[Optional[tuple[int, ...]], bool]:
        """(token ids, feed_previous) of the request's tokens [lo, lo + n)."""
        p, out = req.prompt_len, req.output_token_ids
        if n == 1 and lo >= p and lo - p >= len(out):
            return None, True  # sampled by the step still in flight: the executor feeds it on the device
        if lo + n > p + len(out):
            raise RuntimeError(
                f"schedule: request {req.request_id} processes tokens [{lo}, {lo + n}), only {p + len(out)} "
                "are known; this is a bug"
            )
        if lo >= p:  # a decode (or a recompute's generated tail): no copy of the prompt
            return tuple(out[lo - p : lo - p + n]), False
        if lo + n <= p:
            return tuple(req.prompt_ids()[lo : lo + n]), False
        return tuple(req.prompt_ids()[lo:]) + tuple(out[: lo + n - p]), False
