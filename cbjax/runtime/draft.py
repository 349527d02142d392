"""Draft proposals on the device: up to k drafts per row in one jitted call, a loop inside it.

    drafts, probs, cache = propose(weights, cache, batch, inputs, graphdef=..., attention=..., ...)

Two drafters (`spec.method=draft`):
- a separate draft model (`spec.draft_model`): its own weights and its own KV pool on the
  target's page tables (the same page ids). Pass 0 runs it over the step's whole ragged batch
  (`batch`, the target's), draft slots aside: its pool then holds K/V for every token the
  target's does (prompts, chunks, each row's last token), and its logits at each row's last
  non-draft token give draft 1. Pass j >= 1 runs draft j alone in its row and gives draft j + 1;
  the last pass, j = num_drafts, only writes draft num_drafts' K/V, which the pool needs when
  every draft is accepted. So after a step the pool holds the draft's K/V for each accepted
  token, and rejected positions are rewritten when later tokens reach them, as the target's are.
- the target's first N layers and its head (`spec.draft_layers`, self-speculation): one KV
  pool. Pass 0 runs each drafting row's last token (`inputs.last_token`) alone, pass j draft j.
  The layers are the target's, so their K/V at a position are the target's own for the same
  tokens; the draft writes layers 0..N-1 at the draft positions, where the target's verifying
  step then writes every layer, before anything reads them again. A drafting row must have
  exactly one non-draft token (a decode): the cache must hold the positions before it.

A one-token pass is a ragged batch of R tokens, row r's at flat index r; a row past its drafts
repeats its last position with its K/V write sent to the null page. Trip count: the step's most
drafts (data), so shapes depend only on R, k and (pass 0 of a draft model) the token bucket.
Draft j + 1 is the argmax of pass j's logits, or for a row with temperature > 0 a draw from
them after the row's temperature, top-k and top-p (key: `verify.token_key(seed, index, DRAFT)`),
whose distribution `probs` the verification reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from cbjax.kernels.metadata import AttentionMetadata
from cbjax.model.ops import first_argmax
from cbjax.runtime.kv_cache import NULL_PAGE, KVCache
from cbjax.runtime.shard import constrain_cache, replicate
from cbjax.runtime.step import DeviceBatch, forward, step_compiler_options
from cbjax.runtime.verify import DRAFT, target_probs, token_key


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["page_table", "last_pos", "last_token", "num_drafts", "num_rows", "sampling", "work"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """What the one-token passes need, R-shaped (no token bucket)."""

    page_table: jax.Array  # i32[R, max_pages]
    last_pos: jax.Array  # i32[R]: each row's last non-draft position; idle rows 0
    last_token: jax.Array  # i32[R]: its token id
    num_drafts: jax.Array  # i32[R]
    num_rows: jax.Array  # i32[]: rows in use (the first)
    sampling: tuple  # temperature f32[R], top_k i32[R], top_p f32[R], seed u32[R], index i32[R] (last_pos + 1)
    work: Optional[Any] = None  # the one-token layout's query groups (grouped attention backends)


def pass_batch(inputs: DraftInputs, tokens: jax.Array, j, page_size: int) -> DeviceBatch:
    """The one-token pass j: row r's token `tokens[r]` at last_pos + min(j, num_drafts), its K/V
    written only while j <= num_drafts (the null page after, and for rows without drafts)."""
    num_rows = inputs.last_pos.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    used = rows < inputs.num_rows
    pos = jnp.where(used, inputs.last_pos + jnp.minimum(j, inputs.num_drafts), 0)
    writes = used & (inputs.num_drafts > 0) & (j <= inputs.num_drafts)
    page = inputs.page_table[rows, pos // page_size]
    write_idx = jnp.where(writes, page * page_size + pos % page_size, NULL_PAGE)
    md = AttentionMetadata(
        page_table=inputs.page_table, query_start=jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), inputs.num_rows),
        kv_lens=jnp.where(used, pos + 1, 0), token_row=jnp.where(used, rows, 0), token_pos=jnp.where(used, pos, -1),
        work=inputs.work,
    )  # fmt: skip
    return DeviceBatch(
        tokens=tokens, positions=pos, write_idx=write_idx, md=md, logits_idx=rows, sampling=inputs.sampling,
        feed=jnp.full(num_rows, -1, jnp.int32), prev_tokens=jnp.zeros(num_rows, jnp.int32),
    )  # fmt: skip


def without_drafts(batch: DeviceBatch, num_drafts: jax.Array) -> DeviceBatch:
    """The target's batch with its draft slots' K/V writes sent to the null page (a draft
    model's pass 0: its passes write those positions themselves)."""
    t = jnp.arange(batch.tokens.shape[0], dtype=jnp.int32)
    row = batch.md.token_row
    last = batch.logits_idx[row]
    is_draft = (batch.md.token_pos >= 0) & (t > last - num_drafts[row]) & (t <= last)
    return dataclasses.replace(batch, write_idx=jnp.where(is_draft, NULL_PAGE, batch.write_idx))


def propose_fn(weights, cache: KVCache, batch: Optional[DeviceBatch], inputs: DraftInputs, *, graphdef, attention: str,
               k: int, sample: bool, num_layers: Optional[int] = None, mesh=None, matmul: str = "xla"):  # fmt: skip
    """(drafts i32[R, k], probs f32[R, k, V] or None, the new cache). `batch`: the target's
    ragged batch, for a separate draft model's pass 0; None: self-speculation with the target's
    first `num_layers` layers. `sample`: rows with temperature > 0 draw (else all argmax, no
    probs). Shapes as the module docstring says."""
    num_rows = inputs.last_pos.shape[0]
    page_size = cache.k.shape[3]
    temperature, top_k, top_p, seeds, index = inputs.sampling
    kw = dict(graphdef=graphdef, attention=attention, mesh=mesh, matmul=matmul, num_layers=num_layers)

    def run(cache, b, logits_idx):
        model, ops, x, cache = forward(weights, cache, b, **kw)
        _, logits = ops.head(x, logits_idx, model.norm, model.lm_head, model.embed_tokens)
        return logits, cache  # f32[R, V]

    def draw(logits, j):  # the token after position last_pos + j, and its distribution
        greedy = first_argmax(logits)
        if not sample:
            return greedy, None

        def sampled():
            filtered, q = target_probs(logits[:, None], temperature, top_k, top_p)
            noise = jax.vmap(lambda s, i: jax.random.gumbel(token_key(s, i, DRAFT), logits.shape[-1:]))(seeds, index + j)
            return jnp.where(temperature > 0, first_argmax(filtered[:, 0] + noise), greedy), q[:, 0]

        return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: (greedy, jnp.zeros_like(logits)))

    if batch is not None:  # a draft model: pass 0 over the step's batch keeps its pool whole
        logits, cache = run(cache, without_drafts(batch, inputs.num_drafts), batch.logits_idx - inputs.num_drafts)
        last = jnp.max(inputs.num_drafts)  # its last pass writes the last draft's K/V
    else:
        logits, cache = run(cache, pass_batch(inputs, inputs.last_token, 0, page_size), jnp.arange(num_rows))
        last = jnp.max(inputs.num_drafts) - 1
    tok, q = draw(logits, 0)
    drafts = jnp.zeros((num_rows, k), jnp.int32).at[:, 0].set(tok)
    probs = None if q is None else jnp.zeros((num_rows, k, q.shape[-1]), q.dtype).at[:, 0].set(q)

    def body(state):
        j, cache, drafts, probs = state
        logits, cache = run(cache, pass_batch(inputs, drafts[:, j - 1], j, page_size), jnp.arange(num_rows))
        tok, q = draw(logits, j)
        at = jnp.minimum(j, k - 1)  # j == k: the last pass's logits are not needed
        keep = j < k
        drafts = jax.lax.dynamic_update_slice(drafts, jnp.where(keep, tok, drafts[:, at])[:, None], (0, at))
        if probs is not None:
            probs = jax.lax.dynamic_update_slice(probs, jnp.where(keep, q, probs[:, at])[:, None], (0, at, 0))
        return j + 1, cache, drafts, probs

    _, cache, drafts, probs = jax.lax.while_loop(lambda s: s[0] <= last, body, (jnp.int32(1), cache, drafts, probs))
    if mesh is not None:
        drafts = replicate(drafts, mesh)
        probs = None if probs is None else replicate(probs, mesh)
        cache = KVCache(k=constrain_cache(cache.k, mesh), v=constrain_cache(cache.v, mesh))
    return drafts, probs, cache


@functools.cache
def _jitted(backend: str):
    return jax.jit(
        propose_fn, static_argnames=("graphdef", "attention", "k", "sample", "num_layers", "mesh", "matmul"),
        donate_argnames=("cache",), compiler_options=step_compiler_options(backend),
    )  # fmt: skip


def propose(*args, **kwargs):
    """`propose_fn` jitted (the cache donated), with the step's compiler options."""
    return _jitted(jax.default_backend())(*args, **kwargs)


def lower_propose(*args, **kwargs):
    return _jitted(jax.default_backend()).lower(*args, **kwargs)
