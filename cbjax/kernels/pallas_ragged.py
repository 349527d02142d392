"""Pallas ragged paged attention for mixed batches (decodes, prefills, chunks) in one call.

Implements the contract in `cbjax.kernels.metadata`. The flat tokens are cut into work
items, one per (row, query block): a row with n new tokens has ceil(n / block_q) blocks of
block_q consecutive tokens. At most min(num_rows, T) + T // block_q items exist, so the
grid is (num_kv_heads, that bound); items past the real count have no tokens and write zeros.
The item -> (row, query block) map is computed in the jitted wrapper from query_start.

The wrapper gathers each item's queries into one tile of block_q tokens x the GQA group
([group, block_q] rows, group-major so a row's token is `row & (block_q - 1)`, no integer
division in the kernel), and gathers the tiles back to flat tokens afterwards. Each program
runs an online softmax over the pages its last token needs, `pages_per_block` pages a step,
masking keys past each token's own position (causal among the new tokens, full over the
earlier context). Pages past the item's last position are never read, and page-table
entries past it are replaced by the always-valid page 0, so NaN and junk entries are safe.

Targets: gpu lowers through Triton (metadata as plain inputs; tile rows padded to Triton's
16-row minimum dot; page_size and head_dim powers of two >= 16). tpu is Mosaic with the
metadata prefetched to SMEM and the pages left in HBM (`pl.ANY`): each step's pages are
copied to a VMEM double buffer by async DMA, the next step's copies started before the
current step's math. CPU runs either target in interpret mode (tests).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from cbjax.kernels.metadata import AttentionMetadata, check_shapes, layer_view

# Finite, so a fully masked row never computes inf - inf.
MASK_VALUE = -1e30
TARGETS = ("gpu", "tpu")
_TRITON_MIN_DOT_ROWS = 16
_NAME = "ragged_paged_attention"


class _Static(NamedTuple):
    """The kernels' compile-time parameters, bound by `_ragged_call`."""

    block_q: int  # tokens per work item
    table_width: int  # page-table entries per row, padded to whole steps
    scale: float
    pages_per_block: int  # pages per step of the online softmax
    num_kv_heads: int
    num_pages: int  # pages per layer and kv head


def _item_span(item_row_ref, item_qblock_ref, kv_lens_ref, query_start_ref, *, block_q: int):
    """The program's row, the position of its first token, its real token count, its last position."""
    item = pl.program_id(1)
    row = item_row_ref[item]
    first = item_qblock_ref[item] * block_q  # the item's first token among the row's new tokens
    num_new = query_start_ref[row + 1] - query_start_ref[row]
    num_valid = jnp.minimum(jnp.maximum(num_new - first, 0), block_q)
    first_pos = kv_lens_ref[row] - num_new + first
    return row, first_pos, num_valid, first_pos + num_valid - 1


def _attend(q, first_pos, num_valid, last_pos, num_steps, load_step, o_ref, static: _Static, page_size: int):
    """Online softmax of the tile `q` over `num_steps` steps of `static.pages_per_block` pages each.

    `load_step(step)` returns the step's pages as [(k, v)], each [page_size, head_dim].
    """
    block_q, scale, pages_per_block = static.block_q, static.scale, static.pages_per_block
    rows, head_dim = q.shape
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    token = jnp.bitwise_and(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), block_q - 1)
    row_pos = first_pos + token  # i32[rows, 1]: each query row's position
    row_ok = token < num_valid  # bool[rows, 1]: padding tokens of the item attend to nothing

    def body(step, carry):
        m, l, acc = carry  # f32[rows, 1], f32[rows, 1], f32[rows, head_dim]
        scored = []
        m_new = m
        for j, (k, v) in enumerate(load_step(step)):
            start = (step * pages_per_block + j) * page_size
            key_pos = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            value_pos = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
            mask = (key_pos <= row_pos) & row_ok  # bool[rows, page_size]
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            s = jnp.where(mask, s * scale, MASK_VALUE)
            # Slots past the item's last position may be NaN: 0 * NaN would poison acc.
            v = jnp.where(value_pos <= last_pos, v, jnp.zeros_like(v))
            m_new = jnp.maximum(m_new, jnp.max(s, axis=1, keepdims=True))
            scored.append((mask, s, v))
        alpha = jnp.exp(m - m_new)
        l = alpha * l
        acc = alpha * acc
        for mask, s, v in scored:
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # f32[rows, page_size]
            l = l + jnp.sum(p, axis=1, keepdims=True)
            acc = acc + lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )  # fmt: skip
        return m_new, l, acc

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, num_steps, body, init)
    o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _num_steps(num_valid, last_pos, span: int):
    """Steps of `span` keys covering positions [0, last_pos]; none for an item with no tokens."""
    # lax.div, not //: floor division lowers through sign(), which Mosaic needs a TPU to lower.
    return jnp.where(num_valid > 0, lax.div(last_pos + span, span), 0)


def _gpu_kernel(
    item_row_ref,  # i32[num_items]
    item_qblock_ref,  # i32[num_items]
    page_table_ref,  # i32[num_rows * table_width], flattened
    kv_lens_ref,  # i32[num_rows]
    query_start_ref,  # i32[num_rows + 1]
    layer_ref,  # i32[1]
    q_ref,  # [rows, head_dim]
    k_pages_ref,  # [num_layers * num_kv_heads * num_pages, page_size, head_dim]: the whole cache, flat
    v_pages_ref,  # [num_layers * num_kv_heads * num_pages, page_size, head_dim]
    o_ref,  # [rows, head_dim]
    *,
    static: _Static,
):
    row, first_pos, num_valid, last_pos = _item_span(
        item_row_ref, item_qblock_ref, kv_lens_ref, query_start_ref, block_q=static.block_q
    )
    page_size = k_pages_ref.shape[1]
    pages_per_block, table_width = static.pages_per_block, static.table_width
    base = (layer_ref[0] * static.num_kv_heads + pl.program_id(0)) * static.num_pages  # this layer's and kv head's page 0

    def load_step(step):
        pages = []
        for j in range(pages_per_block):
            page_pos = step * pages_per_block + j
            # Entries past the last position are never trusted: read the always-valid page 0.
            page_idx = jnp.where(page_pos * page_size <= last_pos, page_table_ref[row * table_width + page_pos], 0)
            pages.append((k_pages_ref[base + page_idx], v_pages_ref[base + page_idx]))
        return pages

    num_steps = _num_steps(num_valid, last_pos, pages_per_block * page_size)
    _attend(q_ref[...], first_pos, num_valid, last_pos, num_steps, load_step, o_ref, static, page_size)


def _tpu_kernel(
    item_row_ref,  # i32[num_items], SMEM
    item_qblock_ref,  # i32[num_items], SMEM
    page_table_ref,  # i32[num_rows * table_width], SMEM, flattened (2-D SMEM pads to tiles)
    kv_lens_ref,  # i32[num_rows], SMEM
    query_start_ref,  # i32[num_rows + 1], SMEM
    layer_ref,  # i32[1], SMEM
    q_ref,  # [rows, head_dim], VMEM
    k_hbm_ref,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim], HBM: the whole cache
    v_hbm_ref,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim], HBM
    o_ref,  # [rows, head_dim], VMEM
    k_buf,  # [2, pages_per_block, page_size, head_dim], VMEM double buffer
    v_buf,  # [2, pages_per_block, page_size, head_dim], VMEM double buffer
    sems,  # DMA semaphores [2]: one per buffer half
    *,
    static: _Static,
):
    kv_head = pl.program_id(0)
    layer = layer_ref[0]
    row, first_pos, num_valid, last_pos = _item_span(
        item_row_ref, item_qblock_ref, kv_lens_ref, query_start_ref, block_q=static.block_q
    )
    page_size = k_buf.shape[2]
    pages_per_block, table_width = static.pages_per_block, static.table_width

    def copies(step, half, page_of):
        out = []
        for j in range(pages_per_block):
            page_idx = page_of(step * pages_per_block + j)
            for src, dst in ((k_hbm_ref, k_buf), (v_hbm_ref, v_buf)):
                out.append(pltpu.make_async_copy(src.at[layer, kv_head, page_idx], dst.at[half, j], sems.at[half]))
        return out

    def page_of(page_pos):
        # Entries past the last position are never trusted: copy the always-valid page 0.
        return jnp.where(page_pos * page_size <= last_pos, page_table_ref[row * table_width + page_pos], 0)

    def start(step):
        for c in copies(step, lax.rem(step, 2), page_of):
            c.start()

    num_steps = _num_steps(num_valid, last_pos, pages_per_block * page_size)

    @pl.when(num_steps > 0)
    def _():
        start(0)

    def load_step(step):
        half = lax.rem(step, 2)

        @pl.when(step + 1 < num_steps)
        def _():
            start(step + 1)

        # A wait needs only the destination and semaphore: any source page of the right shape will do.
        for c in copies(step, half, lambda _: 0):
            c.wait()
        return [(k_buf[half, j], v_buf[half, j]) for j in range(pages_per_block)]

    _attend(q_ref[...], first_pos, num_valid, last_pos, num_steps, load_step, o_ref, static, page_size)


def _ragged_call(
    q_items: jax.Array,  # [num_kv_heads, num_items, rows, head_dim]
    k_pages: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]: read in place
    v_pages: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    scalars: tuple,  # item_row, item_qblock, page_table (flat), kv_lens, query_start, layer i32[1]: all i32
    *,
    block_q: int,
    table_width: int,
    scale: float,
    pages_per_block: int,
    interpret: bool,
    target: str,
) -> jax.Array:  # [num_kv_heads, num_items, rows, head_dim]
    num_kv_heads, num_items, rows, head_dim = q_items.shape
    num_layers, _, num_pages, page_size, _ = k_pages.shape
    static = _Static(block_q=block_q, table_width=table_width, scale=scale, pages_per_block=pages_per_block,
                     num_kv_heads=num_kv_heads, num_pages=num_pages)  # fmt: skip
    out_shape = jax.ShapeDtypeStruct(q_items.shape, q_items.dtype)
    tile = (None, None, rows, head_dim)
    grid = (num_kv_heads, num_items)

    if target == "gpu":
        # The whole cache as one flat block (a reshape, no copy): the kernel indexes its layer's pages.
        k_pages = k_pages.reshape(-1, page_size, head_dim)
        v_pages = v_pages.reshape(-1, page_size, head_dim)
        pages_block = k_pages.shape
        call = pl.pallas_call(
            functools.partial(_gpu_kernel, static=static),
            out_shape=out_shape,
            grid=grid,
            in_specs=[pl.BlockSpec(x.shape, lambda h, w: (0,)) for x in scalars]
            + [
                pl.BlockSpec(tile, lambda h, w: (h, w, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, w: (0, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, w: (0, 0, 0)),
            ],
            out_specs=pl.BlockSpec(tile, lambda h, w: (h, w, 0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
            name=_NAME,
        )
    else:
        buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=grid,
            in_specs=[
                pl.BlockSpec(tile, lambda h, w, *_: (h, w, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(tile, lambda h, w, *_: (h, w, 0, 0)),
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2,))],
        )
        call = pl.pallas_call(
            functools.partial(_tpu_kernel, static=static),
            out_shape=out_shape,
            grid_spec=grid_spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=interpret,
            name=_NAME,
        )
    return call(*scalars, q_items, k_pages, v_pages)


def _resolve_target(target: Optional[str]) -> str:
    if target is None:
        # cpu (interpret mode) runs the tpu grid spec: scalar prefetch and DMAs work there.
        return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"
    if target not in TARGETS:
        raise ValueError(f"{_NAME}: unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return target


def _work_items(query_start: jax.Array, num_items: int, block_q: int):
    """Map each work item to (row, query block); items past the real count get a block past their row's end."""
    num_new = query_start[1:] - query_start[:-1]  # i32[num_rows]
    blocks_end = jnp.cumsum((num_new + block_q - 1) // block_q)  # i32[num_rows]: inclusive
    item = jnp.arange(num_items, dtype=jnp.int32)
    item_row = jnp.minimum(jnp.searchsorted(blocks_end, item, side="right"), num_new.shape[0] - 1).astype(jnp.int32)
    blocks_start = blocks_end - (num_new + block_q - 1) // block_q
    return item_row, item - blocks_start[item_row], blocks_start


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "interpret", "target"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], or with `layer` the whole cache
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]   [num_layers, num_kv_heads, ...]
    md: AttentionMetadata,
    *,
    layer: Optional[jax.Array] = None,
    qkv: Optional[jax.Array] = None,  # the contract's fused product: q is read from q here
    scale: Optional[float] = None,
    block_q: int = 8,
    pages_per_block: int = 4,
    interpret: bool = False,
    target: Optional[str] = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """Pallas ragged paged attention; see the module docstring and `cbjax.kernels.metadata`.
    With `layer` (i32[], traced), k_pages and v_pages are the whole cache and the kernel reads
    that layer's pages in place (the layer index is a scalar input): no per-layer copy."""
    check_shapes(_NAME, q, *layer_view(k_pages, v_pages, layer), md)
    if layer is None:  # one layer's pages: a cache of one layer (a reshape, no copy)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"{_NAME}: block_q must be a power of two >= 1, got {block_q}")
    if pages_per_block < 1:
        raise ValueError(f"{_NAME}: pages_per_block must be >= 1, got {pages_per_block}")
    target = _resolve_target(target)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    if target == "gpu" and not interpret and not all(n >= 16 and n & (n - 1) == 0 for n in (page_size, head_dim)):
        raise ValueError(
            f"{_NAME}: Triton needs page_size and head_dim to be powers of two >= 16, "
            f"got page_size {page_size}, head_dim {head_dim} (k_pages {k_pages.shape})"
        )
    num_rows, max_pages = md.page_table.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # Triton tiles need power-of-two sides and at least 16 rows per dot; pad the group to fit.
    group_rows = group
    if target == "gpu":
        group_rows = max(pl.next_power_of_2(group), -(-_TRITON_MIN_DOT_ROWS // block_q))

    pages_per_block = min(pages_per_block, max_pages)
    table_width = max_pages + (-max_pages % pages_per_block)
    page_table = jnp.pad(md.page_table.astype(jnp.int32), ((0, 0), (0, table_width - max_pages))).reshape(-1)
    query_start = md.query_start.astype(jnp.int32)
    num_items = min(num_rows, num_tokens) + num_tokens // block_q
    item_row, item_qblock, blocks_start = _work_items(query_start, num_items, block_q)

    # Gather each item's tokens into a [group_rows, block_q] tile; slots past the row's tokens are zero.
    local = item_qblock[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)  # i32[num_items, block_q]
    slot_ok = local < (query_start[item_row + 1] - query_start[item_row])[:, None]
    token = jnp.clip(query_start[item_row][:, None] + local, 0, num_tokens - 1)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))
    q_items = jnp.where(slot_ok[:, :, None, None, None], q4[token], 0).astype(q.dtype)  # [items, bq, kv, g, d]
    q_items = q_items.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_items, group_rows * block_q, head_dim)

    layer_idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    scalars = (item_row, item_qblock, page_table, md.kv_lens.astype(jnp.int32), query_start, layer_idx)
    out = _ragged_call(
        q_items, k_pages, v_pages, scalars, block_q=block_q, table_width=table_width, scale=scale,
        pages_per_block=pages_per_block, interpret=interpret, target=target,
    )  # fmt: skip

    # Back to flat tokens: token t of row r sits in item blocks_start[r] + local // block_q.
    row = md.token_row.astype(jnp.int32)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - query_start[row]
    out = out.reshape(num_kv_heads, num_items, group_rows, block_q, head_dim)
    real = jnp.arange(num_tokens) < query_start[num_rows]
    local = jnp.where(real, local, 0)  # padding tokens read item 0, then get zeros
    out = out[:, blocks_start[row] + local // block_q, :, local % block_q]  # [T, kv, group_rows, d]
    out = jnp.where(real[:, None, None, None], out[:, :, :group], 0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
