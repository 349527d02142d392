"""Orca-style reservations: each request holds one contiguous run of pages, taken first-fit (no jax)."""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

from cbjax.cache.allocator import PageAllocator
from cbjax.core.request import Request


class ReservationAllocator(PageAllocator):
    """`reserve_max`, `reserve_pow2` and `reserve_oracle`: at admission a request reserves
    pages for `max_tokens` tokens (the scheduler's `reserve_tokens`: its maximum length, the
    next power of two of its output, or exactly its output, each plus the prompt) as ONE run
    of consecutive pages, the lowest run that fits (first fit), as Orca's contiguous per-request
    buffers are. Growth never takes pages: the reservation already covers the request's tokens.

    `fit="buddy"` places reservations as a binary buddy allocator does (the vLLM paper's Orca
    baselines use one): a reservation is rounded up to a power-of-two number of pages and
    starts at a multiple of its size (counting from page 1), the lowest such place that is free.

    Because runs must be contiguous, free pages can be stranded between reservations:
    external fragmentation (`slot_breakdown`). Free pages are kept as maximal runs, so freeing
    a reservation merges it with its free neighbours. No prefix caching (config rejects it).
    """

    def __init__(self, num_pages: int, page_size: int, allocation: str = "reserve_max", fit: str = "first_fit"):
        super().__init__(num_pages, page_size, "paged")
        if fit not in ("first_fit", "buddy"):
            raise ValueError(f"cache.reservation_fit: unknown value {fit!r}; choose first_fit or buddy")
        self.allocation = allocation
        self.buddy = fit == "buddy"
        self.reserve = True
        self._is_free = bytearray()  # unused: free pages live in the runs below
        self._run_starts: list[int] = [1]  # sorted starts of the maximal free runs
        self._run_len: dict[int, int] = {1: num_pages - 1}
        self._num_free = num_pages - 1

    # ---- counters ----
    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - self._num_free

    def free_runs(self) -> list[int]:
        """Lengths of the maximal free runs, in page order."""
        return [self._run_len[s] for s in self._run_starts]

    def largest_free_run(self) -> int:
        return max(self._run_len.values(), default=0)

    # ---- admission ----
    def admission_pages(self, num_tokens: int, max_tokens: int) -> int:
        pages = self.pages_for(max(num_tokens, max_tokens))
        return 1 << (pages - 1).bit_length() if self.buddy else pages

    def can_allocate(self, num_tokens: int, max_tokens: int, cached: Sequence[int] = ()) -> bool:
        return not cached and self._first_fit(self.admission_pages(num_tokens, max_tokens)) is not None

    def allocate(self, request_id: str, num_tokens: int, max_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        if request_id in self.page_tables:
            raise ValueError(f"request {request_id}: already holds pages")
        if cached:
            raise ValueError(f"request {request_id}: cache.allocation={self.allocation} shares no cached pages")
        need = self.admission_pages(num_tokens, max_tokens)
        start = self._first_fit(need)
        if start is None:
            raise ValueError(
                f"request {request_id}: needs a run of {need} pages, the largest free run has "
                f"{self.largest_free_run()}"
            )
        run = self._run_of(start)
        end = run + self._run_len[run]
        i = bisect.bisect_left(self._run_starts, run)
        if start > run:
            self._run_len[run] = start - run
            i += 1
        else:
            del self._run_starts[i]
            del self._run_len[run]
        if start + need < end:
            self._run_starts.insert(i, start + need)
            self._run_len[start + need] = end - start - need
        self._num_free -= need
        table = list(self._ids[start : start + need])
        self.page_tables[request_id] = table
        self._num_hashed[request_id] = 0
        self._stored[request_id] = num_tokens
        self.num_stored_tokens += num_tokens
        return table

    def _first_fit(self, need: int):
        """The lowest start of `need` free pages (aligned to `need` under buddy), or None."""
        for start in self._run_starts:
            length = self._run_len[start]
            at = start
            if self.buddy:
                at = -(-(start - 1) // need) * need + 1
            if at + need <= start + length:
                return at
        return None

    def _run_of(self, page: int) -> int:
        """The start of the free run holding `page`."""
        return self._run_starts[bisect.bisect_right(self._run_starts, page) - 1]

    # ---- growth: inside the reservation only ----
    def can_append(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self.page_tables[request_id])

    def try_append(self, request_id: str, num_tokens: int) -> bool:
        if not self.can_append(request_id, num_tokens):
            return False
        self.append(request_id, num_tokens)
        return True

    def try_append_one_each(self, requests: Sequence[Request]) -> int:
        done = 0
        for req in requests:
            if not self.try_append(req.request_id, req.num_computed + 1):
                break
            done += 1
        return done

    def append(self, request_id: str, num_tokens: int) -> None:
        table = self.page_tables[request_id]
        if self.pages_for(num_tokens) > len(table):
            raise ValueError(
                f"request {request_id}: {num_tokens} tokens outgrow its reservation of {len(table)} pages"
            )
        self.num_stored_tokens += num_tokens - self._stored[request_id]
        self._stored[request_id] = num_tokens

    # ---- release ----
    def free(self, request_id: str) -> None:
        table = self.page_tables.pop(request_id)
        self.num_stored_tokens -= self._stored.pop(request_id)
        del self._num_hashed[request_id]
        start, length = table[0], len(table)
        self._num_free += length
        starts, lens = self._run_starts, self._run_len
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start + length:  # merge the run after
            length += lens.pop(starts.pop(i))
        if i > 0 and starts[i - 1] + lens[starts[i - 1]] == start:  # merge into the run before
            lens[starts[i - 1]] += length
        else:
            starts.insert(i, start)
            lens[start] = length

    # ---- the pool's five shares ----
    def slot_breakdown(
        self, final_tokens: Iterable[tuple[str, int]], min_waiting_pages: int
    ) -> tuple[int, int, int, int, int]:
        """As `PageAllocator.slot_breakdown`, with external fragmentation: the pages of free runs
        shorter than `min_waiting_pages` (the smallest reservation of any waiting request, 0 if
        none waits), which no waiting request can use however many of them are free."""
        token, reserved, internal, _, free = super().slot_breakdown(final_tokens, 0)
        external = 0
        if min_waiting_pages > 1:
            external = sum(n for n in self._run_len.values() if n < min_waiting_pages) * self.page_size
        return token, reserved, internal, external, free - external

    def check_invariants(self) -> None:
        """Raise AssertionError unless the tables are contiguous and disjoint, the free runs
        maximal, and tables plus free runs cover every page but the null page exactly once."""
        covered: list[tuple[int, int]] = []
        for rid, table in self.page_tables.items():
            assert table == list(range(table[0], table[0] + len(table))), f"request {rid}: not one run"
            assert self._stored[rid] <= len(table) * self.page_size, f"request {rid}: stores more than its pages"
            covered.append((table[0], len(table)))
        assert sorted(self._run_starts) == self._run_starts == sorted(self._run_len)
        runs = [(s, self._run_len[s]) for s in self._run_starts]
        for (a, n), (b, _) in zip(runs, runs[1:]):
            assert a + n < b, "free runs overlap or touch (not merged)"
        assert sum(n for _, n in runs) == self._num_free
        pos = 1
        for start, length in sorted(covered + runs):
            assert start == pos, f"page {min(start, pos)}: handed out twice or lost"
            pos = start + length
        assert pos == self.num_pages, "a page was lost"
        assert self.num_stored_tokens == sum(self._stored.values())
        assert not self._is_free and not self._cached and not self._refs
