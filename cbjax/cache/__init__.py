"""Host-side KV cache bookkeeping."""

from cbjax.cache.allocator import ALLOCATIONS, PageAllocator
from cbjax.cache.prefix import PrefixCache
from cbjax.cache.reservation import ReservationAllocator

__all__ = ["ALLOCATIONS", "PageAllocator", "PrefixCache", "ReservationAllocator", "make_allocator"]


def make_allocator(
    num_pages: int, page_size: int, allocation: str = "paged", prefix_caching: bool = False, fit: str = "first_fit"
):
    """The allocator for `cache.allocation`: paged pages on demand, or contiguous reservations."""
    if allocation == "paged":
        return PageAllocator(num_pages, page_size, allocation, prefix_caching)
    if allocation in ALLOCATIONS:  # every mode but paged reserves
        if prefix_caching:
            raise ValueError(f"cache.allocation={allocation} cannot combine with cache.prefix_caching=true")
        return ReservationAllocator(num_pages, page_size, allocation, fit)
    raise ValueError(f"cache.allocation: unknown value {allocation!r}; choose one of {', '.join(ALLOCATIONS)}")
