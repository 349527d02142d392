"""The paged pool's invariants (`PageAllocator.check_invariants`): a test oracle that reads
the allocator's private state, kept apart from its hot paths."""

from __future__ import annotations


def check_paged_pool(alloc) -> None:
    """Raise AssertionError unless every page is exactly one of free, cached or owned, with
    owned refcounts equal to the page tables holding them, and the hash index consistent."""
    counts: dict[int, int] = {}
    for rid, table in alloc.page_tables.items():
        assert len(set(table)) == len(table), f"request {rid}: holds a page twice"
        for p in table:
            counts[p] = counts.get(p, 0) + 1
    if alloc.prefix_caching:
        extra = {p: r for p, r in enumerate(alloc._refs) if r}  # holders beside the first
        assert extra == {p: c - 1 for p, c in counts.items() if c > 1}, "a refcount differs from the page tables holding the page"
    else:
        assert not alloc._refs and all(c == 1 for c in counts.values()), "a page is shared without prefix caching"
    free, cached, owned = {p for p, f in enumerate(alloc._is_free) if f}, set(alloc._cached.pages()), set(counts)
    alloc._cached.check()
    hash_of = {p: h for p, h in enumerate(alloc._hash_of) if h is not None}  # registered page -> hash
    assert len(free) == alloc._num_free, "the free count differs from the free pages"
    longest = max((len(run) for run in bytes(alloc._is_free).split(b"\0")), default=0)
    assert longest < alloc._absent, f"a run of {longest} free pages exists, placement skips runs of {alloc._absent}"
    assert not free & owned and not free & cached and not cached & owned, "a page is in two states"
    assert alloc.NULL_PAGE not in free | cached | owned, "the null page was handed out"
    assert free | cached | owned == set(range(1, alloc.num_pages)), "a page was lost"
    assert not free & set(hash_of), "a free page is still registered"
    assert cached <= set(hash_of), "a cached page is not registered"
    assert {p: h for h, p in alloc._page_of.items()} == hash_of, "the hash index is inconsistent"
    assert alloc.prefix_caching or not alloc._hash_of and not alloc._page_of, "a page was registered without prefix caching"
    assert alloc.num_stored_tokens == sum(alloc._stored.values())
    assert alloc._num_hashed.keys() == alloc.page_tables.keys()
    assert alloc._scattered <= alloc.page_tables.keys(), "a freed table is still marked scattered"
    for rid, table in alloc.page_tables.items():
        run = list(range(table[0], table[0] + len(table))) if table else []
        assert rid in alloc._scattered or table == run, f"request {rid}: pages not one run, unmarked"
    for rid, table in alloc.page_tables.items():
        assert alloc._stored[rid] <= len(table) * alloc.page_size, f"request {rid}: stores more than its pages"
