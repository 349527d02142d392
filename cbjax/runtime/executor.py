"""JaxExecutor: packs a schedule into fixed-shape arrays, runs the jitted steps, reads tokens back.

The jit boundary is `_decode_and_sample` / `_prefill_and_sample`: params are traced arguments,
the KV cache is donated (updated in place), shapes are fixed by the slot count, the page-table
width and a few prefill buckets, so nothing compiles after `warmup`.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import jax
import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.executor import StepOutput
from cbjax.kernels.paged_attention import attention_op, resolve_attention
from cbjax.model import decode_step, init_cache, prefill
from cbjax.model.functional import fuse_projections, init_params
from cbjax.request import Request
from cbjax.runtime.compiles import compile_count
from cbjax.runtime.sampling import sample
from cbjax.runtime.swap import HostSwap
from cbjax.scheduler.core import Schedule


def _decode_and_sample(params, cache, tokens, positions, page_table, active, sampling, *, cfg, attn_fn):
    logits, cache = decode_step(params, cache, tokens, positions, page_table, active, cfg, attn_fn)
    return sample(logits, *sampling), cache


def _prefill_and_sample(params, cache, tokens, lengths, page_table, sampling, *, cfg):
    logits, cache = prefill(params, cache, tokens, lengths, page_table, cfg)
    return sample(logits, *sampling), cache


def _prefill_after_context_and_sample(params, cache, tokens, lengths, start, page_table, sampling, *, cfg):
    logits, cache = prefill(params, cache, tokens, lengths, page_table, cfg, start=start)
    return sample(logits, *sampling), cache


_STEPS: dict[tuple[str, str, int], tuple] = {}


class _DecodeSteps:
    """Jitted decode steps, one per ragged-attention entry count (None for the other impls)."""

    def __init__(self, model: ModelConfig, attention: str, pages_per_block: int):
        self._make = functools.partial(attention_op, attention, pages_per_block=pages_per_block)
        self._model = model
        self._jitted: dict[Optional[int], object] = {}

    def __call__(self, entries: Optional[int]):
        if entries not in self._jitted:
            attn_fn = self._make(num_entries=entries)
            step = functools.partial(_decode_and_sample, cfg=self._model, attn_fn=attn_fn)
            self._jitted[entries] = jax.jit(step, donate_argnums=(1,))
        return self._jitted[entries]


def jitted_steps(model: ModelConfig, attention: str, pages_per_block: int):
    """The jitted (decode by entry count, prefill, context prefill) steps, shared by every
    executor with the same model and attention, so experiment arms and tests reuse compiled
    programs."""
    key = (repr(model), attention, pages_per_block)
    if key not in _STEPS:
        _STEPS[key] = (
            _DecodeSteps(model, attention, pages_per_block),
            jax.jit(functools.partial(_prefill_and_sample, cfg=model), donate_argnums=(1,)),
            jax.jit(functools.partial(_prefill_after_context_and_sample, cfg=model), donate_argnums=(1,)),
        )
    return _STEPS[key]


def default_buckets(longest: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to `longest`, which is always the last bucket."""
    buckets, b = [], smallest
    while b < longest:
        buckets.append(b)
        b *= 2
    return buckets + [longest]


def geometric_buckets(longest: int, smallest: int, ratio: float = 2**0.5) -> list[int]:
    """Sizes from `smallest` up to `longest` (always the last), each about `ratio` x the one
    before: finer than powers of two, so a batch pads its work by at most ~41%."""
    buckets, b = [], float(smallest)
    while round(b) < longest:
        if not buckets or round(b) > buckets[-1]:
            buckets.append(round(b))
        b *= ratio
    return buckets + [longest]


class SamplingArrays:
    """Host buffers for the per-row sampling knobs: f32 temperature, i32 top_k, f32 top_p,
    u32 seed, i32 position of the token being generated."""

    def __init__(self, rows: int):
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.seed = np.zeros(rows, np.uint32)
        self.position = np.zeros(rows, np.int32)

    def set(self, row: int, req: Request) -> None:
        sp = req.sampling
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.seed[row] = sp.seed & 0xFFFFFFFF
        self.position[row] = req.num_tokens  # the index of the token this step generates

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.temperature, self.top_k, self.top_p, self.seed, self.position)


class JaxExecutor:
    """The real-engine side of the executor interface."""

    virtual_clock = False

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        cfg: ExecutorConfig,
        seed: int = 0,
        params=None,
    ):
        self.model = model
        self.num_slots = scheduler.max_num_seqs
        self.page_size = cache.page_size
        self.max_pages = -(-model.max_model_len // cache.page_size)
        # Decode reads a prefix of the page table wide enough for the longest active sequence:
        # one compiled variant per width, so short batches do not pay for max_model_len.
        widths = cfg.decode_page_buckets or default_buckets(self.max_pages, smallest=max(1, self.max_pages // 8))
        self.decode_widths = sorted({min(w, self.max_pages) for w in widths} | {self.max_pages})
        self.decode_rows = sorted({min(r, self.num_slots) for r in cfg.decode_row_buckets or []} | {self.num_slots})
        self.attention = resolve_attention(cfg.attention)
        # (rows, page-table width, ragged entries) variants compiled for decode. Ragged attention
        # reads pages through the full table, so its work is set by the entry count instead:
        # the total pages the active slots hold, rounded up to a compiled size.
        self.decode_shapes: dict[int, list[tuple[int, Optional[int]]]] = {}
        for rows in self.decode_rows:
            if self.attention == "ragged":
                cap = rows * self.max_pages
                sizes = cfg.decode_entry_buckets or geometric_buckets(cap, smallest=max(rows, cap // 8))
                entries = sorted({min(int(e), cap) for e in sizes} | {cap})
                self.decode_shapes[rows] = [(self.max_pages, e) for e in entries]
            else:
                self.decode_shapes[rows] = [(w, None) for w in self.decode_widths]
        longest = min(model.max_model_len, scheduler.max_num_batched_tokens)
        self.buckets = sorted(set(cfg.prefill_buckets or default_buckets(longest)))
        if self.buckets[-1] < longest:
            raise ValueError(
                f"executor.prefill_buckets: the largest bucket {self.buckets[-1]} is shorter than the "
                f"longest prefill, min(model.max_model_len, scheduler.max_num_batched_tokens) = {longest}"
            )
        # Prefill calls have 1 row, or max_prefill_batch rows when several share a bucket.
        self.row_buckets = sorted({1, min(cfg.max_prefill_batch, self.num_slots)})
        # Prefills that continue cached tokens (a chunk, a recompute beyond the token budget)
        # run in pieces of one bucket through a second, context-reading step.
        # Under chunked prefill a chunk is at most the token budget: one piece per chunk.
        piece = min(scheduler.max_num_batched_tokens, longest) if scheduler.chunked_prefill else 64
        self.context_bucket = next((b for b in self.buckets if b >= piece), self.buckets[-1])
        # Serving layout: q/k/v and gate/up fused into one matmul each (same model, same numbers).
        self.params = fuse_projections(params if params is not None else init_params(model, seed))
        self.cache = init_cache(model, cache.num_pages, cache.page_size)
        # keyed by the resolved impl, so `auto` and what it resolves to share compiled programs
        self._decode, self._prefill, self._prefill_ctx = jitted_steps(model, self.attention, cfg.pages_per_block)
        # decode buffers, one row per slot
        self._page_table = np.zeros((self.num_slots, self.max_pages), np.int32)  # i32[num_slots, max_pages]
        self._row_key: list[tuple[int, int, int]] = [(0, 0, 0)] * self.num_slots  # (request, admission, pages)
        self._tokens = np.zeros(self.num_slots, np.int32)
        self._positions = np.zeros(self.num_slots, np.int32)
        self._active = np.zeros(self.num_slots, bool)
        self._sampling = SamplingArrays(self.num_slots)
        # Swap preemption moves pages in calls padded to the decode page-table widths.
        self._swap = HostSwap(self.decode_widths)
        self._swap_at_warmup = scheduler.preemption == "swap"
        self.swap_s = 0.0
        self._compiles_at_warmup: Optional[int] = None
        self.host_pack_s = 0.0
        self.device_s = 0.0
        self.num_steps = 0
        self._on_cpu = jax.default_backend() == "cpu"
        self.decode_calls: dict[tuple[int, int, Optional[int]], int] = {}  # (rows, width, entries) -> calls
        self.num_context_prefills = 0

    # ---- interface ----
    def validate(self, req: Request) -> Optional[str]:
        ids = req.prompt_ids()
        vocab = self.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"request {req.request_id}: prompt token id {bad} is outside the vocabulary (model.vocab_size={vocab})"
        return None

    def warmup(self) -> None:
        """Compile the decode step and every prefill bucket with all-padding inputs."""
        compile_count()  # start counting before the first compile
        sampling = SamplingArrays(self.num_slots).arrays()
        for rows, shapes in self.decode_shapes.items():
            for width, entries in shapes:
                toks, self.cache = self._decode(entries)(
                    self.params, self.cache, self._tokens[:rows], self._positions[:rows],
                    self._page_table[:rows, :width], self._active[:rows], tuple(a[:rows] for a in sampling),
                )  # fmt: skip
                jax.block_until_ready(toks)
        for bucket in self.buckets:
            for rows in self.row_buckets:
                toks = self._run_prefill(np.zeros((rows, bucket), np.int32), [], {})
                jax.block_until_ready(toks)
        toks = self._run_prefill(np.zeros((1, self.context_bucket), np.int32), [], {}, context=True)
        jax.device_get(toks)
        if self._swap_at_warmup:
            self.cache = self._swap.warmup(self.cache)
        self._compiles_at_warmup = compile_count()

    def execute(self, plan: Schedule) -> StepOutput:
        t0 = time.perf_counter()
        call_s = 0.0
        pending = []  # (device tokens, output indices, rows): plan.requests order is decodes, prefills
        if plan.swap_out or plan.swap_in:  # before the step, swap-outs first: they may free swap-in pages
            tc = time.perf_counter()
            self._swap.swap_out(self.cache, plan.swap_out)
            self.cache = self._swap.swap_in(self.cache, plan.swap_in)
            self.swap_s += time.perf_counter() - tc
            call_s += time.perf_counter() - tc
        if plan.decodes:
            # The host's hottest loop: plain lists here, one vectorized write per array after.
            slots, tokens, positions = [], [], []
            page_tables = plan.page_tables
            for req in plan.decodes:
                s = req.slot
                self._sync_row(s, req, page_tables[req.request_id])
                n = req.num_computed
                out_idx = n - req.prompt_len
                tokens.append(req.output_token_ids[out_idx] if out_idx >= 0 else req.prompt_ids()[n])
                positions.append(n)
                slots.append(s)
            self._active[:] = False
            self._active[slots] = True
            self._tokens[slots] = tokens
            self._positions[slots] = positions
            page_size = self.page_size
            longest = max(positions) + 1
            held = sum(n // page_size for n in positions) + len(positions)  # pages the active slots attend over
            rows = next(r for r in self.decode_rows if r >= len(slots))
            need = -(-longest // page_size)
            width, entries = next(
                (w, e) for w, e in self.decode_shapes[rows] if w >= need and (e is None or e >= held)
            )
            np.add(self._positions, 1, out=self._sampling.position)  # index of the token generated
            args = (self._tokens, self._positions, self._page_table[:, :width], self._active, self._sampling.arrays())
            if rows < self.num_slots:  # pack the active slots into the first rows; the rest are inactive
                idx = np.zeros(rows, np.intp)
                idx[: len(slots)] = slots
                tokens, positions, table, active, sampling = args
                active = np.arange(rows) < len(slots)
                args = (tokens[idx], positions[idx], table[idx], active, tuple(a[idx] for a in sampling))
                slots = list(range(len(slots)))
            tc = time.perf_counter()
            shape = (rows, width, entries)
            self.decode_calls[shape] = self.decode_calls.get(shape, 0) + 1
            toks, self.cache = self._decode(entries)(self.params, self.cache, *args)
            call_s += time.perf_counter() - tc
            pending.append((toks, range(len(slots)), slots))
        first = len(plan.decodes)
        fresh = [(first + i, r) for i, r in enumerate(plan.prefills) if r.num_computed == 0]
        for bucket, group in self._prefill_groups(fresh):
            tokens = self._fresh_prefill_tokens(bucket, [r for _, r in group])
            tc = time.perf_counter()
            toks = self._run_prefill(tokens, [r for _, r in group], plan.page_tables)
            call_s += time.perf_counter() - tc
            pending.append((toks, [i for i, _ in group], range(len(group))))
        for i, req in enumerate(plan.prefills):
            if req.num_computed > 0:
                tc = time.perf_counter()
                toks = self._context_prefill(req, plan.page_tables)
                call_s += time.perf_counter() - tc
                pending.append((toks, [first + i], [0]))
        t1 = time.perf_counter()
        if len(pending) > 1 and not self._on_cpu:  # overlap the copies; on CPU they cost ~60 us each, for nothing
            for toks, _, _ in pending:
                toks.copy_to_host_async()
        token_ids = [0] * plan.num_scheduled
        for toks, out_idx, rows in pending:  # one small device->host copy per call
            values = np.asarray(toks)[rows].tolist()
            for i, v in zip(out_idx, values):
                token_ids[i] = v
        t2 = time.perf_counter()
        self.host_pack_s += (t1 - t0) - call_s
        self.device_s += (t2 - t1) + call_s
        self.num_steps += 1
        return StepOutput(token_ids=token_ids, duration_s=t2 - t0)

    def metrics(self) -> dict:
        after = compile_count() - self._compiles_at_warmup if self._compiles_at_warmup is not None else None
        return {
            "compiles_after_warmup": after,
            "prefill_buckets": self.buckets,
            "attention": self.attention,
            "decode_shapes": {rows: [list(shape) for shape in shapes] for rows, shapes in self.decode_shapes.items()},
            # "rows x width" (or "rows x width / entries" under ragged attention) -> decode calls
            "decode_calls": {
                f"{r}x{w}" + ("" if e is None else f"/{e}"): n for (r, w, e), n in sorted(self.decode_calls.items(), key=str)
            },
            "host_pack_s": self.host_pack_s,
            "device_wait_s": self.device_s,
            "context_prefills": self.num_context_prefills,
            "swap_s": self.swap_s,
        }

    # ---- packing ----
    def _sync_row(self, slot: int, req: Request, pages: list[int]) -> None:
        """Refresh a slot's page-table row (and sampling knobs) only when its admission or page
        count changed: most decode steps touch neither."""
        key = (id(req), req.admit_seq, len(pages))
        if self._row_key[slot] != key:
            if self._row_key[slot][:2] != key[:2]:
                self._sampling.set(slot, req)
            row = self._page_table[slot]
            row[:] = 0
            row[: len(pages)] = pages
            self._row_key[slot] = key

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"prefill of {n} tokens exceeds the largest bucket {self.buckets[-1]}")

    def _prefill_groups(self, prefills: list[tuple[int, Request]]) -> list[tuple[int, list[tuple[int, Request]]]]:
        """(bucket, [(output index, request)]) groups of at most the largest row count."""
        by_bucket: dict[int, list[tuple[int, Request]]] = {}
        for item in prefills:
            by_bucket.setdefault(self._bucket(item[1].num_new_tokens), []).append(item)
        most = self.row_buckets[-1]
        return [
            (bucket, items[i : i + most]) for bucket, items in sorted(by_bucket.items()) for i in range(0, len(items), most)
        ]

    def _run_prefill(self, tokens: np.ndarray, reqs: list[Request], pages: dict, starts=None, context=False):
        """Dispatch one prefill call over `tokens` i32[rows, bucket]; rows past `reqs` are padding."""
        rows = tokens.shape[0]
        lengths = np.zeros(rows, np.int32)
        table = np.zeros((rows, self.max_pages), np.int32)
        sampling = SamplingArrays(rows)
        for i, req in enumerate(reqs):
            lengths[i] = req.num_new_tokens if starts is None else starts[i][1]
            row = pages[req.request_id]
            table[i, : len(row)] = row
            sampling.set(i, req)
        if context:
            start = np.zeros(rows, np.int32)
            for i, (lo, _) in enumerate(starts or []):
                start[i] = lo
            toks, self.cache = self._prefill_ctx(self.params, self.cache, tokens, lengths, start, table, sampling.arrays())
        else:
            toks, self.cache = self._prefill(self.params, self.cache, tokens, lengths, table, sampling.arrays())
        return toks

    def _fresh_prefill_tokens(self, bucket: int, reqs: list[Request]) -> np.ndarray:
        """i32[rows, bucket]: each request's tokens from position 0, rows padded to a row bucket."""
        rows = next(r for r in self.row_buckets if r >= len(reqs))
        tokens = np.zeros((rows, bucket), np.int32)
        for i, req in enumerate(reqs):
            n = req.num_new_tokens
            seq = req.prompt_ids() if n <= req.prompt_len else req.prompt_ids() + req.output_token_ids
            tokens[i, :n] = seq[:n]
        return tokens

    def _context_prefill(self, req: Request, page_tables: dict):
        """A prefill that continues cached tokens, in pieces of `context_bucket` tokens."""
        seq = req.prompt_ids() + req.output_token_ids
        lo, end = req.num_computed, req.num_computed + req.num_new_tokens
        step = self.context_bucket
        self.num_context_prefills += 1
        toks = None
        for piece in range(lo, end, step):
            n = min(step, end - piece)
            tokens = np.zeros((1, step), np.int32)
            tokens[0, :n] = seq[piece : piece + n]
            toks = self._run_prefill(tokens, [req], page_tables, starts=[(piece, n)], context=True)
        return toks
