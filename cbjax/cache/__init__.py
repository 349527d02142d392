"""Host-side KV cache bookkeeping."""

from cbjax.cache.allocator import PageAllocator
from cbjax.cache.prefix import PrefixCache

__all__ = ["PageAllocator", "PrefixCache"]
