"""XLA ragged paged attention (the CPU default): work follows the pages the tokens read.

The packer (`cbjax.runtime.batch`) lists the step's work as tiles: a tile is up to `block`
query tokens of one row against one page of that row, listed only for pages at or before
the tile's last query position, so causal work past a token is never done and a row's
pages are read once per query block, not once per token. Two tile lists cover a mixed
batch: single-token tiles (decodes: no padding rows) and multi-token tiles (prefills
and chunks). Each list is walked in chunks of a fixed number of tiles by a loop whose trip
count is data (the number of tiles), so shapes depend only on the token count T: a step
compiles once per token bucket, whatever its lengths. Per chunk, each tile computes a
split softmax over its page (max, sum, weighted values) and merges it into per-token
accumulators, as in split-K decode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from cbjax.kernels.metadata import AttentionMetadata, check_shapes, layer_view

# Finite, so a fully masked tile never computes inf - inf.
MASK_VALUE = -1e30


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_idx", "page", "page_pos", "num"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Tiles:
    """One tile list, padded to a static capacity (a multiple of the chunk size)."""

    q_idx: jax.Array  # i32[capacity, block]: flat token index per query row; padding rows: T
    page: jax.Array  # i32[capacity]: the physical page the tile reads
    page_pos: jax.Array  # i32[capacity]: that page's index in its row's page table
    num: jax.Array  # i32[]: tiles in use (the first `num`)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["single", "block"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RaggedWork:
    """`AttentionMetadata.work` for this backend."""

    single: Tiles  # block 1: decode tokens
    block: Tiles  # several tokens per tile: prefill and chunk tokens


def _pages(pages: jax.Array, layer, page: jax.Array) -> jax.Array:
    """f32[len(page), num_kv_heads, page_size, head_dim]: the pages `page` of one layer, read by
    one gather from the whole cache when `layer` is given (no copy of the layer's pool)."""
    if layer is None:
        return jnp.take(pages, page, axis=1, mode="clip").transpose(1, 0, 2, 3).astype(jnp.float32)
    return pages.at[layer, :, page].get(mode="clip").astype(jnp.float32)


def _tile_pass(tiles: Tiles, chunk: int, q_ext, pos_ext, k_pages, v_pages, layer, carry, scale):
    """Merge every tile of `tiles` into the accumulators `carry`, `chunk` tiles per loop step."""
    _, block = tiles.q_idx.shape
    page_size = k_pages.shape[-2]
    key_off = jnp.arange(page_size, dtype=jnp.int32)

    def body(c, carry):
        m_acc, l_acc, o_acc = carry  # f32[T+1, kv, g], f32[T+1, kv, g], f32[T+1, kv, g, d]
        lo = c * chunk
        q_idx = lax.dynamic_slice_in_dim(tiles.q_idx, lo, chunk)  # i32[chunk, block]
        page = lax.dynamic_slice_in_dim(tiles.page, lo, chunk)  # i32[chunk]
        page_pos = lax.dynamic_slice_in_dim(tiles.page_pos, lo, chunk)
        q = q_ext[q_idx]  # f32[chunk, block, kv, g, d]
        q_pos = pos_ext[q_idx]  # i32[chunk, block]; -1 for padding rows
        key_pos = page_pos[:, None] * page_size + key_off[None, :]  # i32[chunk, page_size]
        valid = key_pos[:, None, :] <= q_pos[:, :, None]  # bool[chunk, block, page_size]
        last = jnp.max(q_pos, axis=1)  # keys at or before the tile's last query hold real values
        k = _pages(k_pages, layer, page)  # f32[chunk, kv, page_size, d]
        v = _pages(v_pages, layer, page)
        v = jnp.where((key_pos <= last[:, None])[:, None, :, None], v, 0.0)
        if block == 1:  # tiny contractions run faster as fused multiply-reduce than as batched dots
            scores = jnp.sum(q[:, 0, :, :, None, :] * k[:, :, None], axis=-1)[:, None]
        else:
            scores = jnp.einsum("cbkgd,cksd->cbkgs", q, k)
        scores = jnp.where(valid[:, :, None, None, :], scores * scale, MASK_VALUE)  # f32[chunk, block, kv, g, s]
        m = jnp.max(scores, axis=-1)  # f32[chunk, block, kv, g]
        p = jnp.where(valid[:, :, None, None, :], jnp.exp(scores - m[..., None]), 0.0)
        l = jnp.sum(p, axis=-1)
        if block == 1:
            o = jnp.sum(p[:, 0, :, :, :, None] * v[:, :, None], axis=-2)[:, None]
        else:
            o = jnp.einsum("cbkgs,cksd->cbkgd", p, v)  # f32[chunk, block, kv, g, d]
        m_new = m_acc.at[q_idx].max(m)
        if block == 1:  # decode tiles: T is at most a few rows, so rescaling every row is cheapest
            rescale = jnp.exp(m_acc - m_new)
            w = jnp.exp(m - m_new[q_idx])  # f32[chunk, block, kv, g]
            l_acc = (l_acc * rescale).at[q_idx].add(w * l)
            o_acc = (o_acc * rescale[..., None]).at[q_idx].add(w[..., None] * o)
        else:
            # Prefill tiles: T is large and a chunk touches few of its rows, so only those are
            # read and rewritten. A row listed by several tiles of the chunk is rescaled once
            # (every copy of its `set` writes the same value), then gets each tile's share.
            m_row = m_new[q_idx]
            rescale = jnp.exp(m_acc[q_idx] - m_row)
            w = jnp.exp(m - m_row)
            l_acc = l_acc.at[q_idx].set(l_acc[q_idx] * rescale).at[q_idx].add(w * l)
            o_acc = o_acc.at[q_idx].set(o_acc[q_idx] * rescale[..., None]).at[q_idx].add(w[..., None] * o)
        return m_new, l_acc, o_acc

    num_chunks = (tiles.num + chunk - 1) // chunk
    return lax.fori_loop(0, num_chunks, body, carry)


def ragged_attention_xla(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,  # md.work: RaggedWork
    *,
    layer: Optional[jax.Array] = None,
    scale: Optional[float] = None,
    chunk_single: int = 128,
    chunk_block: int = 32,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """See `cbjax.kernels.metadata` for the contract and the module docstring for the method.

    With `layer`, k_pages and v_pages are the whole cache [num_layers, num_kv_heads, ...] and
    each tile's page is gathered from that layer directly."""
    check_shapes("ragged_attention_xla", q, *layer_view(k_pages, v_pages, layer), md)
    if not isinstance(md.work, RaggedWork):
        raise ValueError("ragged_attention_xla: md.work must hold the RaggedWork tiles the packer builds")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[-4]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    for name, tiles, chunk in (("single", md.work.single, chunk_single), ("block", md.work.block, chunk_block)):
        if tiles.q_idx.shape[0] % chunk:
            raise ValueError(
                f"ragged_attention_xla: {name} tile capacity {tiles.q_idx.shape[0]} is not a multiple of its chunk {chunk}"
            )
    q_ext = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((1, num_heads, head_dim), jnp.float32)])
    q_ext = q_ext.reshape(num_tokens + 1, num_kv_heads, group, head_dim)
    pos_ext = jnp.concatenate([md.token_pos.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])
    carry = (
        jnp.full((num_tokens + 1, num_kv_heads, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens + 1, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens + 1, num_kv_heads, group, head_dim), jnp.float32),
    )
    carry = _tile_pass(md.work.single, chunk_single, q_ext, pos_ext, k_pages, v_pages, layer, carry, scale)
    carry = _tile_pass(md.work.block, chunk_block, q_ext, pos_ext, k_pages, v_pages, layer, carry, scale)
    _, l_acc, o_acc = carry
    out = o_acc / jnp.where(l_acc > 0, l_acc, 1.0)[..., None]
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
