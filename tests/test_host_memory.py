"""The CPU executor keeps freed host memory for reuse (cbjax.runtime.host_memory): a large
buffer freed and allocated again is not faulted in anew. Each case runs in a fresh process,
since the glibc options are process-wide."""

import subprocess
import sys

import pytest

# Allocates 48 MB with malloc, touches it, frees it, then does it again and prints the minor page
# faults of the second round (48 MB is above the 32 MB glibc's own mmap threshold reaches, so
# without the options every round maps and faults in fresh memory: about 12,000 faults).
PROBE = """
import ctypes, resource, sys
if sys.argv[1] == "retain":
    from cbjax.runtime.host_memory import retain_freed_memory
    assert retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
n = 48 << 20
def round_trip():
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    libc.free(p)
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages 'always': the probe's fresh mappings fault per 2 MB")
def test_retained_memory_is_not_faulted_in_again():
    assert faults("system") > 6000  # the probe measures what it should: fresh pages every round
    assert faults("retain") < 600  # 48 MB is 12,288 pages: at most a few stray ones


def test_the_cpu_executor_retains_freed_memory():
    from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
    from cbjax.runtime.executor import JaxExecutor

    ex = JaxExecutor(ModelConfig(), CacheConfig(num_pages=16, page_size=4), SchedulerConfig(max_num_seqs=2),
                     ExecutorConfig(name="jax"))  # fmt: skip
    assert ex.host_memory_retained is sys.platform.startswith("linux")
