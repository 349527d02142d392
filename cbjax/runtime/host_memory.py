"""Keep freed host memory in the process for reuse, so XLA:CPU's step buffers are not faulted in anew.

XLA:CPU allocates each execution's temporary buffer with malloc and frees it afterwards. glibc
serves an allocation above its mmap threshold (at most 32 MB by its own adjustment) with a fresh
mmap and returns it on free, so a large step pays the kernel's page faults, zeroing included, on
every call: the peer tiny shape's 4096-token prefill step took 10,575 minor faults a call (about
41 MB) and ran 150 ms instead of 172. With the mmap threshold raised and the heap never trimmed,
the step reuses the same heap memory and faults only on its first call.

`retain_freed_memory()` sets both glibc options (`mallopt`) for the whole process; the CPU
executor calls it once it knows it runs there. The process's resident memory then stays at its
peak instead of shrinking after a large step. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations up to 1 GB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # and the heap is not returned to the system (mallopt takes an int)


@functools.cache
def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether glibc took both."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
