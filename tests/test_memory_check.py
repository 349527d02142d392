"""A KV pool larger than the memory available fails before allocating, in one line with both sizes."""

import os

import numpy as np
import pytest

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.runtime import memory_check
from cbjax.runtime.memory_check import check_kv_cache_fits, host_available_bytes, kv_cache_bytes


def test_pool_bytes_count_k_and_v_of_every_layer():
    # 2 (K, V) x 3 layers x 2 kv heads x 10 pages x 4 tokens x 8 dims x 2 bytes
    assert kv_cache_bytes(3, 2, 8, 10, 4, "bfloat16") == 7680
    assert kv_cache_bytes(3, 2, 8, 10, 4, np.float32) == 15360


def test_host_memory_available_is_within_physical_memory():
    available = host_available_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_the_check_passes_a_pool_that_fits_exactly_and_refuses_one_byte_more(monkeypatch):
    need = 2 * 1 * 1 * 100 * 4 * 8 * 4  # 25,600 bytes
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: need)
    check_kv_cache_fits(1, 1, 8, 100, 4, "float32")
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: need - 1)
    with pytest.raises(ValueError) as err:
        check_kv_cache_fits(1, 1, 8, 100, 4, "float32")
    line = str(err.value)
    assert "\n" not in line and line.startswith("cache.num_pages=100: the KV pool needs 25.0 KiB but 25.0 KiB")
    assert "at most 99 pages fit" in line  # 25,599 bytes / 256 bytes a page


def test_the_engine_refuses_a_huge_pool_before_allocating_it(monkeypatch):
    from cbjax.runtime import executor as executor_module

    def no_allocation(*args):
        raise AssertionError("the cache was allocated before the check")

    monkeypatch.setattr(executor_module, "init_cache", no_allocation)
    model = ModelConfig()
    num_pages = 100_000_000
    need = 2 * model.num_layers * model.num_kv_heads * num_pages * 16 * model.head_dim * 4  # float32
    with pytest.raises(ValueError, match=r"^cache\.num_pages=100000000: the KV pool needs ") as err:
        executor_module.JaxExecutor(
            model, CacheConfig(num_pages=num_pages, page_size=16), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            ExecutorConfig(name="jax", token_buckets=[4, 16], compilation_cache_dir=None),
        )  # fmt: skip
    assert f"needs {need / 2**30:.1f} GiB but " in str(err.value) and "of host memory is available" in str(err.value)


class FakeAccelerator:
    """What check_kv_cache_fits reads of a GPU: its platform and its allocator's stats."""

    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_free_memory_comes_from_the_allocator_stats():
    from cbjax.runtime.memory_check import device_available_bytes

    assert device_available_bytes(FakeAccelerator({"bytes_limit": 1000, "bytes_in_use": 300})) == 700
    assert device_available_bytes(FakeAccelerator(None)) is None
    assert device_available_bytes(FakeAccelerator(RuntimeError("no stats"))) is None


def test_on_an_accelerator_each_shard_is_checked_against_one_device(monkeypatch):
    need = 2 * 1 * 4 * 100 * 4 * 8 * 4  # 102,400 bytes over 4 kv heads
    device = FakeAccelerator({"bytes_limit": need // 4, "bytes_in_use": 0})
    monkeypatch.setattr(memory_check.jax, "local_devices", lambda: [device])
    check_kv_cache_fits(1, 4, 8, 100, 4, "float32", num_shards=4)  # a quarter per device: fits exactly
    with pytest.raises(ValueError, match=r"^cache\.num_pages=100: the KV pool needs 50\.0 KiB but 25\.0 KiB of gpu memory"):
        check_kv_cache_fits(1, 4, 8, 100, 4, "float32", num_shards=2)
