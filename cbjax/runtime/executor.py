"""JaxExecutor: wires plan -> batch -> step. Swaps, pack the plan, one jitted step, read back.

Every scheduled token of an iteration goes through one call of `cbjax.runtime.step.model_step`
(decodes, fresh prefills, chunks, context prefills, recomputes, swapped-in continuations).
Its only varying shape is the token bucket, so `warmup` compiles one program per bucket
(plus the swap copies) and nothing compiles afterwards.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.kernels.metadata import AttentionMetadata
from cbjax.kernels.registry import GROUPED, resolve_attention, resolve_matmul
from cbjax.kernels.xla_ragged import RaggedWork, Tiles
from cbjax.model.llama import Llama
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request
from cbjax.runtime.batch import BatchPacker, HostBatch
from cbjax.runtime import programs
from cbjax.runtime.compile_cache import enable_compilation_cache
from cbjax.runtime.compiles import cache_hit_count, compile_count, fresh_compile_count, thread_cache_hits
from cbjax.runtime.host_memory import retain_freed_memory
from cbjax.runtime.host_tier import HostPages
from cbjax.runtime.kv_cache import init_cache
from cbjax.runtime.memory_check import check_kv_cache_fits
from cbjax.layout.shapes import plan_shapes
from cbjax.runtime.step import DeviceBatch, model_step, sample_step, split_model
from cbjax.runtime.swap import HostSwap


# Steps compiled ahead of time by `warmup`, shared by every executor in the process (experiment
# arms, tests), keyed as jit keys its cache: static arguments plus input shapes and dtypes.
_COMPILED: dict[tuple, object] = {}


def to_device(batch: HostBatch, prev_tokens=None) -> DeviceBatch:
    """The step's argument for `batch`; `prev_tokens` (i32[R], default zeros) is the previous
    step's output, which the batch's `feed` slots read."""
    if prev_tokens is None:
        prev_tokens = np.zeros(batch.logits_idx.shape, np.int32)
    work = None
    if batch.tiles is not None:
        single, block = batch.tiles
        work = RaggedWork(single=Tiles(*single), block=Tiles(*block))
    md = AttentionMetadata(
        page_table=batch.page_table, query_start=batch.query_start, kv_lens=batch.kv_lens,
        token_row=batch.token_row, token_pos=batch.token_pos, work=work,
    )  # fmt: skip
    return DeviceBatch(
        tokens=batch.tokens, positions=batch.positions, write_idx=batch.write_idx, md=md,
        logits_idx=batch.logits_idx, sampling=batch.sampling, feed=batch.feed, prev_tokens=prev_tokens,
    )  # fmt: skip


@dataclass
class Launched:
    """A step dispatched by `JaxExecutor.launch`, its tokens still on the device."""

    rows: int  # rows used
    tokens: jax.Array  # i32[R]
    start: float  # perf_counter at launch
    dispatch_s: float  # host seconds in the step call (dispatch)


class JaxExecutor:
    """The real-engine side of the executor interface.

    `execute(plan)` runs one step and returns its tokens. Pipelined serving
    (`executor.async_scheduling`, `cbjax.engine.offline.serve`) splits it: `launch(plan)` packs and
    dispatches the step and returns at once, `collect(launched)` waits for its tokens. A step
    launched before the previous one is collected takes that step's tokens on the device
    (`DeviceBatch.feed`), so the host schedules and packs step t+1 while step t runs."""

    virtual_clock = False
    reads_token_ids = True

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        cfg: ExecutorConfig,
        seed: int = 0,
        llama: Optional[Llama] = None,
        devices: Optional[Sequence[jax.Device]] = None,
        progress: bool = True,
    ):
        """`devices`: the devices this executor owns (a cluster replica's, `cbjax.cluster`), as
        many as `executor.mesh.tensor`; None: the first ones of `jax.devices()`. `progress`: a
        bar on stderr while warmup compiles."""
        self.model_cfg = model
        if devices is not None and len(devices) != cfg.mesh.tensor:
            raise ValueError(
                f"executor.mesh.tensor={cfg.mesh.tensor}: the executor was given {len(devices)} devices"
            )
        self.devices = None if devices is None else list(devices)
        self.cache_dir = enable_compilation_cache(cfg.compilation_cache_dir)
        # XLA:CPU's step buffers are host memory: reuse them instead of faulting them in per call
        self.host_memory_retained = jax.default_backend() == "cpu" and retain_freed_memory()
        self.attention = resolve_attention(cfg.attention)
        sharded = cfg.mesh.tensor > 1 or jax.process_count() > 1
        self.matmul = resolve_matmul(cfg.matmul, model.dtype, sharded)
        self.shapes = plan_shapes(
            scheduler.max_num_seqs, model.max_model_len, cache.page_size, scheduler.max_num_batched_tokens,
            cfg.token_buckets,
        )  # fmt: skip
        self.packer = BatchPacker(self.shapes, tiles=self.attention in GROUPED)
        # Serving layout: q/k/v and gate/up fused into one matmul each (same model, same numbers).
        llama = llama if llama is not None else Llama(model, seed=seed)
        self.graphdef, self.weights = split_model(llama.fused(), self.matmul)
        cache_args = (model.num_layers, model.num_kv_heads, model.head_dim, cache.num_pages, cache.page_size, model.dtype)
        check_kv_cache_fits(*cache_args, num_shards=cfg.mesh.tensor)  # one line naming cache.num_pages, not OOM
        # executor.mesh.tensor > 1, or several processes: sharded (cbjax.runtime.mesh); else one device.
        self.tp = self.link = None
        self.pipelined = cfg.async_scheduling
        if cfg.mesh.tensor > 1 or jax.process_count() > 1:
            from cbjax.runtime.mesh import TensorParallel

            self.tp = TensorParallel(model, cfg.mesh.tensor, self.devices)
            self.weights = self.tp.place_weights(self.weights)
            self.cache = self.tp.init_cache(*cache_args)
            if jax.process_count() > 1:
                from cbjax.runtime.distributed import PlanLink

                self.link = PlanLink(self.packer, is_source=jax.process_index() == 0)
        elif self.devices is not None:  # one device of several in the process: everything lives there
            self.weights = jax.device_put(self.weights, self.devices[0])
            with jax.default_device(self.devices[0]):
                self.cache = init_cache(*cache_args)
        else:
            self.cache = init_cache(*cache_args)
        if self.tp is not None:  # the previous step's tokens are a replicated global array there
            self.pipelined = False
        self._prev_tokens = np.zeros(self.shapes.num_rows, np.int32)  # the last launched step's output
        widths, w = [], 1
        while w < self.shapes.max_pages:
            widths.append(w)
            w *= 2
        self._swap = HostSwap(widths + [self.shapes.max_pages])
        self._host_tier = HostPages(self._swap) if cache.host_pages else None  # cache.host_pages' copies
        # swap copies compiled at warmup: swap preemption, the host tier, or K/V moving between P/D replicas
        self.swap_at_warmup = scheduler.preemption == "swap" or cache.host_pages > 0
        self.progress = progress
        # False when no request will sample (all greedy): warmup skips compiling the sampler.
        self.sampling = True
        self.swap_s = 0.0
        self.host_pack_s = 0.0
        self.device_s = 0.0
        self.num_steps = 0
        self.num_step_calls = 0
        self.num_sampler_calls = 0
        self.warmup_s = 0.0
        self.compiled_programs = 0
        self.warmup_compiles = 0  # programs warmup compiled: 0 when every one came from the cache
        self.warmup_cache_hits = 0  # programs warmup loaded from the persistent compilation cache
        self.programs_loaded = 0  # of which from cbjax's program cache, untraced (cbjax.runtime.programs)
        self._count_lock = threading.Lock()
        self._compiles_at_warmup: Optional[int] = None
        self.bucket_calls: dict[int, int] = {}
        self.mixed_iterations = 0  # decodes and prefills in the same step
        self.context_iterations = 0  # a prefill continuing cached tokens in the step
        self._compiled: dict[int, object] = {}  # token bucket -> the step compiled for it

    # ---- interface ----
    def validate(self, req: Request) -> Optional[str]:
        """Nothing engine-specific: the scheduler checks vocabulary and length for both executors."""
        return None

    def _device_batch(self, batch: HostBatch) -> DeviceBatch:
        if self.tp is not None:
            return self.tp.to_global(to_device(batch))
        return to_device(batch, self._prev_tokens)

    def _step(self, batch: HostBatch):
        """One model step, then the sampler if any row samples; the tokens, still on the device."""
        compiled = self._compiled.get(batch.tokens.shape[0])
        device_batch = self._device_batch(batch)
        if compiled is not None:
            greedy, logits, self.cache = compiled(self.weights, self.cache, device_batch)
        elif self.tp is not None:  # before warmup: compile on first use
            greedy, logits, self.cache = self.tp.step(self.graphdef, self.attention)(self.weights, self.cache, device_batch)
        else:
            greedy, logits, self.cache = model_step(
                self.weights, self.cache, device_batch, graphdef=self.graphdef, attention=self.attention,
                matmul=self.matmul,
            )  # fmt: skip
        self.num_step_calls += 1
        if batch.sampling[0].any():  # a row with temperature > 0
            self.num_sampler_calls += 1
            return sample_step(logits, device_batch.sampling)
        return greedy

    def _load_or_compile(self, args):
        """The step for `args` from cbjax's program cache (no tracing), else lowered and compiled
        (and stored there). The program cache is for single-device weights only."""
        devices = {d for x in jax.tree.leaves(self.weights) for d in x.devices()}
        directory = self.cache_dir if len(devices) == 1 else None
        key = programs.program_key(self.graphdef, self.attention, args, self.matmul) if directory else ""
        compiled = programs.load(directory, key, next(iter(devices)))
        if compiled is not None:
            with self._count_lock:
                self.programs_loaded += 1
            return compiled
        if self.tp is not None:
            lowered = self.tp.step(self.graphdef, self.attention).lower(*args)
        else:
            lowered = model_step.lower(*args, graphdef=self.graphdef, attention=self.attention, matmul=self.matmul)
        hits = thread_cache_hits()
        compiled = lowered.compile()
        # A program jax loaded from its own persistent cache serializes without its kernels on
        # XLA:CPU (a later process fails to find them), so only fresh compiles are stored.
        if thread_cache_hits() == hits:
            programs.store(directory, key, compiled)
        return compiled

    def export_kv(self, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of `pages`' K and V (a prefilled request leaving this replica, P/D)."""
        return self._swap.gather(self.cache, pages)

    def import_kv(self, request_id: str, kv: tuple[np.ndarray, np.ndarray]) -> None:
        """A request's K and V from another replica (`export_kv`), whatever its mesh: they
        enter this cache when the scheduler swaps the request in."""
        self._swap.put(request_id, *kv)

    def host_load_times(self) -> tuple[float, float]:
        """(load_s, prefetch_s): the latest launched step's host-tier loads, measured."""
        return self._host_tier.times() if self._host_tier is not None else (0.0, 0.0)

    def restart_compile_count(self) -> None:
        """Count compiles after warmup from now (a cluster, once every replica is warm)."""
        self._compiles_at_warmup = compile_count()

    def follow(self) -> int:
        """A process other than 0 of a multi-host run: run every step process 0 sends
        (cbjax.runtime.distributed) until it stops; returns how many."""
        num_steps = 0
        while (batch := self.link.recv()) is not None:
            jax.block_until_ready(self._step(batch))
            num_steps += 1
        return num_steps

    def close(self) -> None:
        """After serving: tell the other processes to stop (multi-host only)."""
        if self.link is not None and self.link.is_source:
            self.link.stop()
            self.link = None

    def timeline(self) -> None:
        """The engine runs on the wall clock."""
        return None

    def warmup(self, *, sampling: bool = True, kv_transfer: bool = False) -> None:
        """Compile the step for every token bucket before the clock starts, the sampler if a
        request may sample (`sampling`), and the swap copies for swap preemption or K/V moving
        between replicas (`kv_transfer`)."""
        t0 = time.perf_counter()
        self.sampling = sampling
        self.swap_at_warmup = self.swap_at_warmup or kv_transfer
        if self.link is not None:  # every process compiles the same programs, the sampler included
            self.sampling = self.link.warmup(self.sampling)
        compiles_before, hits_before = fresh_compile_count(), cache_hit_count()  # counting starts here
        self.programs_loaded = 0
        buckets = self.shapes.token_buckets
        bar = _progress_bar(len(buckets) + 1 + (1 if self.swap_at_warmup else 0)) if self.progress else None

        def compile_bucket(bucket: int):
            batch = self._device_batch(self.packer.empty(bucket))
            args = (self.weights, self.cache, batch)
            leaves, treedef = jax.tree.flatten(args)
            where = self.tp.mesh if self.tp is not None else (self.devices[0] if self.devices else None)
            key = (self.graphdef, self.attention, self.matmul, where, treedef, tuple((np.shape(x), str(x.dtype)) for x in leaves))
            if key not in _COMPILED:  # like jit's own cache: same static arguments and shapes, same program
                _COMPILED[key] = self._load_or_compile(args)
            return bucket, _COMPILED[key]

        # XLA compiles in C++ without the GIL: one thread per core compiles buckets side by side.
        with ThreadPoolExecutor(max_workers=max(1, min(len(buckets), os.cpu_count() or 1))) as pool:
            for bucket, compiled in pool.map(compile_bucket, buckets):
                self._compiled[bucket] = compiled
                if bar is not None:
                    bar.set_postfix_str(f"{bucket} tokens")
                    bar.update(1)
        for bucket in buckets:  # run each once: first calls allocate, and the cache is donated through them
            jax.block_until_ready(self._step(self.packer.empty(bucket)))
        if self.sampling:  # random keys and the top-k/top-p sort take seconds to compile on CPU
            empty = self.packer.empty(buckets[0])
            logits = jnp.zeros((self.shapes.num_rows, self.model_cfg.vocab_size))
            if self.tp is None and self.devices is not None:
                logits = jax.device_put(logits, self.devices[0])
            if self.tp is None:
                jax.block_until_ready(sample_step(logits, empty.sampling))
            else:  # laid out as the step's outputs are
                jax.block_until_ready(sample_step(*self.tp.to_global((np.asarray(logits), empty.sampling))))
        if bar is not None:
            bar.update(1)
        if self.swap_at_warmup:
            self.cache = self._swap.warmup(self.cache)
            if self._host_tier is not None:
                self.cache = self._host_tier.warmup(self.cache)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.compiled_programs = len(buckets) + int(self.sampling) + (len(self._swap.widths) * 2 if self.swap_at_warmup else 0)
        self._compiles_at_warmup = compile_count()
        self.warmup_compiles = fresh_compile_count() - compiles_before
        self.warmup_cache_hits = cache_hit_count() - hits_before + self.programs_loaded
        self.num_step_calls = self.num_sampler_calls = 0
        self.warmup_s = time.perf_counter() - t0

    def execute(self, plan: Schedule) -> StepOutput:
        """One step, run to completion: its tokens on the host."""
        return self.collect(self.launch(plan))

    def launch(self, plan: Schedule) -> Launched:
        """Swap, pack and dispatch the step; its tokens stay on the device until `collect`."""
        t0 = time.perf_counter()
        if self._host_tier is not None:  # its copies and the swaps, in the order `HostCopies` gives
            self.cache = self._host_tier.run(self.cache, plan)
            self.swap_s += time.perf_counter() - t0
        elif plan.swap_out or plan.swap_in:  # before the step, swap-outs first: they may free swap-in pages
            self._swap.swap_out(self.cache, plan.swap_out)
            self.cache = self._swap.swap_in(self.cache, plan.swap_in)
            self.swap_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        batch = self.packer.pack(plan)
        if self.link is not None:  # multi-host: every process runs this step
            self.link.send(batch)
        t2 = time.perf_counter()
        out = self._step(batch)
        if self.tp is None:  # the next step may read these tokens before the host does
            self._prev_tokens = out
            self.packer.prev_rows = {s.request_id: i for i, s in enumerate(plan.scheduled)}
        if plan.decodes and plan.prefills:
            self.mixed_iterations += 1
        if any(r.num_computed > 0 for r in plan.prefills):  # a chunk, recompute, prefix hit or swap-in
            self.context_iterations += 1
        bucket = batch.tokens.shape[0]
        self.bucket_calls[bucket] = self.bucket_calls.get(bucket, 0) + 1
        self.num_steps += 1
        self.host_pack_s += t2 - t1
        return Launched(batch.num_rows_used, out, t0, time.perf_counter() - t2)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step's tokens: the one device->host copy of the iteration."""
        t0 = time.perf_counter()
        out = launched.tokens
        out = np.asarray(out) if self.tp is None else self.tp.fetch(out)
        t1 = time.perf_counter()
        token_ids = out[: launched.rows].tolist()
        errors = {i: "non-finite logits" for i, t in enumerate(token_ids) if t < 0} or None
        self.device_s += launched.dispatch_s + t1 - t0
        return StepOutput(token_ids=token_ids, errors=errors)

    def metrics(self) -> dict:
        after = compile_count() - self._compiles_at_warmup if self._compiles_at_warmup is not None else None
        return {
            "compiles_after_warmup": after,
            "warmup_s": self.warmup_s,
            "compiled_programs": self.compiled_programs,
            "warmup_compiles": self.warmup_compiles,
            "warmup_cache_hits": self.warmup_cache_hits,
            "warmup_programs_loaded": self.programs_loaded,
            # model-step calls per iteration (swap copies and the sampler excluded)
            "device_calls_per_iteration": self.num_step_calls / self.num_steps if self.num_steps else 0.0,
            "sampler_calls": self.num_sampler_calls,
            "attention": self.attention,
            "matmul": self.matmul,
            "token_buckets": list(self.shapes.token_buckets),
            "bucket_calls": {str(b): n for b, n in sorted(self.bucket_calls.items())},
            "mixed_iterations": self.mixed_iterations,
            "context_iterations": self.context_iterations,
            "host_pack_s": self.host_pack_s,
            "device_wait_s": self.device_s,
            "async_scheduling": self.pipelined,
            "swap_s": self.swap_s,
            "compilation_cache_dir": self.cache_dir,
            "mesh_tensor": 1 if self.tp is None else self.tp.tensor,
        }


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="program", desc="compiling", leave=False)
