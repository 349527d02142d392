"""Page allocator: free list, growing page tables, reserve_max, invariants under random use."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.cache import PageAllocator


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


def test_reserve_max_reserves_the_maximum_length_at_admission():
    alloc = PageAllocator(num_pages=100, page_size=4, allocation="reserve_max")
    alloc.allocate("r", num_tokens=3, max_tokens=40)
    assert len(alloc.page_tables["r"]) == 10
    assert alloc.pages_to_append("r", 40) == 0
    assert alloc.token_utilization() == pytest.approx(3 / 40)


def test_errors_name_the_field_or_request():
    with pytest.raises(ValueError, match="cache.num_pages"):
        PageAllocator(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="cache.allocation"):
        PageAllocator(num_pages=4, page_size=4, allocation="contiguous")
    alloc = PageAllocator(num_pages=3, page_size=4)
    with pytest.raises(ValueError, match="request x"):
        alloc.allocate("x", num_tokens=100, max_tokens=100)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(1, 30)), max_size=80),
    allocation=st.sampled_from(["paged", "reserve_max"]),
)
def test_no_page_is_both_free_and_owned_and_all_return(ops, allocation):
    alloc = PageAllocator(num_pages=12, page_size=4, allocation=allocation)
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
