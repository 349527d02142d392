"""A read-only or missing home runs the engine with the compilation cache off, with one notice."""

import logging

import jax

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.runtime.compile_cache import enable_compilation_cache


def unwritable_home(tmp_path, monkeypatch):
    """HOME under a regular file: nothing can be created there, even by root."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HOME", str(blocker))
    return blocker


def test_an_unwritable_cache_directory_turns_the_cache_off_with_one_notice(tmp_path, monkeypatch, caplog):
    home = unwritable_home(tmp_path, monkeypatch)
    before = jax.config.jax_compilation_cache_dir
    with caplog.at_level(logging.WARNING, logger="cbjax"):
        assert enable_compilation_cache("~/.cache/cbjax/jax") is None
        assert enable_compilation_cache("~/.cache/cbjax/jax") is None  # asked again: no second notice
    notices = [r.getMessage() for r in caplog.records if "compilation caches off" in r.getMessage()]
    assert len(notices) == 1 and str(home / ".cache" / "cbjax" / "jax") in notices[0]
    assert "executor.compilation_cache_dir" in notices[0]
    assert jax.config.jax_compilation_cache_dir == before  # jax's setting untouched


def test_the_engine_starts_under_an_unwritable_home(tmp_path, monkeypatch):
    from cbjax.runtime.executor import JaxExecutor

    unwritable_home(tmp_path, monkeypatch)
    executor = JaxExecutor(
        ModelConfig(), CacheConfig(num_pages=64, page_size=16), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        ExecutorConfig(name="jax", token_buckets=[4, 16], attention="ragged", matmul="xla"),  # default cache dir: ~/...
    )  # fmt: skip
    assert executor.cache_dir is None and executor.metrics()["compilation_cache_dir"] is None
