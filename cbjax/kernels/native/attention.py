"""The `native` attention backend: the XLA ragged formulation's two group lists
(`cbjax.kernels.xla_ragged`) run as the C++ custom calls `single_groups` and
`block_groups_into`, reading each group's pages in place."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from cbjax.kernels.metadata import AttentionMetadata, check_shapes, layer_view
from cbjax.kernels.native import kernels
from cbjax.kernels.xla_ragged import RaggedWork, paged_view, ragged_attention_xla
from cbjax.layout.tiles import PAGES_BLOCK, PAGES_SINGLE


def ragged_attention_native(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], or the whole cache with `layer`
    v_pages: jax.Array,
    md: AttentionMetadata,  # md.work: RaggedWork
    *,
    layer: Optional[jax.Array] = None,
    qkv: Optional[jax.Array] = None,  # [T, num_kv_heads, group + 2, head_dim]: q's source, read in place
    scale: Optional[float] = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The `cbjax.kernels.metadata` contract, as `ragged_attention_xla` computes it. The kernels
    take an f32 cache; another dtype runs `ragged_attention_xla` itself. Given `qkv`, the kernels
    read each kv head's queries there (no copy of the q slice)."""
    if k_pages.dtype != jnp.float32:
        return ragged_attention_xla(q, k_pages, v_pages, md, layer=layer, scale=scale, pages_single=PAGES_SINGLE,
                                    pages_block=PAGES_BLOCK)
    check_shapes("ragged_attention_native", q, *layer_view(k_pages, v_pages, layer), md)
    if not isinstance(md.work, RaggedWork):
        raise ValueError("ragged_attention_native: md.work must hold the RaggedWork groups the packer builds")
    num_tokens, num_heads, head_dim = q.shape
    pv = paged_view(q, k_pages, v_pages, md, layer, scale)
    num_kv_heads, num_pages, group, scale = pv.num_kv_heads, pv.num_pages, pv.group, pv.scale
    k_flat, v_flat, page_base, pos_ext = pv.k_flat, pv.v_flat, pv.page_base, pv.pos_ext
    # The kernels take the queries in token order and scale them, and write token order: the
    # single list's tokens (zeros elsewhere), then the block list's over them in place; no
    # transpose, concatenation or scatter around them.
    single, block = md.work.single, md.work.block
    if qkv is not None and (qkv.shape[:2] != (num_tokens, num_kv_heads) or qkv.shape[2] < group + 2
                            or qkv.shape[3] != head_dim):  # fmt: skip
        raise ValueError(f"ragged_attention_native: qkv {qkv.shape} is not the fused product [T, num_kv_heads, "
                         f"group + 2, head_dim] = [{num_tokens}, {num_kv_heads}, {group + 2}, {head_dim}] of q")  # fmt: skip
    q_tok = (q.reshape(num_tokens, num_kv_heads, group, head_dim) if qkv is None else qkv).astype(jnp.float32)
    if single.q_idx.shape[0]:
        out = kernels.single_groups(q_tok, pos_ext, single.q_idx.reshape(-1), single.row, md.page_table,
                                    k_flat, v_flat, page_base, num_pages, scale, group)  # fmt: skip
    else:
        out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
    if block.q_idx.shape[0]:
        out = kernels.block_groups_into(out, q_tok, pos_ext, block.q_idx, block.row, md.page_table, k_flat,
                                        v_flat, page_base, num_pages, scale)  # fmt: skip
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
