"""The contract between the scheduler and the executors: one iteration's plan and its result.

Both executors and the scheduler import this module; it imports neither (no jax, no policies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from cbjax.request import Request


@dataclass
class Schedule:
    """One iteration's plan over the fixed array of `num_slots` slots.

    Each scheduled request carries its `slot` and `num_new_tokens`: it processes its tokens
    `[num_computed, num_computed + num_new_tokens)` of prompt-plus-generated. A decode
    processes the one token generated last; a prefill processes the prompt (plus the tokens
    generated before a preemption). A request yields a token when its last token is processed.

    Swaps run before the step, swap-outs first: `swap_out` holds (request, its pages whose
    contents go to host memory), `swap_in` (request, the new pages its host copy returns to),
    pages in sequence order. A page freed by a swap-out may be a swap-in's destination.
    """

    num_slots: int
    decodes: list[Request] = field(default_factory=list)
    prefills: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    start_s: float = 0.0
    # request_id -> its pages, the allocator's live tables (read-only for executors)
    page_tables: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)
    page_size: int = 1
    # The rows the step computes, as (num_new_tokens, num_context_tokens, is_decode), when
    # they differ from `requests` as planned: a padded static batch computes every row of its
    # batch at the batch's padded length, finished rows included. None: exactly `requests`.
    padded_rows: Optional[list[tuple[int, int, bool]]] = None

    def cost_rows(self) -> list[tuple[int, int, bool]]:
        """(num_new_tokens, num_context_tokens, is_decode) per row the step computes, for cost
        models: each request's tokens after its `num_computed` cached ones, or `padded_rows`."""
        if self.padded_rows is not None:
            return self.padded_rows
        rows = [(1, r.num_computed, True) for r in self.decodes]
        rows.extend((r.num_new_tokens, r.num_computed, False) for r in self.prefills)
        return rows

    @property
    def num_swapped_pages(self) -> int:
        """Pages copied between device and host before this step, both directions."""
        return sum(len(pages) for _, pages in self.swap_out + self.swap_in)

    @property
    def requests(self) -> list[Request]:
        """Scheduled requests in executor order: decodes, then prefills."""
        return self.decodes + self.prefills

    @property
    def num_scheduled(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(r.num_new_tokens for r in self.prefills)


@dataclass
class StepOutput:
    """One iteration's result: a token per scheduled request (`Schedule.requests` order), or
    None when tokens are simulated, and the iteration's duration on the executor's clock.
    `errors` maps an index into `Schedule.requests` to why that request's step failed (e.g.
    non-finite logits); the scheduler aborts those requests and the run goes on."""

    token_ids: Optional[Sequence[int]]
    duration_s: float
    errors: Optional[dict[int, str]] = None
