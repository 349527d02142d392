"""A disk cache of compiled step programs: a rerun loads each bucket's program without tracing it.

JAX's persistent compilation cache skips XLA's compile, but finding a program there still
traces and lowers the step (its key is the lowered module), which is most of a warm start
for a small model. This cache keys the compiled executable by everything that decides it
without tracing: cbjax's own source (less its host-only modules, HOST_ONLY), the jax/jaxlib
versions, the backend and its devices, XLA_FLAGS, the model's graph definition, the attention
backend and the arguments' shapes, dtypes and shardings. Any change to one of them is a miss, and a miss compiles as before.
Files are written atomically; an unreadable one is a miss too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from importlib import metadata
from pathlib import Path
from typing import Optional

import jax
from jax.experimental import serialize_executable

from cbjax.runtime.compiles import thread_cache_hits

SUBDIR = "cbjax-programs"


# cbjax code that never runs inside the jitted step: the host-side scheduler, simulator,
# profiler, workloads, page allocator, predictor, the core contract, the loop, the clusters,
# the server, the bench client and the run/report plumbing. Editing it (a
# scheduling policy, say) keeps the stored programs. Everything else counts, new files too.
HOST_ONLY = frozenset({
    "scheduler", "sim", "profile", "workload", "cache", "predictor", "core", "engine", "app", "report", "cluster",
    "serve", "bench",
})  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=4)
def source_digest(root: Path = ROOT) -> str:
    """sha256 over the .py, .cc and .h files under the package `root` (path and contents) that the
    step may trace or call: all but HOST_ONLY's."""
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc"), *root.rglob("*.h")]):  # .cc, .h: the native kernels
        rel = path.relative_to(root)
        if rel.parts[0] in HOST_ONLY:
            continue
        h.update(str(rel).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def program_key(graphdef, attention: str, args, matmul: str = "xla") -> str:
    """The cache key of `model_step` compiled for `args` (weights, cache, batch)."""
    leaves, treedef = jax.tree.flatten(args)
    devices = jax.devices()
    parts = [
        source_digest(), jax.__version__, _version("jaxlib"),
        devices[0].platform, str(sorted({d.device_kind for d in devices})), str(len(devices)),
        os.environ.get("XLA_FLAGS", ""), repr(graphdef), attention, matmul, str(treedef),
        str([(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]),
    ]  # fmt: skip
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def load(directory: Optional[str], key: str, device) -> Optional[jax.stages.Compiled]:
    """The program stored under `key`, loaded onto `device`; None when absent or unreadable."""
    if not directory:
        return None
    path = Path(directory) / SUBDIR / f"{key}.bin"
    try:
        blob, in_tree, out_tree = pickle.loads(path.read_bytes())
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=[device])
    except Exception:  # absent, truncated or foreign: compile instead
        return None


def store(directory: Optional[str], key: str, compiled: jax.stages.Compiled) -> bool:
    """Write `compiled` under `key` (atomically); False when it can't be serialized or written."""
    if not directory:
        return False
    folder = Path(directory) / SUBDIR
    try:
        data = pickle.dumps(serialize_executable.serialize(compiled))
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{key}.bin")
        return True
    except (OSError, ValueError, NotImplementedError, pickle.PicklingError, TypeError):
        return False


def load_or_compile(cache_dir: Optional[str], graphdef, attention: str, matmul: str, args, lower):
    """(program, loaded): the step for `args` (weights, cache, batch) from this cache when its
    weights live on one device (no tracing), else `lower()` compiled and stored here."""
    devices = {d for x in jax.tree.leaves(args[0]) for d in x.devices()}
    directory = cache_dir if len(devices) == 1 else None  # the cache is for single-device weights only
    key = program_key(graphdef, attention, args, matmul) if directory else ""
    compiled = load(directory, key, next(iter(devices)))
    if compiled is not None:
        return compiled, True
    hits = thread_cache_hits()
    compiled = lower().compile()
    # A program jax loaded from its own persistent cache serializes without its kernels on
    # XLA:CPU (a later process fails to find them), so only fresh compiles are stored.
    if thread_cache_hits() == hits:
        store(directory, key, compiled)
    return compiled, False


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""
