"""Page allocator: free list, growing page tables, reserve_max, prefix sharing, invariants under random use."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.cache import PageAllocator, make_allocator
from cbjax.cache.allocator import _IDS_MAX_PAGES, ROOM_TOKENS
from cbjax.cache.page_hash import ROOT_HASH, chain_hashes


def test_page_zero_is_never_handed_out_and_pages_are_reused_at_once():
    alloc = PageAllocator(num_pages=5, page_size=4)
    assert alloc.num_usable_pages == 4
    a = alloc.allocate("a", num_tokens=9, max_tokens=9)  # 3 pages
    assert a == [1, 2, 3]
    assert alloc.num_used_pages == 3 and alloc.num_free_pages == 1
    assert not alloc.can_allocate(8, 8)
    alloc.free("a")
    assert alloc.num_free_pages == 4
    b = alloc.allocate("b", num_tokens=16, max_tokens=16)
    assert sorted(b) == [1, 2, 3, 4]
    alloc.check_invariants()


def test_paged_grows_on_demand_one_page_per_page_size_tokens():
    alloc = PageAllocator(num_pages=10, page_size=4)
    alloc.allocate("r", num_tokens=3, max_tokens=100)
    assert len(alloc.page_tables["r"]) == 1
    assert alloc.pages_to_append("r", 4) == 0
    assert alloc.pages_to_append("r", 5) == 1
    alloc.append("r", 5)
    assert len(alloc.page_tables["r"]) == 2
    # token-state utilization: 5 tokens stored in 2 pages of 4
    assert alloc.token_utilization() == pytest.approx(5 / 8)


def test_a_requests_pages_are_consecutive_with_room_between_requests():
    # page_size 16: ROOM_TOKENS (256) is 16 pages of room. Placement by hand: a new stretch of n
    # pages takes the first run of 16 + n + 16 free pages from the cursor and starts after its
    # first 16; the cursor moves to the stretch's end.
    assert ROOM_TOKENS == 256
    alloc = PageAllocator(num_pages=200, page_size=16)
    assert alloc.allocate("a", 48, 48) == [17, 18, 19]  # the run 1-35; cursor 20
    assert alloc.allocate("b", 32, 32) == [36, 37]  # the run 20-53: a's 16 pages of room stay free
    alloc.append("a", 5 * 16)
    assert alloc.page_tables["a"] == [17, 18, 19, 20, 21]  # grows into its room
    alloc.append("a", 20 * 16)  # 17-35 are a's 19 pages; 36 is b's: a new stretch, the run 38-70
    assert alloc.page_tables["a"] == list(range(17, 36)) + [54]
    alloc.free("b")
    alloc.append("a", 22 * 16)
    assert alloc.page_tables["a"][-3:] == [54, 55, 56]
    assert alloc.num_used_pages == 22 and alloc.num_free_pages == 199 - 22
    alloc.check_invariants()


def test_placement_falls_back_to_shorter_runs_and_any_free_page():
    # 9 usable pages, fewer than the room: first fit, then any free page after the cursor
    alloc = PageAllocator(num_pages=10, page_size=16)
    assert alloc.allocate("a", 48, 48) == [1, 2, 3]  # cursor 4
    assert alloc.allocate("b", 32, 32) == [4, 5]  # cursor 6
    alloc.append("a", 4 * 16)  # page 4 is b's: the first free page from the cursor
    assert alloc.page_tables["a"] == [1, 2, 3, 6]
    alloc.free("b")
    # 7, 8 and 9 each after the last; then no free page after the cursor (7): the first from 1
    alloc.append("a", 8 * 16)
    assert alloc.page_tables["a"] == [1, 2, 3, 6, 7, 8, 9, 4]
    assert alloc.num_free_pages == 1
    alloc.check_invariants()


def test_a_run_no_search_found_is_searched_for_again_once_pages_are_freed():
    # 9 usable pages, fewer than the room: a stretch of n takes the first run of n free pages
    alloc = PageAllocator(num_pages=10, page_size=16)
    assert alloc.allocate("a", 32, 32) == [1, 2]  # the cursor moves to 3
    alloc.free("a")
    assert alloc.allocate("b", 32, 32) == [3, 4]  # from the cursor: pages 1-2 stay free below
    assert alloc.allocate("c", 48, 48) == [5, 6, 7]
    assert alloc.allocate("d", 48, 48) == [8, 9, 1]  # no 3 free in a row anywhere: page by page
    alloc.free("c")
    assert alloc.allocate("e", 48, 48) == [5, 6, 7]  # 3 in a row again (not 2, 5, 6)
    alloc.check_invariants()


def test_freeing_a_table_of_several_runs_frees_its_pages_only():
    # a's pages 1, 2, 3 and 6 are two runs around b's 4 and 5: freeing a must leave b's held
    alloc = PageAllocator(num_pages=10, page_size=16)
    alloc.allocate("a", 48, 48)
    alloc.allocate("b", 32, 32)
    alloc.append("a", 4 * 16)
    assert alloc.page_tables["a"] == [1, 2, 3, 6]
    alloc.free("a")
    alloc.check_invariants()
    assert alloc.page_tables == {"b": [4, 5]} and alloc.num_free_pages == 7
    assert sorted(alloc.allocate("c", 7 * 16, 7 * 16)) == [1, 2, 3, 6, 7, 8, 9]
    alloc.check_invariants()


def test_reserve_max_reserves_the_maximum_length_at_admission():
    alloc = make_allocator(num_pages=100, page_size=4, allocation="reserve_max")
    alloc.allocate("r", num_tokens=3, max_tokens=40)
    assert len(alloc.page_tables["r"]) == 10
    assert alloc.pages_to_append("r", 40) == 0
    assert alloc.token_utilization() == pytest.approx(3 / 40)


def test_errors_name_the_field_or_request():
    with pytest.raises(ValueError, match="cache.num_pages"):
        PageAllocator(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="cache.allocation"):
        make_allocator(num_pages=4, page_size=4, allocation="contiguous")
    alloc = PageAllocator(num_pages=3, page_size=4)
    with pytest.raises(ValueError, match="request x"):
        alloc.allocate("x", num_tokens=100, max_tokens=100)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(1, 30)), max_size=80),
    allocation=st.sampled_from(["paged", "reserve_max"]),
)
def test_no_page_is_both_free_and_owned_and_all_return(ops, allocation):
    alloc = make_allocator(num_pages=12, page_size=4, allocation=allocation)
    stored = {}
    for op, rid, n in ops:
        rid = str(rid)
        if op == "alloc" and rid not in stored and alloc.can_allocate(n, n + 8):
            alloc.allocate(rid, n, n + 8)
            stored[rid] = n
        elif op == "grow" and rid in stored:
            target = stored[rid] + n
            if alloc.can_append(rid, target):
                alloc.append(rid, target)
                stored[rid] = target
        elif op == "free" and rid in stored:
            alloc.free(rid)
            del stored[rid]
        alloc.check_invariants()
        assert alloc.num_stored_tokens == sum(stored.values())
    for rid in list(stored):
        alloc.free(rid)
    alloc.check_invariants()
    assert alloc.num_free_pages == alloc.num_usable_pages


def test_try_append_at_the_last_free_page():
    alloc = PageAllocator(num_pages=6, page_size=4)  # 5 usable pages
    alloc.allocate("a", num_tokens=8, max_tokens=8)  # 2 pages, 3 free
    assert not alloc.try_append("a", 4 * 5 + 1)  # 6 pages: one more than there are
    assert alloc.page_tables["a"] == [1, 2] and alloc.num_stored_tokens == 8 and alloc.num_free_pages == 3
    assert alloc.try_append("a", 4 * 5)  # exactly the 3 free ones
    assert len(alloc.page_tables["a"]) == 5 and alloc.num_stored_tokens == 20 and alloc.num_free_pages == 0
    assert alloc.try_append("a", 20)  # no new page needed
    alloc.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(0, 30)), max_size=80),
    allocation=st.sampled_from(["paged", "reserve_max"]),
)
def test_try_append_is_can_append_then_append(ops, allocation):
    # the scheduler's one-call growth against the two calls it replaces, on twin allocators
    one, two = (make_allocator(num_pages=12, page_size=4, allocation=allocation) for _ in range(2))
    stored = {}
    for op, rid, n in ops:
        rid = str(rid)
        if op == "alloc" and rid not in stored and two.can_allocate(n + 1, n + 9):
            one.allocate(rid, n + 1, n + 9)
            two.allocate(rid, n + 1, n + 9)
            stored[rid] = n + 1
        elif op == "grow" and rid in stored:
            target = stored[rid] + n
            fits = two.can_append(rid, target)
            if fits:
                two.append(rid, target)
                stored[rid] = target
            assert one.try_append(rid, target) is fits
        elif op == "free" and rid in stored:
            one.free(rid)
            two.free(rid)
            del stored[rid]
        assert one.page_tables == two.page_tables
        assert one.num_stored_tokens == two.num_stored_tokens == sum(stored.values())
        assert one.num_free_pages == two.num_free_pages
        one.check_invariants()


class Holder:
    """What `try_append_one_each` reads of a request."""

    def __init__(self, request_id: str, num_computed: int):
        self.request_id, self.num_computed = request_id, num_computed


@settings(max_examples=60, deadline=None)
@given(
    # lengths at a page's end (4, 8, 12) need a page for their next token; the others do not
    lengths=st.lists(st.sampled_from([3, 4, 7, 8, 12]), min_size=1, max_size=8),
    num_pages=st.integers(5, 14),
    allocation=st.sampled_from(["paged", "reserve_max"]),
)
def test_one_more_token_each_is_try_append_in_order_up_to_the_first_refusal(lengths, num_pages, allocation):
    # the planner's decodes in one call against try_append one request at a time, on twins
    one, two = (make_allocator(num_pages=num_pages, page_size=4, allocation=allocation) for _ in range(2))
    holders = []
    for i, n in enumerate(lengths):
        if not two.can_allocate(n, n + 6):
            break
        for alloc in (one, two):
            alloc.allocate(str(i), n, n + 6)
        holders.append(Holder(str(i), n))
    expected = 0
    for h in holders:
        if not two.try_append(h.request_id, h.num_computed + 1):
            break
        expected += 1
    assert one.try_append_one_each(holders) == expected
    assert one.page_tables == two.page_tables
    assert one.num_stored_tokens == two.num_stored_tokens
    assert one.num_free_pages == two.num_free_pages
    one.check_invariants()


class PageAtATime(PageAllocator):
    """The placement rule stated one page at a time (the class docstring's): the next page
    after the table's last while it is free, else a new stretch, found by trying every start."""

    def _place(self, n):
        for length, offset in ((self._room + n + self._room, self._room), (n + self._room, 0), (n, 0), (1, 0)):
            starts = [*range(self._cursor, self.num_pages), *range(1, self.num_pages)]
            at = next((a for a in starts if a + length <= self.num_pages and all(self._is_free[a : a + length])), None)
            if at is not None:
                self._cursor = at + offset + n
                return at + offset
        raise AssertionError("no free page")

    def _take(self, n, after=None, owner=None):
        pages, page = [], -1 if after is None else after + 1
        while len(pages) < n and self._num_free:
            if not (0 < page < self.num_pages and self._is_free[page]):
                page = self._place(n - len(pages))
            self._is_free[page] = 0
            self._num_free -= 1
            pages.append(page)
            page += 1
        return pages


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 9), st.integers(1, 90)), max_size=120),
    num_pages=st.sampled_from([12, 40, 90]),
)
def test_pages_taken_a_stretch_at_a_time_are_the_ones_taken_a_page_at_a_time(ops, num_pages):
    fast, slow = PageAllocator(num_pages, page_size=4), PageAtATime(num_pages, page_size=4)
    stored = {}
    for op, rid, n in ops:
        rid = str(rid)
        if op == "alloc" and rid not in stored and slow.can_allocate(n, n):
            assert fast.allocate(rid, n, n) == slow.allocate(rid, n, n)
            stored[rid] = n
        elif op == "grow" and rid in stored and slow.can_append(rid, stored[rid] + n):
            stored[rid] += n
            fast.append(rid, stored[rid])
            slow.append(rid, stored[rid])
        elif op == "free" and rid in stored:
            fast.free(rid)
            slow.free(rid)
            del stored[rid]
        assert fast.page_tables == slow.page_tables and fast._cursor == slow._cursor
        fast.check_invariants()


# ---- prefix caching ----


def test_shared_pages_are_refcounted_and_cached_after_the_last_user():
    alloc = PageAllocator(num_pages=8, page_size=4, prefix_caching=True)
    ids = list(range(12))
    hashes = chain_hashes(ROOT_HASH, ids, 4)  # 3 full pages
    a = alloc.allocate("a", 12, 12)
    assert alloc.match(hashes) == []  # nothing registered yet
    alloc.register("a", hashes, 3)
    assert alloc.match(hashes) == a
    # b shares a's first two pages (its own third page differs) and adds one page
    other = chain_hashes(ROOT_HASH, ids[:8] + [99, 98, 97, 96], 4)
    shared = alloc.match(other)
    assert shared == a[:2]
    b = alloc.allocate("b", 10, 10, cached=shared)
    assert b[:2] == a[:2] and b[2] not in a and alloc.num_used_pages == 4
    alloc.check_invariants()
    alloc.free("a")  # the shared pages stay owned by b; a's third page is cached
    assert alloc.num_used_pages == 3 and alloc.num_cached_pages == 1
    alloc.free("b")  # b's third page was never registered: it goes to the free list
    assert alloc.num_cached_pages == 3 and alloc.num_free_pages == alloc.num_usable_pages
    assert alloc.match(hashes) == a  # still reusable
    alloc.check_invariants()


def test_cached_pages_are_evicted_lru_only_once_no_page_is_free():
    alloc = PageAllocator(num_pages=6, page_size=2, prefix_caching=True)  # 5 usable pages
    x = chain_hashes(ROOT_HASH, [1, 2, 3, 4], 2)
    y = chain_hashes(ROOT_HASH, [5, 6], 2)
    alloc.allocate("x", 4, 4)
    alloc.register("x", x, 2)
    alloc.allocate("y", 2, 2)
    alloc.register("y", y, 1)
    alloc.free("x")  # released first: its tail page, then its head, are the least recent
    alloc.free("y")
    assert alloc.num_cached_pages == 3 and alloc.num_free_pages - alloc.num_cached_pages == 2
    alloc.allocate("z", 4, 4)  # the 2 free pages: nothing evicted
    assert alloc.num_evictions == 0 and alloc.match(x) != [] and len(alloc.match(x)) == 2
    alloc.append("z", 6)  # one more page: evicts x's tail page
    assert alloc.num_evictions == 1 and len(alloc.match(x)) == 1 and len(alloc.match(y)) == 1
    # a cached page about to be reused is not evicted to make room for its own request
    assert alloc.can_allocate(4, 4, cached=alloc.match(x)) and not alloc.can_allocate(6, 6, cached=alloc.match(x))
    w = alloc.allocate("w", 4, 4, cached=alloc.match(x))
    assert alloc.num_evictions == 2 and alloc.match(y) == []  # y's page made room
    assert len(w) == 2 and alloc.num_free_pages == 0
    alloc.check_invariants()


def test_pages_freed_by_counts_only_pages_no_other_table_holds():
    from cbjax.scheduler.view import PolicyView

    def freed(pool, ids):  # the policies' view of the pool: only the allocator is read
        return PolicyView(None, None, pool, None).pages_freed_by(ids)

    alloc = PageAllocator(num_pages=9, page_size=2, prefix_caching=True)
    x = chain_hashes(ROOT_HASH, [1, 2, 3, 4], 2)
    alloc.allocate("x", 5, 5)  # 3 pages, its 2 full ones registered
    alloc.register("x", x, 2)
    alloc.allocate("y", 5, 5, cached=alloc.match(x))  # shares x's 2, one of its own
    alloc.allocate("z", 4, 4, cached=alloc.match(x))  # shares the same 2, nothing of its own
    # y alone frees its own page; y and z free that one only (x still holds the 2 shared);
    # all three free the 4 distinct pages
    assert [freed(alloc, ids) for ids in (["y"], ["y", "z"], ["x", "y", "z"], [])] == [1, 1, 4, 0]
    assert [alloc.num_holders(p) for p in alloc.page_tables["y"]] == [3, 3, 1]
    plain = PageAllocator(num_pages=9, page_size=2)
    plain.allocate("a", 5, 5)
    plain.allocate("b", 2, 2)
    assert freed(plain, ["a", "b"]) == 4


def test_register_needs_prefix_caching():
    alloc = PageAllocator(num_pages=4, page_size=2)
    alloc.allocate("a", 2, 2)
    with pytest.raises(ValueError, match="request a: register needs cache.prefix_caching"):
        alloc.register("a", chain_hashes(ROOT_HASH, [1, 2], 2), 1)


def sequence(rid, group):
    """Request `rid`'s tokens: 12 of its group's, then its own."""
    return [group * 100 + t if t < 12 else 1000 * (rid + 1) + t for t in range(40)]


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "grow", "free", "free"]), st.integers(0, 5), st.integers(1, 16),
            st.integers(0, 1), st.booleans(),
        ),
        max_size=120,
    ),  # fmt: skip
    allocation=st.sampled_from(["paged"]),
)
def test_prefix_caching_refcounts_eviction_and_contents(ops, allocation):
    # A page's contents are modelled as the token ids written to it. A cache hit must hand back
    # pages holding exactly the matching tokens, however pages were shared, cached and evicted.
    # After a write, the request registers its full pages, or (`lazy`) leaves them for later.
    alloc = PageAllocator(num_pages=9, page_size=4, allocation=allocation, prefix_caching=True)
    contents: dict[int, tuple] = {}
    held = {}  # rid -> (tokens, stored count)

    def write(rid, lo, hi, lazy):
        ids, table = held[rid][0], alloc.page_tables[rid]
        for i in range(lo // 4, alloc.pages_for(hi)):
            assert alloc._hash_of[table[i]] is None, "writing into a registered page"
            contents[table[i]] = tuple(ids[i * 4 : min((i + 1) * 4, hi)])
        if not lazy:
            alloc.register(rid, chain_hashes(ROOT_HASH, ids[:hi], 4), hi // 4)

    for op, num, n, group, lazy in ops:
        rid = str(num)
        if op == "alloc" and rid not in held:
            ids = sequence(num, group)
            n = min(n, len(ids))
            cached = alloc.match(chain_hashes(ROOT_HASH, ids[: n - 1], 4))
            for i, page in enumerate(cached):
                assert contents[page] == tuple(ids[i * 4 : (i + 1) * 4])
            if alloc.can_allocate(n, n + 8, cached):
                table = alloc.allocate(rid, n, n + 8, cached)
                assert table[: len(cached)] == cached
                held[rid] = (ids, n)
                write(rid, len(cached) * 4, n, lazy)
            else:
                with pytest.raises(ValueError, match=f"request {rid}: needs"):
                    alloc.allocate(rid, n, n + 8, cached)
        elif op == "grow" and rid in held:
            ids, stored = held[rid]
            target = min(stored + n, len(ids))
            if alloc.can_append(rid, target):
                alloc.append(rid, target)
                held[rid] = (ids, target)
                write(rid, stored, target, lazy)
        elif op == "free" and rid in held:
            alloc.free(rid)
            del held[rid]
        alloc.check_invariants()
        assert alloc.num_stored_tokens == sum(stored for _, stored in held.values())
        assert alloc.num_used_pages + alloc.num_free_pages == alloc.num_usable_pages
    for rid in list(held):
        alloc.free(rid)
    alloc.check_invariants()
    # every page is back: free, or cached for reuse
    assert alloc.num_free_pages == alloc.num_usable_pages and alloc.num_used_pages == 0
    # new contents for every page evict every cached one, and nothing matches any more
    cached, evictions = alloc.num_cached_pages, alloc.num_evictions
    alloc.allocate("fill", alloc.num_usable_pages * 4, alloc.num_usable_pages * 4)
    assert alloc.num_evictions == evictions + cached and alloc.num_cached_pages == 0
    assert all(alloc.match(chain_hashes(ROOT_HASH, sequence(n, g), 4)) == [] for n in range(6) for g in range(2))
    alloc.check_invariants()


@pytest.mark.parametrize("allocation", ["paged", "reserve_max"])
def test_a_pool_past_the_page_id_list_hands_out_the_same_tables(allocation):
    """Past `_IDS_MAX_PAGES` pages the allocator takes page ids from `range` rather than from a
    list it made once: tables are still lists, and the same pages as a pool at the limit's."""
    tables = {}
    for num_pages in (_IDS_MAX_PAGES, _IDS_MAX_PAGES + 1):
        alloc = make_allocator(num_pages, 16, allocation)
        got = [alloc.allocate(f"r{i}", 100 + 37 * i, 300) for i in range(4)]
        alloc.free("r1")
        got.append(alloc.allocate("r4", 500, 600))
        assert all(type(t) is list for t in got)
        alloc.check_invariants()
        tables[num_pages] = got
    assert tables[_IDS_MAX_PAGES] == tables[_IDS_MAX_PAGES + 1]


def test_cached_pages_leave_in_the_order_they_were_released():
    """An oracle queue of cached pages: a page joins at the back when its last holder frees it
    (tail first), leaves when a hit takes it back, and eviction takes from the front. Random
    requests of a few shared prefixes, long enough that the allocator drops its queue's spent
    entries several times."""
    rng = random.Random(3)
    alloc = PageAllocator(num_pages=24, page_size=2, prefix_caching=True)
    evicted: list[int] = []
    alloc.on_evict = lambda page, h: evicted.append(page)
    order: list[int] = []  # the oracle: cached pages, least recently released first
    held: dict[str, list[int]] = {}
    num_evicted = 0
    for step in range(6000):
        if held and (len(held) > 6 or rng.random() < 0.45):
            rid = rng.choice(sorted(held))
            table = held.pop(rid)
            alloc.free(rid)
            others = {p for t in held.values() for p in t}
            order += [p for p in reversed(table) if p not in others and alloc._hash_of[p] is not None]
        else:
            rid = f"r{step}"
            ids = [rng.randrange(3)] * 4 + [step] * rng.randrange(1, 9)  # a shared head, then its own
            hashes = chain_hashes(ROOT_HASH, ids, 2)
            cached = alloc.match(hashes[: (len(ids) - 1) // 2])
            if not alloc.can_allocate(len(ids), len(ids), cached):
                continue
            before = len(evicted)
            held[rid] = alloc.allocate(rid, len(ids), len(ids), cached)
            order = [p for p in order if p not in cached]  # hits leave the queue
            taken = evicted[before:]
            assert taken == order[: len(taken)], step  # the least recently released, in order
            del order[: len(taken)]
            num_evicted += len(taken)
            alloc.register(rid, hashes, len(ids) // 2)
        assert alloc.num_cached_pages == len(order)
        alloc.check_invariants()
    assert num_evicted > 1000 and alloc._cached.base > 0  # evictions, and spent entries dropped


def test_the_release_queue_stays_small_when_hits_take_pages_back_without_evictions():
    """Each round a request hits the same cached prefix, taking its pages out of the queue
    (dead entries behind), and frees them again; the pool never evicts. The queue's list must
    not grow with the rounds, and its order must stay that of release."""
    alloc = PageAllocator(num_pages=64, page_size=2, prefix_caching=True)
    ids = [1, 2, 3, 4, 5, 6, 7]
    hashes = chain_hashes(ROOT_HASH, ids, 2)
    alloc.allocate("first", 7, 7)
    alloc.register("first", hashes, 3)
    alloc.free("first")
    for r in range(4000):
        rid = f"r{r}"
        cached = alloc.match(hashes)
        assert len(cached) == 3
        alloc.allocate(rid, 7, 7, cached)
        alloc.free(rid)
        if r % 500 == 0:
            alloc.check_invariants()
    alloc.check_invariants()
    assert alloc.num_evictions == 0 and alloc.num_cached_pages == 3
    assert len(alloc._cached.entries) < 2 * 4096  # 12,000 releases passed through it
    assert alloc._cached.pages() == list(reversed(cached))  # tail first, as released
