"""Host-side KV cache bookkeeping."""

from cbjax.cache.allocator import ALLOCATIONS, PageAllocator
from cbjax.cache.prefix import PrefixCache

__all__ = ["ALLOCATIONS", "PageAllocator", "PrefixCache"]
