"""XLA ragged paged attention (the CPU default): work follows the pages the tokens read.

The packer (`cbjax.layout.tiles`) lists the step's queries as groups: a decode token alone
(the single list), or up to `block` consecutive new tokens of one longer row (the block list;
in a step no larger than the slot array every token is a single group and this list is empty),
each with the number of its row's pages it reads, up to its last position, so causal work past
a group is never done and a row's pages are read once per group, not once per token. Each list
is sorted longest first and cut into chunks of a fixed number of groups. An outer loop walks
the chunks, an inner loop the chunk's pages, a few per step, for all of its groups at once,
with an online softmax in per-group accumulators; each chunk's result is stored once. Trip
counts are data (chunks in use, pages per chunk), so shapes depend only on the token count T:
a step compiles once per token bucket, whatever its lengths. No accumulator is merged by
scatter inside a loop: a step writes every token's output by one scatter at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from cbjax.kernels.metadata import AttentionMetadata, check_shapes, layer_view

# Finite, so a fully masked query never computes inf - inf.
MASK_VALUE = -1e30


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["q_idx", "row", "chunk_pages", "num_chunks"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Tiles:
    """One group list, padded to a static capacity (whole chunks; the chunk size is
    capacity // len(chunk_pages))."""

    q_idx: jax.Array  # i32[capacity, block]: flat token index per query; padding: T
    row: jax.Array  # i32[capacity]: the group's row (its page-table row)
    chunk_pages: jax.Array  # i32[num_chunks_cap]: pages the chunk's longest group reads
    num_chunks: jax.Array  # i32[]: chunks in use (the first)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["single", "block"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RaggedWork:
    """`AttentionMetadata.work` for this backend."""

    single: Tiles  # block 1: decode tokens
    block: Tiles  # several tokens per group: prefill and chunk tokens


def _group_pass(groups: Tiles, q_ext, pos_ext, page_table, k_flat, v_flat, page_base, num_pages, step, scale):
    """f32[kv, capacity, block, g, d]: each group's attention output (zeros for padding).

    Arrays are kv-head major, so batched contractions need no transposes. k_flat / v_flat are
    the cache viewed as [pages, page_size * d], one page per row; page p of kv head h lives at
    row page_base[h] + p (in bounds: page ids are clipped to the pool)."""
    cap, block = groups.q_idx.shape
    chunk = cap // groups.chunk_pages.shape[0]
    kvh, _, group, head_dim = q_ext.shape
    page_size = k_flat.shape[1] // head_dim
    max_pages = page_table.shape[1]
    rows = block * group  # query rows per kv head of one group
    keys = step * page_size
    key_off = jnp.arange(keys, dtype=jnp.int32)
    col_off = jnp.arange(step, dtype=jnp.int32)

    def chunk_body(c, out):
        lo = c * chunk
        q_idx = lax.dynamic_slice_in_dim(groups.q_idx, lo, chunk)  # i32[chunk, block]
        row = lax.dynamic_slice_in_dim(groups.row, lo, chunk)
        q = q_ext[:, q_idx].reshape(kvh, chunk, rows, head_dim) * scale  # f32[kv, chunk, rows, d]
        q_pos = pos_ext[q_idx]  # i32[chunk, block]; -1 for padding
        q_pos_rows = jnp.repeat(q_pos, group, axis=1)[None, :, :, None]  # i32[1, chunk, rows, 1]
        last = jnp.max(q_pos, axis=1)  # keys at or before it hold real values
        table = page_table[row]  # i32[chunk, max_pages]

        def page_body(i, acc):
            m, l, o = acc  # f32[kv, chunk, rows], f32[kv, chunk, rows], f32[kv, chunk, rows, d]
            cols = jnp.minimum(i * step + col_off, max_pages - 1)
            page = jnp.clip(table[:, cols], 0, num_pages - 1)  # i32[chunk, step]; entries past a row may hold anything
            flat = page_base[:, None, None] + page[None]  # i32[kv, chunk, step]
            k = k_flat.at[flat].get(mode="promise_in_bounds").reshape(kvh, chunk, keys, head_dim).astype(jnp.float32)
            v = v_flat.at[flat].get(mode="promise_in_bounds").reshape(kvh, chunk, keys, head_dim).astype(jnp.float32)
            key_pos = i * keys + key_off  # i32[keys]
            v = jnp.where((key_pos[None, :] <= last[:, None])[None, :, :, None], v, 0.0)  # unwritten slots may be NaN
            if block == 1:  # tiny contractions run faster as fused multiply-reduce than as batched dots
                s = jnp.sum(q[:, :, :, None, :] * k[:, :, None], axis=-1)
            else:
                s = jnp.einsum("kcrd,kcsd->kcrs", q, k)
            valid = key_pos[None, None, None, :] <= q_pos_rows  # bool[1, chunk, rows, keys]
            s = jnp.where(valid, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            corr = jnp.exp(m - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
            l = l * corr + jnp.sum(p, axis=-1)
            if block == 1:
                pv = jnp.sum(p[..., None] * v[:, :, None], axis=-2)
            else:
                pv = jnp.einsum("kcrs,kcsd->kcrd", p, v)
            return m_new, l, o * corr[..., None] + pv

        acc = (
            jnp.full((kvh, chunk, rows), MASK_VALUE, jnp.float32),
            jnp.zeros((kvh, chunk, rows), jnp.float32),
            jnp.zeros((kvh, chunk, rows, head_dim), jnp.float32),
        )
        _, l, o = lax.fori_loop(0, (groups.chunk_pages[c] + step - 1) // step, page_body, acc)
        res = (o / jnp.where(l > 0, l, 1.0)[..., None]).reshape(kvh, chunk, block, group, head_dim)
        return lax.dynamic_update_slice_in_dim(out, res, lo, axis=1)

    out = jnp.zeros((kvh, cap, block, group, head_dim), jnp.float32)
    if cap == chunk:  # one chunk (a slot array no larger than it): no outer loop to compile
        return chunk_body(0, out)
    return lax.fori_loop(0, groups.num_chunks, chunk_body, out)


class PagedView(NamedTuple):
    """The cache as the group passes read it: one page per row of a flat view (a reshape, no
    copy), kv head h of the layer starting at row `page_base[h]`; token positions with a -1
    sentinel at index T (padding slots)."""

    num_kv_heads: int
    num_pages: int
    group: int  # query heads per kv head
    scale: float
    k_flat: jax.Array  # [rows, page_size * head_dim]
    v_flat: jax.Array
    page_base: jax.Array  # i32[num_kv_heads]
    pos_ext: jax.Array  # i32[T + 1]


def paged_view(q, k_pages, v_pages, md: AttentionMetadata, layer, scale) -> PagedView:
    """`PagedView` of one layer's pages (the whole cache with `layer`), shared by the XLA
    passes and the native kernels."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, num_pages, page_size = k_pages.shape[-4:-1]
    first = 0 if layer is None else layer * num_kv_heads
    return PagedView(
        num_kv_heads=num_kv_heads,
        num_pages=num_pages,
        group=num_heads // num_kv_heads,
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        k_flat=k_pages.reshape(-1, page_size * head_dim),
        v_flat=v_pages.reshape(-1, page_size * head_dim),
        page_base=(first + jnp.arange(num_kv_heads, dtype=jnp.int32)) * num_pages,
        pos_ext=jnp.concatenate([md.token_pos.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)]),
    )


def ragged_attention_xla(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,  # md.work: RaggedWork
    *,
    layer: Optional[jax.Array] = None,
    qkv: Optional[jax.Array] = None,  # the contract's fused product: q is read from q here
    scale: Optional[float] = None,
    pages_single: int = 2,
    pages_block: int = 2,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """See `cbjax.kernels.metadata` for the contract and the module docstring for the method.

    With `layer`, k_pages and v_pages are the whole cache [num_layers, num_kv_heads, ...] and
    each page is gathered from that layer directly (no copy of the layer's pool). `pages_*`:
    pages each group reads per inner loop step, in the single and block lists."""
    check_shapes("ragged_attention_xla", q, *layer_view(k_pages, v_pages, layer), md)
    if not isinstance(md.work, RaggedWork):
        raise ValueError("ragged_attention_xla: md.work must hold the RaggedWork groups the packer builds")
    for name, tiles in (("single", md.work.single), ("block", md.work.block)):
        if tiles.q_idx.shape[0] and tiles.q_idx.shape[0] % tiles.chunk_pages.shape[0]:
            raise ValueError(
                f"ragged_attention_xla: {name} capacity {tiles.q_idx.shape[0]} is not a multiple of its "
                f"{tiles.chunk_pages.shape[0]} chunks"
            )
    num_tokens, num_heads, head_dim = q.shape
    pv = paged_view(q, k_pages, v_pages, md, layer, scale)
    num_kv_heads, num_pages, group, scale = pv.num_kv_heads, pv.num_pages, pv.group, pv.scale
    k_flat, v_flat, page_base, pos_ext = pv.k_flat, pv.v_flat, pv.page_base, pv.pos_ext
    q_ext = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_ext = jnp.concatenate([q_ext, jnp.zeros((num_kv_heads, 1, group, head_dim), jnp.float32)], axis=1)
    res, idx = [], []
    for tiles, step in ((md.work.single, pages_single), (md.work.block, pages_block)):
        if tiles.q_idx.shape[0] == 0:  # an empty list (no block list in a small step): no pass
            continue
        r = _group_pass(tiles, q_ext, pos_ext, md.page_table, k_flat, v_flat, page_base, num_pages, step, scale)
        res.append(r.reshape(num_kv_heads, -1, group, head_dim))
        idx.append(tiles.q_idx.reshape(-1))
    # Each real token sits in one group; padding slots all write zeros to token T.
    out = jnp.zeros((num_kv_heads, num_tokens + 1, group, head_dim), jnp.float32)
    out = out.at[:, jnp.concatenate(idx)].set(jnp.concatenate(res, axis=1))
    return out[:, :num_tokens].transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
