"""The JAX executor's speculative side (`spec.method` ngram or draft): drafts, verification, results.

Per iteration: with n-gram drafts (ids in the plan) one device call, the target's step, which
verifies greedily inside it (`cbjax.runtime.step`); with a drafter, first its proposals
(`cbjax.runtime.draft`, one call) whenever the step needs them: a separate draft model runs every
step (its pass 0 keeps its KV pool whole), the target's first layers only when a row drafts. A
step with a sampled row adds the verification sampler (`cbjax.runtime.verify`), as the
sampler is added without speculation.

Compiled shapes: the target's step per token bucket with the verification head (drafts
i32[R, k]); a draft model's proposals per token bucket, self-speculation's once (R-shaped);
the verification sampler once ([R, k + 1, vocab]). Warmup compiles all of them (the sampling
variants only when a request may sample), and the draft pool's swap copies where swaps run.

The draft model's KV pool has the target's page count and page size and is indexed by the same
page tables, so the scheduler's pages (prefix sharing, swaps, P/D transfers) cover both pools:
swaps and K/V exports move the draft pool's pages with the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from cbjax.config import ModelConfig
from cbjax.core.plan import StepOutput
from cbjax.kernels.xla_ragged import RaggedWork, Tiles
from cbjax.model.llama import Llama
from cbjax.runtime.batch import HostBatch
from cbjax.runtime.draft import DraftInputs, propose
from cbjax.runtime.kv_cache import init_cache
from cbjax.runtime.memory_check import check_kv_cache_fits
from cbjax.runtime.step import split_model
from cbjax.runtime.swap import HostSwap
from cbjax.runtime.verify import verify_sample_step

METHODS = ("none", "ngram", "draft")


class Speculator:
    """Drafting and verification for one `JaxExecutor` (which calls it from its step)."""

    def __init__(self, executor, spec, draft_model: Optional[ModelConfig], draft_llama: Optional[Llama], seed: int):
        """`spec`: the run's `spec` group (method, num_tokens, draft_layers); `draft_model`: the
        resolved config of `spec.draft_model`, its weights `draft_llama` (default: random, seeded
        `seed + 1`)."""
        target: ModelConfig = executor.model_cfg
        if jax.process_count() > 1:  # the plan link carries no drafts
            raise ValueError(f"spec.method={spec.method} is not supported with distributed.num_processes > 1")
        self.k = int(spec.num_tokens)
        if self.k < 1:
            raise ValueError(f"spec.num_tokens must be >= 1 with spec.method={spec.method}, got {spec.num_tokens}")
        self.method = spec.method
        self.num_layers: Optional[int] = None  # self-speculation: the target's first N layers
        self.separate = False  # a draft model with its own weights and pool
        self.swap: Optional[HostSwap] = None
        self.cache = self.weights = self.graphdef = None
        if spec.method == "draft":
            layers = getattr(spec, "draft_layers", None)
            if (layers is None) == (draft_model is None):
                raise ValueError("spec.method=draft needs exactly one of spec.draft_model and spec.draft_layers")
            if layers is not None:
                if not 1 <= layers < target.num_layers:
                    raise ValueError(f"spec.draft_layers must be in [1, {target.num_layers}) (model.num_layers), got {layers}")
                self.num_layers = int(layers)
            else:
                self._init_draft_model(executor, draft_model, draft_llama, seed)
        self.num_drafting_steps = 0  # steps that ran the drafter

    @property
    def on_device(self) -> bool:
        """Whether the executor proposes the drafts (plans carry no draft ids)."""
        return self.method == "draft"

    def _init_draft_model(self, ex, cfg: ModelConfig, llama: Optional[Llama], seed: int) -> None:
        target = ex.model_cfg
        if ex._host_tier is not None:  # its copies move the target's pool only
            raise ValueError(
                f"spec.draft_model={cfg.name} with cache.host_pages > 0: the host tier does not carry a draft "
                "model's own K/V pool; use spec.draft_layers or spec.method=ngram with the host tier"
            )
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"spec.draft_model={cfg.name}: vocab_size {cfg.vocab_size} differs from the target's {target.vocab_size}"
            )
        from cbjax.kernels.registry import resolve_matmul

        self.separate = True
        self.model_cfg = cfg
        self.matmul = resolve_matmul(ex.matmul_setting, cfg.dtype, ex.tp is not None)
        llama = llama if llama is not None else Llama(cfg, seed=seed + 1)
        self.graphdef, self.weights = split_model(llama.fused(), self.matmul)
        cache = ex.cache
        args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.num_pages, cache.page_size, cfg.dtype)
        check_kv_cache_fits(*args, num_shards=1 if ex.tp is None else ex.tp.tensor)
        if ex.tp is not None:
            from cbjax.runtime.mesh import check_tensor_parallel, place, weight_shardings

            check_tensor_parallel(cfg, ex.tp.tensor, ex.tp.tensor)
            self.weights = place(self.weights, weight_shardings(self.weights, ex.tp.mesh))
            self.cache = ex.tp.init_cache(*args)
        elif ex.devices is not None:
            self.weights = jax.device_put(self.weights, ex.devices[0])
            with jax.default_device(ex.devices[0]):  # committed, as the drafter's outputs are: one program
                self.cache = jax.device_put(init_cache(*args), ex.devices[0])
        else:
            self.cache = init_cache(*args)
        self.swap = HostSwap(ex._swap.widths)

    # ---- one step ----
    def inputs(self, ex, batch: HostBatch) -> DraftInputs:
        hs = batch.spec
        work = None
        if hs.pass_tiles is not None:
            single, block = hs.pass_tiles
            work = RaggedWork(single=Tiles(*single), block=Tiles(*block))
        sampling = (*batch.sampling[:4], hs.last_pos + 1)
        inputs = DraftInputs(batch.page_table, hs.last_pos, hs.last_token, hs.num_drafts, hs.num_rows, sampling, work)
        return ex.tp.to_global(inputs) if ex.tp is not None else inputs

    def needs_drafter(self, batch: HostBatch) -> bool:
        if self.method != "draft" or batch.num_rows_used == 0:
            return False
        return self.separate or bool(batch.spec.num_drafts.any())

    def draft(self, ex, batch: HostBatch, device_batch, sample: bool):
        """Run the drafter when the step needs it: (the device batch with its drafts, their
        probabilities or None)."""
        if not self.needs_drafter(batch):
            return device_batch, None
        self.num_drafting_steps += 1
        return self._propose(ex, batch, device_batch, sample)

    def _propose(self, ex, batch: HostBatch, device_batch, sample: bool):
        inputs = self.inputs(ex, batch)
        kw = dict(attention=ex.attention, k=self.k, sample=sample, mesh=None if ex.tp is None else ex.tp.mesh)
        if self.separate:
            drafts, probs, self.cache = propose(
                self.weights, self.cache, device_batch, inputs, graphdef=self.graphdef, matmul=self.matmul, **kw
            )
        else:
            drafts, probs, ex.cache = propose(
                ex.weights, ex.cache, None, inputs, graphdef=ex.graphdef, matmul=ex.matmul, num_layers=self.num_layers,
                **kw,
            )  # fmt: skip
        spec = dataclasses.replace(device_batch.spec, drafts=drafts)
        return dataclasses.replace(device_batch, spec=spec), probs

    def sample(self, logits, device_batch, probs):
        """The verification sampler: packed i32[R, k + 2]."""
        spec = device_batch.spec
        return verify_sample_step(logits, spec.drafts, spec.num_drafts, probs, device_batch.sampling)

    def output(self, packed: np.ndarray, rows: int, drafted: bool) -> StepOutput:
        """The step's result from its packed i32[R, k + 2] verification."""
        packed = packed[:rows]
        num_accepted = packed[:, 0]
        token_ids = packed[np.arange(rows), 1 + num_accepted].tolist()
        errors = {i: "non-finite logits" for i, t in enumerate(token_ids) if t < 0} or None
        if not drafted:
            return StepOutput(token_ids=token_ids, errors=errors)
        accepted = [packed[i, 1 : 1 + n].tolist() for i, n in enumerate(num_accepted.tolist())]
        return StepOutput(token_ids=token_ids, errors=errors, num_accepted=num_accepted.tolist(), accepted_ids=accepted)

    # ---- warmup, swaps and transfers ----
    def warmup(self, ex, sampling: bool) -> int:
        """Compile the drafter for every shape it runs at (and its sampling variant when a request
        may sample) and the verification sampler; returns the number of programs."""
        import jax.numpy as jnp

        programs = 0
        if self.method == "draft":
            buckets = ex.shapes.token_buckets if self.separate else ex.shapes.token_buckets[:1]
            for bucket in buckets:  # an empty batch writes only the null page
                batch = ex.packer.empty(bucket)
                jax.block_until_ready(self._propose(ex, batch, ex._device_batch(batch), sampling))
                programs += 1
        if sampling:
            batch = ex.packer.empty(ex.shapes.token_buckets[0])
            db = ex._device_batch(batch)
            r, vocab = ex.shapes.num_rows, ex.model_cfg.vocab_size
            logits = jnp.zeros((r, self.k + 1, vocab))
            probs = jnp.zeros((r, self.k, vocab)) if self.method == "draft" else None
            if ex.tp is not None:
                logits, probs = ex.tp.to_global((np.asarray(logits), None if probs is None else np.asarray(probs)))
            elif ex.devices is not None:
                logits, probs = jax.device_put((logits, probs), ex.devices[0])
            jax.block_until_ready(self.sample(logits, db, probs))
            programs += 1
            if self.method == "draft" and not self.separate:  # a step no row drafts in runs no drafter
                jax.block_until_ready(self.sample(logits, db, None))
                programs += 1
        return programs

    def warmup_swap(self) -> int:
        if self.swap is None:
            return 0
        self.cache = self.swap.warmup(self.cache)
        return len(self.swap.widths) * 2

    def swap_pages(self, plan) -> None:
        """The plan's swaps on the draft model's pool (the target's run beside)."""
        if self.swap is not None:
            self.cache = self.swap.run(self.cache, plan)

    def export_kv(self, pages) -> tuple:
        """The draft model's K and V of `pages` (host copies), where it has its own pool."""
        return () if self.swap is None else self.swap.gather(self.cache, pages)


def import_draft_kv(spec: Optional[Speculator], request_id: str, kv: tuple) -> None:
    """Hold the draft model's part of an imported request's K/V (`JaxExecutor.import_kv`): kv is
    (k, v), then the draft pool's (k, v) where the exporting replica has one; both replicas must."""
    pool = None if spec is None else spec.swap
    if len(kv) != (2 if pool is None else 4):
        raise ValueError(
            f"request {request_id}: its K/V come from a replica {'with' if len(kv) == 4 else 'without'} a draft "
            f"model's pool, this one {'has none' if pool is None else 'has one'} (spec.draft_model must match)"
        )
    if pool is not None:
        pool.put(request_id, *kv[2:])
