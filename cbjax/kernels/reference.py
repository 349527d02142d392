"""Plain-jnp ragged paged attention: the oracle every other backend is tested against.

Each token gathers its row's whole page table, masks keys past its own position and
softmaxes in f32: T x max_pages_per_seq x page_size keys of work, whatever the lengths.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from cbjax.kernels.metadata import AttentionMetadata, check_shapes, layer_view


def ragged_attention_reference(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    md: AttentionMetadata,
    *,
    layer: Optional[jax.Array] = None,
    qkv: Optional[jax.Array] = None,  # the contract's fused product: q is read from q here
    scale: Optional[float] = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """See `cbjax.kernels.metadata` for the contract (and `layer`)."""
    check_shapes("ragged_attention_reference", q, *layer_view(k_pages, v_pages, layer), md)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]
    max_pages = md.page_table.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    max_len = max_pages * page_size

    table = md.page_table[md.token_row]  # i32[T, max_pages]

    def gather(pages):  # -> f32[T, num_kv_heads, max_len, head_dim]
        if layer is None:
            x = jnp.take(pages, table, axis=1, mode="clip").transpose(1, 0, 2, 3, 4)  # [T, kv, max_pages, ps, d]
        else:
            x = pages.at[layer, :, table].get(mode="clip").transpose(0, 2, 1, 3, 4)  # [T, kv, max_pages, ps, d]
        return x.reshape(num_tokens, num_kv_heads, max_len, head_dim).astype(jnp.float32)

    key_pos = jnp.arange(max_len)
    valid = (md.token_pos[:, None] >= 0) & (key_pos[None, :] <= md.token_pos[:, None])  # bool[T, max_len]
    k = gather(k_pages)
    v = jnp.where(valid[:, None, :, None], gather(v_pages), 0.0)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    scores = jnp.einsum("tkgd,tksd->tkgs", q4, k, precision=hi) * scale
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, None, :], jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tkgs,tksd->tkgd", p, v, precision=hi) / jnp.where(l > 0, l, 1.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
