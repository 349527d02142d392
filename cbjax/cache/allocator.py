"""Paged KV page allocator: a free list, growing page tables, refcounted prefix sharing (never imports jax)."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from cbjax.cache.invariants import check_paged_pool
from cbjax.cache.release_queue import ReleaseQueue
from cbjax.core.request import Request

_IDS_MAX_PAGES = 1 << 18

# cache.allocation modes, the one list the config checks against.
ALLOCATIONS = ("paged", "reserve_max", "reserve_pow2", "reserve_oracle")

ROOM_TOKENS = 256  # tokens of growth room a placed run leaves after the request before it (see PageAllocator)


class PageAllocator:
    """Hands out fixed-size pages; page 0 is the null page that padded slots point at.

    `paged`: a request's page table grows on demand as tokens are appended. The Orca-style
    reservations (`reserve_*`) are `cbjax.cache.reservation.ReservationAllocator`; build
    either with `make_allocator`.

    Every page is in exactly one state: free, cached (holds a registered
    full page of tokens, referenced by nobody, evictable in LRU order), or owned (its refcount
    is the number of page tables holding it). Without prefix caching nothing is registered, so
    no page is ever cached or shared, and refcounts (all 1) are not kept. With it, `register`
    records a request's full pages under their chained hashes, `match` finds the longest
    cached prefix of a hash chain, and `allocate(..., cached=pages)` shares those pages. A
    released page whose refcount drops to 0 stays cached until no page is free and a new
    page is needed: then the least recently released cached page is evicted.

    Placement: a request's pages are consecutive page ids wherever the pool allows, so each
    (layer, kv head) of its K/V is one stretch of memory that the CPU's prefetchers stream,
    not pages scattered over the pool. A request's next page is the one after its last page
    when that one is free; else a new stretch starts in the first run of free pages after a
    cursor (next fit) long enough that `ROOM_TOKENS` of free pages stay between the stretch
    and the pages before it, the room the request ending there grows into, and as much again
    after it for its own growth. Where the pool has no such run the demands shrink, down to
    any free page. Placement changes only which pages, never how many: counts, admission and
    preemption are the same under any placement.
    """

    NULL_PAGE = 0

    def __init__(self, num_pages: int, page_size: int, allocation: str = "paged", prefix_caching: bool = False):
        if num_pages < 2:
            raise ValueError(f"cache.num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"cache.page_size must be >= 1, got {page_size}")
        if allocation != "paged":
            raise ValueError(f"cache.allocation: PageAllocator is paged, got {allocation!r}; use make_allocator")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserve = False
        self.prefix_caching = prefix_caching
        self._is_free = bytearray(b"\0") + bytearray(b"\1") * (num_pages - 1)  # page -> 1 if free
        # page ids to slice tables from (36 bytes a page, no new ints); a large pool's from `range`
        self._ids = list(range(num_pages)) if num_pages <= _IDS_MAX_PAGES else range(num_pages)
        self._num_free = num_pages - 1
        self._cursor = 1  # where the next stretch's search starts
        self._absent = num_pages  # no run of this many free pages exists (taking pages makes none)
        self._room = max(1, ROOM_TOKENS // page_size)  # pages
        # prefix caching only, indexed by page: the page tables holding it beside the first (0:
        # one, or not owned), and its hash while registered (else None)
        self._refs: list[int] = [0] * num_pages if prefix_caching else []
        self._cached = ReleaseQueue(num_pages if prefix_caching else 0)  # registered, held by none
        self._page_of: dict[int, int] = {}  # hash -> registered page
        self._hash_of: list[Optional[int]] = [None] * num_pages if prefix_caching else []
        self._num_hashed: dict[str, int] = {}  # request -> leading pages already offered to `register`
        self._scattered: set[str] = set()  # requests whose tables are not one ascending run of pages
        self.page_tables: dict[str, list[int]] = {}
        self._stored: dict[str, int] = {}
        self.num_stored_tokens = 0
        self.num_evictions = 0
        # on_evict(page, hash): a cached page is evicted (the host tier keeps it); None: dropped
        self.on_evict = None

    # ---- counters ----
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out: free, or cached and unreferenced (evictable)."""
        return self._num_free + self._cached.count

    @property
    def num_cached_pages(self) -> int:
        """Unreferenced pages kept for prefix reuse."""
        return self._cached.count

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one page table (a shared page counts once)."""
        return self.num_pages - 1 - self._num_free - self._cached.count

    def token_utilization(self, used: Optional[int] = None) -> float:
        """Tokens stored / token capacity of the owned pages (1.0 when nothing is owned; over 1 with
        shared prefix pages, as tokens count per request). `used`: `num_used_pages`, if known."""
        if used is None:
            used = self.num_used_pages
        return self.num_stored_tokens / (used * self.page_size) if used else 1.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache ----
    def match(self, hashes: Sequence[int]) -> list[int]:
        """The pages of the longest cached prefix of a hash chain (from `chain_hashes`)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_hashed(self, request_id: str) -> int:
        """The request's leading pages already offered to `register` (0 if it holds none)."""
        return self._num_hashed.get(request_id, 0)

    def register(self, request_id: str, hashes: Sequence[int], num_pages: int) -> None:
        """Record the request's first `num_pages` pages, full and computed, as holding
        `hashes[:num_pages]` (fewer if fewer hashes are known). Cheap when nothing is new.
        A hash already cached in another page stays there; this page is then not cached."""
        if not self.prefix_caching:
            raise ValueError(f"request {request_id}: register needs cache.prefix_caching=true")
        table = self.page_tables[request_id]
        num_pages = min(num_pages, len(hashes))
        if num_pages > len(table):
            raise ValueError(f"request {request_id}: registers {num_pages} pages, holds {len(table)}")
        lo = self._num_hashed[request_id]
        if num_pages <= lo:
            return
        page_of, hash_of = self._page_of, self._hash_of
        for page, h in zip(table[lo:num_pages], hashes[lo:num_pages]):
            if h not in page_of and hash_of[page] is None:
                page_of[h] = page
                hash_of[page] = h
        self._num_hashed[request_id] = num_pages

    def cache_pages(self, hashes: Sequence[int]) -> list[int]:
        """New pages registered under `hashes` (none cached now), left cached as the most recently
        released: where a prefetch loads a waiting request's pages, for its admission to match."""
        if len(hashes) > self.num_free_pages:
            raise ValueError(f"cache_pages: {len(hashes)} pages, {self.num_free_pages} free")
        if any(h in self._page_of for h in hashes):
            raise ValueError("cache_pages: a hash is cached already")
        pages = self._take(len(hashes))
        for page, h in zip(pages, hashes):
            self._page_of[h] = page
            self._hash_of[page] = h
            self._cached.push(page)
        return pages

    # ---- admission ----
    def admission_pages(self, num_tokens: int, max_tokens: int) -> int:
        """Pages a request needs at admission: for its `num_tokens` tokens now (`max_tokens`, the
        tokens a reservation would cover, matters only to reserving allocators)."""
        return self.pages_for(num_tokens)

    def can_allocate(self, num_tokens: int, max_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether `allocate` would succeed. Cached pages are reused; those nobody holds leave
        the evictable pool, so they count against the pages available."""
        new = self.admission_pages(num_tokens, max_tokens) - len(cached)
        revived = sum(1 for p in cached if p in self._cached) if cached else 0
        return new + revived <= self.num_free_pages

    def allocate(self, request_id: str, num_tokens: int, max_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """A page table for `num_tokens` tokens whose first len(cached) pages are `cached`
        (pages from `match`, shared), the rest newly handed out."""
        if request_id in self.page_tables:
            raise ValueError(f"request {request_id}: already holds pages")
        need = self.admission_pages(num_tokens, max_tokens)
        if len(cached) > need:
            raise ValueError(f"request {request_id}: reuses {len(cached)} cached pages for {need} pages in all")
        if not self.can_allocate(num_tokens, max_tokens, cached):
            raise ValueError(f"request {request_id}: needs {need} pages, {self.num_free_pages} free")
        for page in cached:
            if not self.prefix_caching or self._hash_of[page] is None:
                raise ValueError(f"request {request_id}: page {page} is not a cached page")
            self._hold(page)
        table = list(cached) + self._take(need - len(cached), cached[-1] if cached else None, request_id)
        self.page_tables[request_id] = table
        if cached:
            self._scattered.add(request_id)
        self._num_hashed[request_id] = len(cached)
        self._stored[request_id] = num_tokens
        self.num_stored_tokens += num_tokens
        return table

    # ---- growth ----
    def pages_to_append(self, request_id: str, num_tokens: int) -> int:
        """Extra pages the request needs to hold `num_tokens` tokens in all."""
        return max(0, self.pages_for(num_tokens) - len(self.page_tables[request_id]))

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        # the scheduler's hottest call: num_free_pages and pages_to_append inlined
        need = -(-num_tokens // self.page_size) - len(self.page_tables[request_id])
        return need <= self._num_free + self._cached.count

    def try_append(self, request_id: str, num_tokens: int) -> bool:
        """`append` if `can_append`; whether it did (one call for the scheduler's hot path)."""
        table = self.page_tables[request_id]
        need = -(-num_tokens // self.page_size) - len(table)
        if need > 0:
            if need > self._num_free + self._cached.count:
                return False
            table.extend(self._take(need, table[-1] if table else None, request_id))
        self.num_stored_tokens += num_tokens - self._stored[request_id]
        self._stored[request_id] = num_tokens
        return True

    def try_append_one_each(self, requests: Sequence[Request]) -> int:
        """`try_append(r.request_id, r.num_computed + 1)` for each of `requests` in order (each
        stores one token more), up to the first that fails; returns how many succeeded. The
        scheduler's decodes in one call: they are most of a step's rows."""
        tables, stored, ps = self.page_tables, self._stored, self.page_size
        done = grown = 0
        for req in requests:
            rid = req.request_id
            table = tables[rid]
            num_tokens = req.num_computed + 1
            if num_tokens > len(table) * ps:
                need = -(-num_tokens // ps) - len(table)
                if need > self._num_free + self._cached.count:
                    break
                table.extend(self._take(need, table[-1] if table else None, rid))
            grown += num_tokens - stored[rid]
            stored[rid] = num_tokens
            done += 1
        self.num_stored_tokens += grown
        return done

    def append(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's page table to hold `num_tokens` tokens in all."""
        table = self.page_tables[request_id]
        need = -(-num_tokens // self.page_size) - len(table)
        if need > self._num_free + self._cached.count:
            raise ValueError(f"request {request_id}: needs {need} more pages, {self.num_free_pages} free")
        if need > 0:
            table.extend(self._take(need, table[-1] if table else None, request_id))
        self.num_stored_tokens += num_tokens - self._stored[request_id]
        self._stored[request_id] = num_tokens

    def num_holders(self, page: int) -> int:
        """How many page tables hold the owned `page` (a shared prefix page: several)."""
        return self._refs[page] + 1 if self.prefix_caching else 1

    # ---- release ----
    def free(self, request_id: str) -> None:
        """Release the request's pages: one nobody else holds goes free, or cached if registered."""
        table = self.page_tables.pop(request_id)
        self.num_stored_tokens -= self._stored.pop(request_id)
        del self._num_hashed[request_id]
        scattered = request_id in self._scattered
        self._scattered.discard(request_id)
        if not self.prefix_caching:
            is_free, n = self._is_free, len(table)
            if scattered:
                for page in table:
                    is_free[page] = 1
                self._freed(table)
            elif n:  # one ascending run (placement's aim): one copy, and one run to measure
                is_free[table[0] : table[0] + n] = b"\1" * n
                self._freed(table[:1])
            self._num_free += n
            return
        # Tail first, so a sequence's last pages are evicted before the prefix they extend.
        refs, hash_of, is_free, cached = self._refs, self._hash_of, self._is_free, self._cached
        lru, at = cached.entries, cached.at  # ReleaseQueue.push, inlined
        freed = []
        start = pos = cached.base + len(lru)
        for page in reversed(table):
            if refs[page]:  # another table holds it
                refs[page] -= 1
            elif hash_of[page] is not None:
                lru.append(page)
                at[page] = pos
                pos += 1
            else:
                is_free[page] = 1
                freed.append(page)
        self._num_free += len(freed)
        cached.count += pos - start
        self._freed(freed)

    def _freed(self, pages: list[int]) -> None:
        """`pages` went free: a run holding one may pass `_absent` (no other run grew)."""
        if len(pages) > 8:  # too many runs to measure: they may make a run of any length
            self._absent = self.num_pages
            return
        is_free = self._is_free
        for page in pages:
            end = is_free.find(b"\0", page)  # (rfind meets the null page at the latest)
            length = (self.num_pages if end < 0 else end) - is_free.rfind(b"\0", 0, page) - 1
            self._absent = max(self._absent, length + 1)

    def _hold(self, page: int) -> None:
        if page in self._cached:
            self._cached.remove(page)
        else:
            self._refs[page] += 1

    def _take(self, n: int, after: int | None = None, owner: str | None = None) -> list[int]:
        """`n` pages for new contents after a table's last page `after` (None: an empty table):
        free ones, placed (see the class), then the least recently released cached ones. The
        table is `owner`'s, marked scattered unless they continue it in one run."""
        is_free, pages = self._is_free, []
        page = -1 if after is None else after + 1
        if n == 1 and 0 < page < self.num_pages and is_free[page]:  # a table's next page, free
            is_free[page], self._num_free = 0, self._num_free - 1
            return [page]
        jumps = 0  # runs started by placement, not at the table's next page
        while len(pages) < n and self._num_free:
            if not (0 < page < self.num_pages and is_free[page]):
                page, jumps = self._place(n - len(pages)), jumps + 1
            # the free pages from `page` on, up to the first taken one, a stretch at a time
            stop = min(self.num_pages, page + n - len(pages), page + self._num_free)
            end = is_free.find(b"\0", page, stop)
            end = stop if end < 0 else end
            is_free[page:end] = bytes(end - page)
            self._num_free -= end - page
            pages += self._ids[page:end]
            page = end
        if owner is not None and (jumps > (after is None) or len(pages) < n):  # (or cached pages evicted)
            self._scattered.add(owner)
        evict = n - len(pages)
        if evict:  # the least recently released cached pages, in that order
            pages += self._evict(evict)
        return pages

    def _evict(self, n: int) -> list[int]:
        """Unregister the `n` least recently released cached pages; returns them in that order."""
        evicted = self._cached.pop_front(n)
        hash_of, page_of, on_evict = self._hash_of, self._page_of, self.on_evict
        for page in evicted:
            h, hash_of[page] = hash_of[page], None
            del page_of[h]
            if on_evict is not None:
                on_evict(page, h)
        self.num_evictions += n
        return evicted

    def _place(self, n: int) -> int:
        """The first page of a new stretch for `n` pages (some page is free): the first run from the
        cursor (then page 1) of room + n + room free pages, after its first room; else of n + room,
        then n, then 1 free page, at its first."""
        room, is_free = self._room, self._is_free
        for length, offset in ((room + n + room, room), (n + room, 0), (n, 0), (1, 0)):
            if length >= self._absent:  # searched in vain since the last free: in vain again
                continue
            run = b"\1" * length
            at = is_free.find(run, self._cursor)
            if at < 0:
                at = is_free.find(run, 1)
            if at > 0:
                self._cursor = at + offset + n
                return at + offset
            self._absent = length
        raise AssertionError("_place: no free page")  # _take checks _num_free first

    # ---- the pool's five shares ----
    def slot_breakdown(self, final_tokens: Iterable[tuple[str, int]], min_waiting_pages: int) -> tuple[int, int, int, int, int]:
        """The pool's slots (`num_usable_pages * page_size`, one token's K/V each) split into
        (token states, reserved, internal fragmentation, external fragmentation, free), which sum
        to the pool. `final_tokens` pairs each request holding pages with f, the tokens it stores
        at its final length; s is its stored tokens and c its pages' slots. Token states: s (a
        prefix page shared by several requests counts once). Reserved: min(c, max(f, s)) - s,
        held slots its future tokens fill. Internal: c - min(c, max(f, s)), held slots never
        filled (a reservation past its final length, its last page's tail). External: free slots
        no waiting request can use for want of contiguity, 0 here where any page serves any
        request. Free: the rest (free pages, and unreferenced prefix-cache pages: evictable)."""
        ps = self.page_size
        tables, stored = self.page_tables, self._stored
        filled = 0  # sum of min(c, max(f, s)): slots that hold or will hold a token
        for rid, f in final_tokens:
            c = len(tables[rid]) * ps
            if f >= c:
                filled += c
            else:
                s = stored[rid]
                filled += f if f > s else s
        used = self.num_used_pages * ps
        held = sum(len(t) for t in tables.values()) * ps if self.prefix_caching else used
        # each extra holder of a shared page counted its page_size (full, computed) tokens again
        token = self.num_stored_tokens - (held - used)
        reserved = filled - self.num_stored_tokens
        internal = held - filled
        return token, reserved, internal, 0, (self.num_pages - 1) * ps - used  # num_usable_pages

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool's state is consistent (`check_paged_pool`)."""
        check_paged_pool(self)
