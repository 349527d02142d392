"""The ragged-batch attention contract shared by every backend (reference, XLA, Pallas).

One model step processes a flat buffer of T new tokens from up to `num_rows` sequences (the
fixed slot array: rows are filled in plan order, decodes first, and idle rows hold no token).
Row r's new tokens are the flat tokens [query_start[r], query_start[r + 1]); they are the last
n_r = query_start[r + 1] - query_start[r] tokens of a sequence of kv_lens[r] tokens, so they
sit at positions [kv_lens[r] - n_r, kv_lens[r]). Before attention runs, the step has written
every new token's K/V into the row's pages: position p lives in page page_table[r, p // page_size]
at offset p % page_size.

A new token at position p attends to its own sequence's keys at positions [0, p] (causal
over the new tokens, full over the earlier context), read from the pages. Flat tokens past
query_start[num_rows] are padding: their output is zeros. Page-table entries at or past
ceil(kv_lens[r] / page_size) and page slots past the length may hold anything, NaN included:
they are never trusted. Attention functions have the signature

    attn(q, k_pages, v_pages, md) -> out
    q:       [T, num_heads, head_dim]
    k_pages: [num_kv_heads, num_pages, page_size, head_dim]   (one layer)
    v_pages: [num_kv_heads, num_pages, page_size, head_dim]
    out:     [T, num_heads, head_dim], q.dtype

with query head h reading kv head h // (num_heads // num_kv_heads). Every backend also takes
`layer=` (an i32 scalar, traced): then k_pages and v_pages are the whole cache, [num_layers,
num_kv_heads, num_pages, page_size, head_dim], and the backend reads that layer's pages from it
in place (the step passes it so; a step that scans over layers never copies a layer's page pool
out). And every backend takes `qkv=`: the fused q/k/v product [T, num_kv_heads, group + 2,
head_dim] whose first `group` entries on axis 2 are q's heads (kv head j's query heads j * group
... j * group + group - 1), where q was sliced from one; a backend may read its queries there in
place instead of from q, or ignore it. Registered by name in `cbjax.kernels.registry`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["page_table", "query_start", "kv_lens", "token_row", "token_pos", "work"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each flat token belongs. `token_row`/`token_pos` repeat what query_start and kv_lens
    say, per token, so backends that work per token need no search; the packer fills both."""

    page_table: jax.Array  # i32[num_rows, max_pages_per_seq]
    query_start: jax.Array  # i32[num_rows + 1], nondecreasing; query_start[0] == 0
    kv_lens: jax.Array  # i32[num_rows]; idle rows: 0
    token_row: jax.Array  # i32[T]: the row of each flat token (padding tokens: 0)
    token_pos: jax.Array  # i32[T]: the position of each flat token (padding tokens: -1)
    # Backend-specific precomputed work lists (the XLA `ragged` backend's tiles); None otherwise.
    work: Optional[Any] = None


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttentionMetadata], jax.Array]


def layer_view(k_pages: jax.Array, v_pages: jax.Array, layer) -> tuple:
    """The one-layer shapes `check_shapes` checks: the pages themselves, or with `layer` the
    shape of one layer of the whole cache."""
    if layer is None:
        return k_pages, v_pages
    if k_pages.ndim != 5 or v_pages.ndim != 5:
        raise ValueError(
            f"with layer=, k_pages and v_pages must be the whole cache [num_layers, num_kv_heads, num_pages, "
            f"page_size, head_dim]; got {k_pages.shape}, {v_pages.shape}"
        )
    return (jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype))


def check_shapes(where: str, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata) -> None:
    """Raise a ValueError naming every shape when q, the pages and the metadata disagree."""
    shapes = (
        f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, page_table {md.page_table.shape}, "
        f"query_start {md.query_start.shape}, kv_lens {md.kv_lens.shape}, token_row {md.token_row.shape}, "
        f"token_pos {md.token_pos.shape}"
    )

    def fail(why: str) -> None:
        raise ValueError(f"{where}: {why}; got {shapes}")

    if q.ndim != 3:
        fail("q must be [num_tokens, num_heads, head_dim]")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        fail("k_pages and v_pages must both be [num_kv_heads, num_pages, page_size, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    if k_pages.shape[3] != head_dim:
        fail(f"q head_dim {head_dim} != k_pages head_dim {k_pages.shape[3]}")
    if num_heads % k_pages.shape[0]:
        fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {k_pages.shape[0]}")
    if md.page_table.ndim != 2:
        fail("page_table must be [num_rows, max_pages_per_seq]")
    num_rows = md.page_table.shape[0]
    if md.kv_lens.shape != (num_rows,) or md.query_start.shape != (num_rows + 1,):
        fail(f"kv_lens must be [num_rows={num_rows}] and query_start [num_rows + 1]")
    if md.token_row.shape != (num_tokens,) or md.token_pos.shape != (num_tokens,):
        fail(f"token_row and token_pos must be [num_tokens={num_tokens}]")
    for name in ("page_table", "query_start", "kv_lens", "token_row", "token_pos"):
        if not jnp.issubdtype(getattr(md, name).dtype, jnp.integer):
            fail(f"{name} must be integer, got dtype {getattr(md, name).dtype}")
