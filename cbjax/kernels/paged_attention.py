"""Decode paged attention: one query per slot against that slot's KV pages.

Layout (one layer of `cbjax.model.paged.KVCache`): k_pages, v_pages are
[num_kv_heads, num_pages, page_size, head_dim], so one kv head's pages are one
contiguous [num_pages, page_size, head_dim] ref and a page is one dynamic index
on its leading dim, which Triton and Mosaic both lower.

Contract: entry j of a slot's page_table row is read only when j * page_size <
length. Pages past the length and the tail of the last page may hold anything,
NaN included: `jnp.where` masks both scores and values. Length 0 gives zeros.

Grid (num_kv_heads, num_slots), kv head outermost so the per-head page block is
not copied again for every slot. Each program runs an online softmax over its
slot's pages, `pages_per_block` pages per loop iteration.

Targets: gpu is Triton (no scalar prefetch, so page_table and lengths are plain
inputs; q rows padded to Triton's 16-row minimum dot; page_size and head_dim
powers of two >= 16). tpu is Mosaic with page_table and lengths prefetched to
SMEM; each kv head's whole page array is one VMEM block, so it suits caches that
fit in VMEM (larger ones need pages DMA'd from HBM). Interpret mode runs either.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

# Finite, so a fully masked row never computes inf - inf.
MASK_VALUE = -1e30
TARGETS = ("gpu", "tpu")
IMPLS = ("auto", "pallas", "ragged", "reference", "triton")
_TRITON_MIN_DOT_ROWS = 16

# (q, k_pages, v_pages, page_table, lengths) -> out, the `paged_attention_reference` positional signature.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _paged_attention_kernel(
    page_table_ref,  # i32[num_slots, num_page_entries], SMEM on tpu
    lengths_ref,  # i32[num_slots], SMEM on tpu
    q_ref,  # [q_rows, head_dim]
    k_pages_ref,  # [num_pages, page_size, head_dim]
    v_pages_ref,  # [num_pages, page_size, head_dim]
    o_ref,  # [q_rows, head_dim]
    *,
    scale: float,
    pages_per_block: int,
):
    slot = pl.program_id(1)
    length = lengths_ref[slot]
    q_rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    q = q_ref[...]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def load_page(page_pos):
        start = page_pos * page_size
        # Entries past the length are never trusted: read the always-valid page 0.
        page_idx = jnp.where(start < length, page_table_ref[slot, page_pos], 0)
        k = k_pages_ref[page_idx]  # [page_size, head_dim]
        v = v_pages_ref[page_idx]  # [page_size, head_dim]
        key_pos = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        value_pos = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        scores = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # f32[q_rows, page_size]
        scores = jnp.where(key_pos < length, scores * scale, MASK_VALUE)
        v = jnp.where(value_pos < length, v, jnp.zeros_like(v))
        return scores, v

    def body(block_idx, carry):
        m, l, acc = carry  # f32[q_rows, 1], f32[q_rows, 1], f32[q_rows, head_dim]
        pages = [load_page(block_idx * pages_per_block + j) for j in range(pages_per_block)]
        m_new = m
        for scores, _ in pages:
            m_new = jnp.maximum(m_new, jnp.max(scores, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        l = alpha * l
        acc = alpha * acc
        for scores, v in pages:
            p = jnp.exp(scores - m_new)  # f32[q_rows, page_size]; masked keys give exactly 0
            l = l + jnp.sum(p, axis=1, keepdims=True)
            acc = acc + lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )
        return m_new, l, acc

    num_blocks = pl.cdiv(length, pages_per_block * page_size)
    init = (
        jnp.full((q_rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((q_rows, 1), jnp.float32),
        jnp.zeros((q_rows, head_dim), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, num_blocks, body, init)
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _paged_attention_call(
    q: jax.Array,  # [num_slots, num_kv_heads, q_rows, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # i32[num_slots, num_page_entries], a multiple of pages_per_block
    lengths: jax.Array,  # i32[num_slots]
    *,
    scale: float,
    pages_per_block: int,
    interpret: bool,
    target: str,
) -> jax.Array:  # [num_slots, num_kv_heads, q_rows, head_dim]
    num_slots, num_kv_heads, q_rows, head_dim = q.shape
    _, num_pages, page_size, _ = k_pages.shape
    kernel = functools.partial(_paged_attention_kernel, scale=scale, pages_per_block=pages_per_block)
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    q_block = (None, None, q_rows, head_dim)
    pages_block = (None, num_pages, page_size, head_dim)
    grid = (num_kv_heads, num_slots)

    if target == "gpu":
        call = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=[
                pl.BlockSpec(page_table.shape, lambda h, s: (0, 0)),
                pl.BlockSpec(lengths.shape, lambda h, s: (0,)),
                pl.BlockSpec(q_block, lambda h, s: (s, h, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, s: (h, 0, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, s: (h, 0, 0, 0)),
            ],
            out_specs=pl.BlockSpec(q_block, lambda h, s: (s, h, 0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
            name="paged_attention",
        )
    else:
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=[
                pl.BlockSpec(q_block, lambda h, s, *_: (s, h, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, s, *_: (h, 0, 0, 0)),
                pl.BlockSpec(pages_block, lambda h, s, *_: (h, 0, 0, 0)),
            ],
            out_specs=pl.BlockSpec(q_block, lambda h, s, *_: (s, h, 0, 0)),
        )
        call = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid_spec=grid_spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=interpret,
            name="paged_attention",
        )
    return call(page_table, lengths, q, k_pages, v_pages)


def _check_shapes(q, k_pages, v_pages, page_table, lengths) -> None:
    shapes = (
        f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, "
        f"page_table {page_table.shape}, lengths {lengths.shape}"
    )

    def fail(why: str) -> None:
        raise ValueError(f"paged_attention: {why}; got {shapes}")

    if q.ndim != 3:
        fail("q must be [num_slots, num_heads, head_dim]")
    if k_pages.ndim != 4:
        fail("k_pages must be [num_kv_heads, num_pages, page_size, head_dim]")
    if k_pages.shape != v_pages.shape:
        fail("k_pages and v_pages must have the same shape")
    if page_table.ndim != 2:
        fail("page_table must be [num_slots, max_pages_per_seq]")
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if k_pages.shape[3] != head_dim:
        fail(f"q head_dim {head_dim} != k_pages head_dim {k_pages.shape[3]}")
    if num_heads % num_kv_heads:
        fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_table.shape[0] != num_slots:
        fail(f"page_table has {page_table.shape[0]} rows, q has {num_slots} slots")
    if lengths.shape != (num_slots,):
        fail(f"lengths must be [num_slots] = ({num_slots},)")
    for name, x in (("page_table", page_table), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            fail(f"{name} must be integer, got dtype {x.dtype}")


def _resolve_target(target: Optional[str]) -> str:
    if target is None:
        # cpu (interpret mode) runs the tpu grid spec: scalar prefetch works there.
        return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"
    if target not in TARGETS:
        raise ValueError(f"paged_attention: unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return target


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret", "target"))
def paged_attention(
    q: jax.Array,  # [num_slots, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # i32[num_slots, max_pages_per_seq]
    lengths: jax.Array,  # i32[num_slots]
    *,
    scale: Optional[float] = None,
    pages_per_block: int = 4,
    interpret: bool = False,
    target: Optional[str] = None,
) -> jax.Array:  # [num_slots, num_heads, head_dim], q.dtype
    """Pallas decode attention over paged K/V; see the module docstring for the contract."""
    _check_shapes(q, k_pages, v_pages, page_table, lengths)
    if pages_per_block < 1:
        raise ValueError(f"paged_attention: pages_per_block must be >= 1, got {pages_per_block}")
    target = _resolve_target(target)
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if target == "gpu" and not interpret and not all(n >= 16 and n & (n - 1) == 0 for n in (page_size, head_dim)):
        raise ValueError(
            f"paged_attention: Triton needs page_size and head_dim to be powers of two >= 16, "
            f"got page_size {page_size}, head_dim {head_dim} (k_pages {k_pages.shape})"
        )
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    max_pages_per_seq = page_table.shape[1]
    pages_per_block = min(pages_per_block, max_pages_per_seq)
    pad_pages = -max_pages_per_seq % pages_per_block
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad_pages)))

    q_rows = group
    if target == "gpu":
        q_rows = max(_TRITON_MIN_DOT_ROWS, pl.next_power_of_2(group))
    q4 = q.reshape(num_slots, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, q_rows - group), (0, 0)))
    out = _paged_attention_call(
        q4, k_pages, v_pages, page_table, lengths.astype(jnp.int32),
        scale=scale, pages_per_block=pages_per_block, interpret=interpret, target=target,
    )
    return out[:, :, :group].reshape(num_slots, num_heads, head_dim)


def paged_attention_reference(
    q: jax.Array,  # [num_slots, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # i32[num_slots, max_pages_per_seq]
    lengths: jax.Array,  # i32[num_slots]
    *,
    scale: Optional[float] = None,
) -> jax.Array:  # [num_slots, num_heads, head_dim], q.dtype
    """Plain jnp: gather every page in the table, mask past the length, softmax in f32."""
    _check_shapes(q, k_pages, v_pages, page_table, lengths)
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    max_pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    max_len = max_pages_per_seq * page_size

    def gather(pages):  # -> [num_slots, num_kv_heads, max_len, head_dim]
        x = jnp.take(pages, page_table, axis=1, mode="clip")  # [kv, slots, max_pages, page_size, d]
        return x.transpose(1, 0, 2, 3, 4).reshape(num_slots, num_kv_heads, max_len, head_dim)

    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # bool[num_slots, max_len]
    k = gather(k_pages).astype(jnp.float32)
    v = jnp.where(valid[:, None, :, None], gather(v_pages).astype(jnp.float32), 0.0)
    q4 = q.reshape(num_slots, num_kv_heads, group, head_dim).astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    scores = jnp.einsum("skgd,sktd->skgt", q4, k, precision=hi) * scale
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, None, :], jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("skgt,sktd->skgd", p, v, precision=hi) / jnp.where(l > 0, l, 1.0)
    return out.reshape(num_slots, num_heads, head_dim).astype(q.dtype)


def paged_attention_ragged(
    q: jax.Array,  # [num_slots, num_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # i32[num_slots, max_pages_per_seq]
    lengths: jax.Array,  # i32[num_slots]
    *,
    num_entries: Optional[int] = None,
    scale: Optional[float] = None,
) -> jax.Array:  # [num_slots, num_heads, head_dim], q.dtype
    """XLA decode attention whose work follows the pages the slots hold, not the table width.

    The slots' pages are flattened into `num_entries` (slot, page) entries, in slot order;
    each entry attends its query to one page (a split of the softmax, as in split-K decode),
    and the per-entry maxima, sums and outputs are merged per slot with segment reductions.
    Work is num_entries x page_size keys instead of num_slots x max_pages_per_seq x page_size.

    Contract: num_entries >= sum(ceil(lengths / page_size)); the caller (the executor) picks
    it from a few compiled sizes. Pages past that sum are never read. None means the table
    size, always enough. Same masking contract as the Pallas kernel: NaN anywhere past a
    length is never used, and length 0 gives zeros.
    """
    _check_shapes(q, k_pages, v_pages, page_table, lengths)
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    num_entries = num_slots * max_pages_per_seq if num_entries is None else num_entries
    if num_entries < 1:
        raise ValueError(f"paged_attention_ragged: num_entries must be >= 1, got {num_entries}")

    lengths = lengths.astype(jnp.int32)
    pages_held = jnp.minimum(-(-lengths // page_size), max_pages_per_seq)  # i32[num_slots]
    ends = jnp.cumsum(pages_held)  # entry e belongs to the slot whose [end - held, end) holds e
    entry = jnp.arange(num_entries, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, entry, side="right", method="compare_all").astype(jnp.int32)
    used = slot < num_slots  # bool[num_entries]: entries past the last slot's pages are padding
    slot = jnp.minimum(slot, num_slots - 1)
    page_pos = jnp.where(used, entry - (ends - pages_held)[slot], 0)
    page_idx = jnp.where(used, page_table[slot, page_pos], 0)  # padding reads the null page

    k = jnp.take(k_pages, page_idx, axis=1, mode="clip").astype(jnp.float32)  # [kv, entries, page_size, d]
    v = jnp.take(v_pages, page_idx, axis=1, mode="clip").astype(jnp.float32)
    key_pos = page_pos[:, None] * page_size + jnp.arange(page_size)[None, :]  # i32[entries, page_size]
    valid = used[:, None] & (key_pos < lengths[slot][:, None])  # bool[entries, page_size]
    v = jnp.where(valid[None, :, :, None], v, 0.0)
    qe = q.reshape(num_slots, num_kv_heads, group, head_dim).astype(jnp.float32)[slot]  # [entries, kv, g, d]
    # Broadcast-multiply-reduce, not einsum: the contractions are tiny ([group, head_dim] x
    # [head_dim, page_size] per entry), which XLA:CPU runs far faster as fused loops than as
    # thousands of batched dots.
    k = k.transpose(1, 0, 2, 3)  # [entries, kv, page_size, d]
    v = v.transpose(1, 0, 2, 3)
    scores = jnp.sum(qe[:, :, :, None, :] * k[:, :, None, :, :], axis=-1) * scale  # f32[entries, kv, g, page_size]
    scores = jnp.where(valid[:, None, None, :], scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)  # f32[entries, kv, g]
    p = jnp.where(valid[:, None, None, :], jnp.exp(scores - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)  # f32[entries, kv, g]
    o = jnp.sum(p[..., None] * v[:, :, None, :, :], axis=-2)  # f32[entries, kv, g, d]

    # Merge the entries of each slot. Padding entries carry l = 0 and MASK_VALUE maxima, so
    # they add nothing; a slot with no entries keeps l = 0 and gives zeros.
    m_slot = jax.ops.segment_max(m, slot, num_segments=num_slots, indices_are_sorted=True)
    w = jnp.exp(m - m_slot[slot])  # f32[entries, kv, g]
    l_slot = jax.ops.segment_sum(w * l, slot, num_segments=num_slots, indices_are_sorted=True)
    o_slot = jax.ops.segment_sum(w[..., None] * o, slot, num_segments=num_slots, indices_are_sorted=True)
    out = o_slot / jnp.where(l_slot > 0, l_slot, 1.0)[..., None]
    return out.reshape(num_slots, num_heads, head_dim).astype(q.dtype)


def resolve_attention(impl: str = "auto") -> str:
    """The implementation `impl` runs as here: auto is pallas on gpu/tpu and ragged on cpu."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl: unknown value {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "triton" and jax.default_backend() != "gpu":
        raise ValueError(
            "executor.attention=triton needs a GPU and the `gpu` extra (jax-triton); "
            "use auto, pallas, ragged or reference here"
        )
    if impl == "auto":
        return "ragged" if jax.default_backend() == "cpu" else "pallas"
    return impl


def attention_op(impl: str = "auto", *, pages_per_block: int = 4, num_entries: Optional[int] = None) -> AttentionFn:
    """Pick a paged attention implementation: auto | pallas | ragged | reference | triton.

    auto: compiled Pallas on gpu/tpu, the page-sparse XLA `ragged` on cpu (Pallas runs only
    interpreted there). pallas: compiled on gpu/tpu, interpret mode on cpu (slow; for tests).
    reference: the plain-jnp oracle, rows x table width of work. `num_entries` sizes ragged's
    work (see `paged_attention_ragged`); the others ignore it. The returned function has the
    `paged_attention_reference` positional signature.
    """
    impl = resolve_attention(impl)
    if impl == "triton":
        from cbjax.kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton
    if impl == "reference":
        return paged_attention_reference
    if impl == "ragged":
        return functools.partial(paged_attention_ragged, num_entries=num_entries)
    return functools.partial(paged_attention, interpret=jax.default_backend() == "cpu", pages_per_block=pages_per_block)
