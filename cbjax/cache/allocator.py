"""Paged KV page allocator: a free list and a growing page table per request (never imports jax)."""

from __future__ import annotations


class PageAllocator:
    """Hands out fixed-size pages; page 0 is the null page that padded slots point at.

    `paged` grows a request's page table on demand as tokens are appended. `reserve_max`
    reserves pages for the request's maximum length at admission: the contiguous,
    Orca(Max)-style baseline of the vLLM paper.
    """

    NULL_PAGE = 0

    def __init__(self, num_pages: int, page_size: int, allocation: str = "paged"):
        if num_pages < 2:
            raise ValueError(f"cache.num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"cache.page_size must be >= 1, got {page_size}")
        if allocation not in ("paged", "reserve_max"):
            raise ValueError(f"cache.allocation: unknown value {allocation!r}; choose paged or reserve_max")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserve_max = allocation == "reserve_max"
        # Popping from the end hands out low page numbers first.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self.page_tables: dict[str, list[int]] = {}
        self._stored: dict[str, int] = {}
        self.num_stored_tokens = 0

    # ---- counters ----
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def token_utilization(self) -> float:
        """Tokens stored / token capacity of the allocated pages (1.0 when nothing is allocated)."""
        used = self.num_used_pages
        return self.num_stored_tokens / (used * self.page_size) if used else 1.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- admission ----
    def admission_pages(self, num_tokens: int, max_tokens: int) -> int:
        """Pages a request needs at admission: for its tokens now, or its maximum under reserve_max."""
        return self.pages_for(max_tokens if self.reserve_max else num_tokens)

    def can_allocate(self, num_tokens: int, max_tokens: int) -> bool:
        return self.admission_pages(num_tokens, max_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int, max_tokens: int) -> list[int]:
        if request_id in self.page_tables:
            raise ValueError(f"request {request_id}: already holds pages")
        need = self.admission_pages(num_tokens, max_tokens)
        if need > len(self._free):
            raise ValueError(f"request {request_id}: needs {need} pages, {len(self._free)} free")
        table = [self._free.pop() for _ in range(need)]
        self.page_tables[request_id] = table
        self._stored[request_id] = num_tokens
        self.num_stored_tokens += num_tokens
        return table

    # ---- growth ----
    def pages_to_append(self, request_id: str, num_tokens: int) -> int:
        """Extra pages the request needs to hold `num_tokens` tokens in all."""
        return max(0, self.pages_for(num_tokens) - len(self.page_tables[request_id]))

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_to_append(request_id, num_tokens) <= len(self._free)

    def append(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's page table to hold `num_tokens` tokens in all."""
        table = self.page_tables[request_id]
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            raise ValueError(f"request {request_id}: needs {need} more pages, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())
        self.num_stored_tokens += num_tokens - self._stored[request_id]
        self._stored[request_id] = num_tokens

    # ---- release ----
    def free(self, request_id: str) -> None:
        """Return all of the request's pages to the free list at once."""
        table = self.page_tables.pop(request_id)
        self.num_stored_tokens -= self._stored.pop(request_id)
        self._free.extend(reversed(table))

    def check_invariants(self) -> None:
        """Raise AssertionError if any page is lost, shared, or both free and owned."""
        owned = [p for table in self.page_tables.values() for p in table]
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert len(set(owned)) == len(owned), "a page is owned twice"
        assert not free & set(owned), "a page is both free and owned"
        assert self.NULL_PAGE not in free and self.NULL_PAGE not in owned, "the null page was handed out"
        assert free | set(owned) == set(range(1, self.num_pages)), "a page was lost"
        assert self.num_stored_tokens == sum(self._stored.values())
        for rid, table in self.page_tables.items():
            assert self._stored[rid] <= len(table) * self.page_size, f"request {rid}: stores more than its pages"
