"""Host-side KV cache bookkeeping."""

from cbjax.cache.allocator import PageAllocator

__all__ = ["PageAllocator"]
