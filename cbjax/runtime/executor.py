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
from cbjax.kernels.registry import GROUPED, resolve_attention, resolve_matmul
from cbjax.model.llama import Llama
from cbjax.core.plan import Schedule, StepOutput
from cbjax.core.request import Request
from cbjax.runtime.batch import BatchPacker, HostBatch
from cbjax.runtime import programs
from cbjax.runtime.compile_cache import enable_compilation_cache
from cbjax.runtime.compiles import cache_hit_count, compile_count, fresh_compile_count
from cbjax.runtime.host_memory import retain_freed_memory
from cbjax.runtime.host_tier import HostPages
from cbjax.runtime.kv_cache import init_cache
from cbjax.runtime.memory_check import check_kv_cache_fits
from cbjax.layout.shapes import plan_shapes
from cbjax.runtime.speculate import Speculator, import_draft_kv
from cbjax.runtime.step import DeviceBatch, model_step, sample_step, split_model, to_device  # noqa: F401  to_device: public here too
from cbjax.runtime.swap import HostSwap


# Steps compiled ahead of time by `warmup`, shared by every executor in the process (experiment
# arms, tests), keyed as jit keys its cache: static arguments plus input shapes and dtypes.
_COMPILED: dict[tuple, object] = {}


@dataclass
class Launched:
    """A step dispatched by `JaxExecutor.launch`, its tokens still on the device."""

    rows: int  # rows used
    tokens: jax.Array  # i32[R]; speculating: the packed verification i32[R, k + 2]
    start: float  # perf_counter at launch
    dispatch_s: float  # host seconds in the step call (dispatch)
    drafted: bool = False  # a row verified drafts


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
        spec=None,
        draft_model: Optional[ModelConfig] = None,
        draft_llama: Optional[Llama] = None,
    ):
        """`devices`: the devices this executor owns (a cluster replica's, `cbjax.cluster`), as
        many as `executor.mesh.tensor`; None: the first ones of `jax.devices()`. `progress`: a
        bar on stderr while warmup compiles. `spec`: the `spec` group (speculative decoding,
        `cbjax.runtime.speculate`), with `draft_model` the config `spec.draft_model` names and
        `draft_llama` its weights (default: random)."""
        self.model_cfg = model
        if devices is not None and len(devices) != cfg.mesh.tensor:
            raise ValueError(
                f"executor.mesh.tensor={cfg.mesh.tensor}: the executor was given {len(devices)} devices"
            )
        self.devices = None if devices is None else list(devices)
        self.cache_dir = enable_compilation_cache(cfg.compilation_cache_dir)
        # XLA:CPU's step buffers are host memory: reuse them instead of faulting them in per call
        self.host_memory_retained = jax.default_backend() == "cpu" and retain_freed_memory()
        self.attention = resolve_attention(cfg.attention, page_size=cache.page_size, head_dim=model.head_dim)
        sharded = cfg.mesh.tensor > 1 or jax.process_count() > 1
        self.matmul = resolve_matmul(cfg.matmul, model.dtype, sharded)
        self.matmul_setting = cfg.matmul
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
        self.spec: Optional[Speculator] = None
        if spec is not None and spec.method != "none":
            self.spec = Speculator(self, spec, draft_model, draft_llama, seed)
            self.packer.num_spec, self.packer.drafts_on_device = self.spec.k, self.spec.on_device
            self.packer.one_token_drafts = self.spec.num_layers is not None
            self.pipelined = False  # the next plan needs this step's accepted drafts
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
        sampled = bool(batch.sampling[0].any())  # a row with temperature > 0
        if self.spec is not None:  # a drafter's proposals first, when the step needs them
            drafting = self.spec.num_drafting_steps
            device_batch, probs = self.spec.draft(self, batch, device_batch, self.sampling or sampled)
            self.num_step_calls += self.spec.num_drafting_steps - drafting
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
        if sampled:
            self.num_sampler_calls += 1
            if self.spec is not None:
                return self.spec.sample(logits, device_batch, probs)
            return sample_step(logits, device_batch.sampling)
        return greedy

    def _load_or_compile(self, args):
        """The step for `args`, from cbjax's program cache or compiled (`programs.load_or_compile`)."""
        if self.tp is not None:
            lower = lambda: self.tp.step(self.graphdef, self.attention).lower(*args)  # noqa: E731
        else:
            lower = lambda: model_step.lower(*args, graphdef=self.graphdef, attention=self.attention, matmul=self.matmul)  # noqa: E731
        compiled, loaded = programs.load_or_compile(self.cache_dir, self.graphdef, self.attention, self.matmul, args, lower)
        if loaded:
            with self._count_lock:
                self.programs_loaded += 1
        return compiled

    def export_kv(self, pages: Sequence[int]) -> tuple[np.ndarray, ...]:
        """Host copies of `pages`' K and V (a prefilled request leaving this replica, P/D), then
        the draft model's K and V where it has its own pool."""
        return self._swap.gather(self.cache, pages) + (self.spec.export_kv(pages) if self.spec is not None else ())

    def import_kv(self, request_id: str, kv: tuple[np.ndarray, ...]) -> None:
        """A request's K and V from another replica (`export_kv`), whatever its mesh: they
        enter this cache when the scheduler swaps the request in."""
        import_draft_kv(self.spec, request_id, kv)
        self._swap.put(request_id, *kv[:2])

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
        spec_programs = self.spec.warmup(self, self.sampling) if self.spec is not None else 0
        if self.sampling and self.spec is None:  # random keys and the top-k/top-p sort take seconds to compile on CPU
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
            spec_programs += self.spec.warmup_swap() if self.spec is not None else 0
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.compiled_programs = len(buckets) + int(self.sampling and self.spec is None) + spec_programs
        self.compiled_programs += len(self._swap.widths) * 2 if self.swap_at_warmup else 0
        self._compiles_at_warmup = compile_count()
        self.warmup_compiles = fresh_compile_count() - compiles_before
        self.warmup_cache_hits = cache_hit_count() - hits_before + self.programs_loaded
        self.num_step_calls = self.num_sampler_calls = 0
        if self.spec is not None:
            self.spec.num_drafting_steps = 0
        self.warmup_s = time.perf_counter() - t0

    def execute(self, plan: Schedule) -> StepOutput:
        """One step, run to completion: its tokens on the host."""
        return self.collect(self.launch(plan))

    def launch(self, plan: Schedule) -> Launched:
        """Swap, pack and dispatch the step; its tokens stay on the device until `collect`."""
        t0 = time.perf_counter()
        if self._host_tier is not None or plan.swap_out or plan.swap_in or plan.swap_drop:  # copies before the step
            if self._host_tier is not None:  # its copies and the swaps, in the order `HostCopies` gives
                self.cache = self._host_tier.run(self.cache, plan)
            else:  # swap-outs first: they may free swap-in pages
                self.cache = self._swap.run(self.cache, plan)
            if self.spec is not None:  # the draft model's own pool moves with the target's
                self.spec.swap_pages(plan)
            self.swap_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        batch = self.packer.pack(plan)
        if self.link is not None:  # multi-host: every process runs this step
            self.link.send(batch)
        t2 = time.perf_counter()
        out = self._step(batch)
        if self.tp is None and self.spec is None:  # the next step may read these tokens before the host does
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
        drafted = batch.spec is not None and bool(batch.spec.num_drafts.any())
        return Launched(batch.num_rows_used, out, t0, time.perf_counter() - t2, drafted)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step's tokens: the one device->host copy of the iteration."""
        t0 = time.perf_counter()
        out = launched.tokens
        out = np.asarray(out) if self.tp is None else self.tp.fetch(out)
        t1 = time.perf_counter()
        self.device_s += launched.dispatch_s + t1 - t0
        if self.spec is not None:
            return self.spec.output(out, launched.rows, launched.drafted)
        token_ids = out[: launched.rows].tolist()
        errors = {i: "non-finite logits" for i, t in enumerate(token_ids) if t < 0} or None
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
            "spec_method": "none" if self.spec is None else self.spec.method,
            "spec_drafting_steps": 0 if self.spec is None else self.spec.num_drafting_steps,
        }


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="program", desc="compiling", leave=False)
