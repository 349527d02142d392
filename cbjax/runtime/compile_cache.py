"""JAX's persistent compilation cache: on where its directory can be written, off with one notice where not."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import jax

log = logging.getLogger("cbjax")
_REFUSED: set[str] = set()  # directories already reported unwritable: one notice each per process


def enable_compilation_cache(path: Optional[str]) -> Optional[str]:
    """Point JAX's persistent compilation cache at `path` (None: leave it off); returns the
    directory used, or None when it is off. Every program is cached, however fast it compiled.

    A directory that cannot be created or written (a read-only or missing home) turns the cache
    off for this run with one logged notice, instead of failing at the first compile."""
    if not path:
        return None
    directory = str(Path(os.path.expanduser(path)).resolve())
    if jax.config.jax_compilation_cache_dir == directory:
        return directory
    problem = _unwritable(directory)
    if problem is not None:
        if directory not in _REFUSED:
            _REFUSED.add(directory)
            log.warning(
                f"cbjax: compilation caches off: cannot write {directory} ({problem}); "
                "set executor.compilation_cache_dir to a writable directory (or null)"
            )
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:  # the cache object is built at the first compile; rebuild it for the new directory
        from jax._src import compilation_cache
    except ImportError:
        return directory
    # quietly: under the CLI's INFO logging jax would print "Resetting cache at <empty>."
    jax_log = logging.getLogger(compilation_cache.__name__)
    level = jax_log.level
    jax_log.setLevel(logging.WARNING)
    try:
        compilation_cache.reset_cache()
    except AttributeError:
        pass
    finally:
        jax_log.setLevel(level)
    return directory


def _unwritable(directory: str) -> Optional[str]:
    """None when `directory` exists (or was just made) and takes a file; else why not."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
