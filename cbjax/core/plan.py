"""The contract between the scheduler and the executors: one iteration's plan and its result.

A plan is plain data: ids, slots, token ranges, token ids and page numbers, never a live
`Request` or an allocator structure (vLLM v1's `SchedulerOutput` is the model). An executor
keeps its own per-slot state (page-table rows, sampling knobs) and updates it from what the
plan says changed. Both executors and the scheduler import this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from cbjax.core.request import SamplingParams


class ScheduledRequest(NamedTuple):
    """One request's work in a step: its tokens `[num_computed, num_computed + num_new_tokens)`
    of prompt-plus-generated, in batch slot `slot`. It yields a token when its last token is
    processed (`yields`). Immutable; `entry._replace(field=value)` gives a changed copy.
    A named tuple, since the scheduler writes one per scheduled request per step and a tuple
    is built faster than a frozen dataclass; build it by position on hot paths."""

    request_id: str
    slot: int
    num_computed: int  # tokens whose K/V are in the cache before the step
    num_new_tokens: int
    is_decode: bool
    # The new tokens' ids; None when the scheduler does not materialise ids (the simulator) or
    # for a decode whose token the previous step sampled and the host has not seen yet: the
    # executor feeds it from that step's output (pipelined serving, `feed_previous`).
    token_ids: Optional[tuple[int, ...]] = None
    feed_previous: bool = False
    # The request's whole page-table row when it changed since the last plan that scheduled it
    # (admission, readmission, pages added); None: as last sent.
    page_table: Optional[tuple[int, ...]] = None
    # Set in the first plan after (re)admission, when the request takes its slot: its knobs.
    sampling: Optional[SamplingParams] = None
    yields: bool = True  # False for a chunk of a prefill that leaves tokens for later steps
    # Speculative decoding: the last `num_drafts` of a decode row's `num_new_tokens` tokens are
    # drafts to verify. Their ids are in `token_ids` when the host proposed them (n-gram); when
    # the executor drafts them itself (a draft model), `token_ids` holds only the row's first
    # `num_new_tokens - num_drafts` ids.
    num_drafts: int = 0


class HostCopies(NamedTuple):
    """A step's copies of the host KV tier (`cache.host_pages`), run before the step with its
    swaps: every device->host copy (the swap-outs, then `store` in order, a later store to a
    host page replacing an earlier one) before every host->device one (the swap-ins, then
    `load` and `prefetch`). A load may read a host page a store of the same step wrote; no
    store of a step overwrites a host page a load of that step reads. Pages are numbers in the
    device pool; host pages, numbers in the host tier's pool."""

    # (device page, host page): a full page evicted from the device pool, kept in host memory
    store: tuple[tuple[int, int], ...] = ()
    # (request id, host pages, device pages): a request admitted in this step, whose cached
    # prefix continues in host memory, gets those pages back before its prefill
    load: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    # as `load`, for a request still waiting (`cache.host_prefetch`): no row of this step reads
    # those device pages, so the copy may run beside it
    prefetch: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def num_loaded(self) -> int:
        return sum(len(pages) for _, _, pages in self.load)

    @property
    def num_prefetched(self) -> int:
        return sum(len(pages) for _, _, pages in self.prefetch)


@dataclass
class Schedule:
    """One iteration's plan over the fixed array of `num_slots` slots.

    `scheduled` lists the step's requests, decodes first, then prefills (a prefill processes
    the prompt, plus the tokens generated before a preemption); row r of the step is
    `scheduled[r]`, and `StepOutput.token_ids[r]` its token.

    Swaps run before the step, swap-outs first: `swap_out` holds (request id, its pages whose
    contents go to host memory), `swap_in` (request id, the new pages its host copy returns
    to), pages in sequence order. A page freed by a swap-out may be a swap-in's destination.
    `swap_drop` names requests that ended while their K/V was in host memory (aborted while
    waiting): their host copies are dropped, never swapped in.

    A decode stretch (`num_steps` > 1, simulated tokens only) is that many steps in a row of
    the same decodes, each a token further: step j processes every row's token at
    `num_computed + j`, and is plan `step_id + j`. Nothing arrives or finishes before the last
    step. The pool holds the pages of all its steps while it runs: a row whose pages grow
    carries its whole page table (`cbjax.scheduler.stretch`).

    `host_copies`: the host KV tier's copies (`HostCopies`); None when there are none.
    """

    num_slots: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while planning
    start_s: float = 0.0
    swap_out: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    swap_in: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    page_size: int = 1
    step_id: int = 0  # the scheduler's count of plans made; results refer to their plan by it
    # The rows the step computes, as (num_new_tokens, num_context_tokens, is_decode), when
    # they differ from `scheduled`: a padded static batch computes every row of its batch at
    # the batch's padded length, finished rows included. None: exactly `scheduled`.
    padded_rows: Optional[list[tuple[int, int, bool]]] = None
    num_steps: int = 1
    host_copies: Optional[HostCopies] = None
    swap_drop: list[str] = field(default_factory=list)

    def cost_rows(self) -> list[tuple[int, int, bool]]:
        """(num_new_tokens, num_context_tokens, is_decode) per row the step computes, for cost
        models: each request's tokens after its `num_computed` cached ones, or `padded_rows`."""
        if self.padded_rows is not None:
            return self.padded_rows
        return [(s.num_new_tokens, s.num_computed, s.is_decode) for s in self.scheduled]

    @property
    def num_swapped_pages(self) -> int:
        """Pages copied between device and host before this step, both directions."""
        if not (self.swap_out or self.swap_in):  # most plans: no allocation
            return 0
        return sum(len(pages) for _, pages in self.swap_out + self.swap_in)

    @property
    def decodes(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if s.is_decode]

    @property
    def prefills(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if not s.is_decode]

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return sum([s.num_new_tokens for s in self.scheduled])


@dataclass(frozen=True)
class StepOutput:
    """One iteration's result: a token per scheduled request (`Schedule.scheduled` order), or
    None when tokens are simulated. `errors` maps an index into `Schedule.scheduled` to why that
    request's step failed (e.g. non-finite logits); the scheduler aborts those requests and the
    run goes on. A row verifying drafts yields several tokens (`num_accepted`). Time is not here: the loop's clock owns it (`cbjax.engine.clock`)."""

    token_ids: Optional[Sequence[int]]
    errors: Optional[dict[int, str]] = None
    # Speculative decoding, per row (`Schedule.scheduled` order); None when no row had drafts.
    # `num_accepted[r]`: how many of row r's drafts were accepted (0..num_drafts, in order);
    # `accepted_ids[r]`: their ids, where the executor reads ids. Row r then yields those
    # drafts followed by `token_ids[r]`, the target's own token after them.
    num_accepted: Optional[Sequence[int]] = None
    accepted_ids: Optional[Sequence[Sequence[int]]] = None
