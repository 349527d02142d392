"""Multi-host JAX: `jax.distributed` start-up, and process 0's plans broadcast to the others.

Every process builds the same executor (same config, same weights, a mesh over all of them)
and runs the same sharded step on the same batch; only process 0 runs the scheduler and
writes outputs. `PlanLink` carries each step's packed `HostBatch` from process 0 with
`broadcast_one_to_all`: first a header i32[4] (token bucket, rows used, tokens used,
sampling flag; bucket 0 means stop), then every array of the batch as one i32 buffer,
whose length the bucket fixes. Each payload length compiles one broadcast program, so
warmup exchanges an empty batch per bucket and nothing compiles afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import zlib
from typing import Callable, Optional

import numpy as np

from cbjax.config import DistributedConfig
from cbjax.core.stop import signals_to

log = logging.getLogger("cbjax")

_initialized: Optional[tuple] = None
JOIN_TIMEOUT_S = 300  # how long jax.distributed waits for every process before it aborts this one


def initialize(cfg: DistributedConfig) -> None:
    """`jax.distributed.initialize` once per process (CPU collectives over gloo); no-op when off."""
    global _initialized
    if not cfg.enabled:
        return
    key = (cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    if _initialized is not None:
        if _initialized != key:
            raise ValueError(f"distributed: this process already joined {_initialized}, not {key}")
        return
    import jax

    # CPU devices need a collectives backend across processes; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # said before the wait, which is silent until every process has joined or the time is up
    log.info(
        f"distributed: process {cfg.process_id} joining distributed.num_processes={cfg.num_processes} at "
        f"distributed.coordinator_address={cfg.coordinator_address} (up to {JOIN_TIMEOUT_S} s)"
    )
    # SIGINT and SIGTERM end the process while it waits to join: the wait is one C++ call that
    # Python handlers (the run's stop flag) never interrupt, and nothing has run that needs saving
    with signals_to(signal.SIG_DFL):
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id,
            initialization_timeout=JOIN_TIMEOUT_S,
        )  # fmt: skip
    _initialized = key
    log.info(
        f"distributed: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} local of {jax.device_count()} devices"
    )


# What every process must agree on: all that builds the executor and its sharded step (a
# different seed gives each process different weights, a different model different programs).
# The workload, outputs and tracking are process 0's alone; a compilation cache is local.
SHARED = ("seed", "model", "cache", "scheduler", "executor", "spec", "distributed.coordinator_address", "distributed.num_processes")
LOCAL = ("executor.compilation_cache_dir",)


def shared_fields(cfg) -> dict[str, str]:
    """`cfg`'s SHARED settings as dotted key -> JSON text, in a fixed order."""
    out: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(f"{prefix}.{f.name}", getattr(value, f.name))
        elif prefix not in LOCAL:
            out[prefix] = json.dumps(value, sort_keys=True, default=str)

    for name in SHARED:
        value = cfg
        for part in name.split("."):
            value = getattr(value, part)
        walk(name, value)
    return out


def config_mismatch(fields: dict[str, str], digests: np.ndarray, process_id: int) -> Optional[str]:
    """The error for the first setting whose digest differs between processes (`digests`:
    one row per process, one column per key of `fields`), or None when all agree."""
    for col, key in enumerate(fields):
        others = [p for p in range(digests.shape[0]) if digests[p, col] != digests[process_id, col]]
        if others:
            return (
                f"distributed: {key}={fields[key]} on process {process_id} differs on process(es) "
                f"{', '.join(map(str, others))}; give every process the same overrides"
            )
    return None


def check_same_config(cfg, gather: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
    """A one-line ValueError on every process when the processes' SHARED settings differ;
    each process sends a CRC32 per setting to all others (one small all-gather)."""
    fields = shared_fields(cfg)
    mine = np.array([zlib.crc32(v.encode()) for v in fields.values()], np.uint32).view(np.int32)
    if gather is None:
        from jax.experimental.multihost_utils import process_allgather

        gather = lambda x: np.asarray(process_allgather(x))  # noqa: E731
    error = config_mismatch(fields, np.asarray(gather(mine)).reshape(-1, len(fields)), cfg.distributed.process_id)
    if error:
        raise ValueError(error)


def _arrays(batch) -> list[np.ndarray]:
    """The batch's arrays in a fixed order (HostBatch fields, sampling, then tiles)."""
    out = [batch.tokens, batch.positions, batch.write_idx, batch.page_table, batch.query_start, batch.kv_lens]
    out += [batch.token_row, batch.token_pos, batch.logits_idx, batch.feed, *batch.sampling]
    for tiles in batch.tiles or ():
        out += list(tiles)
    return [np.asarray(a) for a in out]


def _rebuild(template, arrays: list[np.ndarray], num_rows_used: int, num_tokens_used: int):
    """A HostBatch shaped like `template` holding `arrays` (in `_arrays` order)."""
    it = iter(arrays)
    fields = {
        name: next(it)
        for name in ("tokens", "positions", "write_idx", "page_table", "query_start", "kv_lens", "token_row", "token_pos", "logits_idx", "feed")
    }
    sampling = tuple(next(it) for _ in template.sampling)
    tiles = None if template.tiles is None else tuple(tuple(next(it) for _ in t) for t in template.tiles)
    return dataclasses.replace(
        template, **fields, sampling=sampling, tiles=tiles, num_rows_used=num_rows_used, num_tokens_used=num_tokens_used
    )


class PlanLink:
    """Process 0 sends each step's HostBatch; every other process receives the same one."""

    def __init__(self, packer, is_source: bool):
        self.packer = packer
        self.is_source = is_source

    def _broadcast(self, x: np.ndarray) -> np.ndarray:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        return np.asarray(broadcast_one_to_all(x, is_source=self.is_source))

    def _exchange(self, batch=None, sampling: bool = False):
        """Process 0 passes its batch (None: stop), the others nothing; every process returns
        process 0's batch (None once it stops) and sampling flag."""
        header = np.zeros(4, np.int32)
        if self.is_source and batch is not None:
            header[:] = [batch.tokens.shape[0], batch.num_rows_used, batch.num_tokens_used, int(sampling)]
        bucket, rows, tokens, flag = (int(v) for v in self._broadcast(header))
        if bucket == 0:
            return None, False
        template = batch if self.is_source else self.packer.empty(bucket)
        arrays = _arrays(template)
        for a in arrays:
            if a.dtype.itemsize != 4:
                raise ValueError(f"PlanLink: batch arrays must be 4-byte, got {a.dtype}")
        flat = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in arrays])
        flat = self._broadcast(flat)
        out, lo = [], 0
        for a in arrays:
            out.append(flat[lo : lo + a.size].view(a.dtype).reshape(a.shape))
            lo += a.size
        return _rebuild(template, out, rows, tokens), bool(flag)

    def send(self, batch) -> None:
        self._exchange(batch)

    def recv(self):
        """Process 0's next batch, or None once it stops."""
        return self._exchange()[0]

    def stop(self) -> None:
        self._exchange(None)

    def warmup(self, sampling: bool) -> bool:
        """Exchange an empty batch per bucket (compiling each broadcast); returns process 0's
        sampling flag, which decides whether every process compiles the sampler."""
        flag = sampling
        for bucket in self.packer.shapes.token_buckets:
            empty = self.packer.empty(bucket) if self.is_source else None
            _, flag = self._exchange(empty, sampling)
        return flag
