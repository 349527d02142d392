"""Paged-attention decode as a Triton kernel, called from JAX through jax-triton (GPU only).

JAX 0.11 deprecated the Pallas Triton backend, so on NVIDIA GPUs this is the direct Triton
lowering offered beside Pallas (`executor.attention=triton`). Layouts match
`cbjax.kernels.paged_attention`. The kernel body also runs under Triton's CPU interpreter
(TRITON_INTERPRET=1) on torch tensors, which is how it is tested without a GPU.
"""

from __future__ import annotations

import math
from typing import Optional

import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_slots, num_heads, head_dim]
    k_ptr,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_ptr,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table_ptr,  # i32[num_slots, max_pages_per_seq]
    lengths_ptr,  # i32[num_slots]
    out_ptr,  # [num_slots, num_heads, head_dim]
    SCALE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two (tl.arange needs one)
):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lengths_ptr + slot)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, PAGE_SIZE)
    g_ok = g < GROUP
    q_off = (slot * NUM_HEADS + kv_head * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0.0).to(tl.float32)  # [GROUP_P2, HEAD_DIM]
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)  # running max
    l = tl.zeros([GROUP_P2], tl.float32)  # running denominator
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(length, PAGE_SIZE)):
        page = tl.load(page_table_ptr + slot * MAX_PAGES + i)
        valid = i * PAGE_SIZE + t < length  # bool[PAGE_SIZE]: the partial last page
        kv_off = ((kv_head * NUM_PAGES + page) * PAGE_SIZE + t)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)  # [PAGE_SIZE, HEAD_DIM]
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * SCALE  # [GROUP_P2, PAGE_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # length 0: acc is 0, so zeros
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def kernel_params(q_shape, k_shape, page_table_shape, scale: Optional[float]) -> dict:
    """The kernel's constexprs for these shapes; ValueError where Triton cannot tile them."""
    num_slots, num_heads, head_dim = q_shape
    num_kv_heads, num_pages, page_size, _ = k_shape
    for name, value in (("head_dim", head_dim), ("page_size", page_size)):
        if value & (value - 1):
            raise ValueError(f"triton paged attention: {name} must be a power of two, got {value}")
    group = num_heads // num_kv_heads
    return dict(
        SCALE=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        NUM_HEADS=num_heads,
        NUM_PAGES=num_pages,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        MAX_PAGES=page_table_shape[1],
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
    )


def paged_attention_triton(q, k_pages, v_pages, page_table, lengths, *, scale: Optional[float] = None):
    """JAX entry point (GPU): same signature and layouts as `paged_attention_reference`."""
    import jax
    import jax_triton

    from cbjax.kernels.paged_attention import _check_shapes

    _check_shapes(q, k_pages, v_pages, page_table, lengths)
    params = kernel_params(q.shape, k_pages.shape, page_table.shape, scale)
    return jax_triton.triton_call(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        kernel=_paged_attention_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(q.shape[0], k_pages.shape[0]),
        **params,
    )
