"""The native CPU kernels' jax wrappers (XLA FFI custom calls into the build of `build`).

Contract: every wrapper takes and returns float32 jax arrays (int32 indices), is traceable
under `jax.jit`, raises a ValueError naming the shapes it cannot take, and returns what its
docstring's plain-jnp expression returns, up to f32 rounding where it says so. A kernel that
skips rows (`live`) writes zeros there. Weight matrices are read in panel order (`to_panels`).
Why each kernel exists and what it was measured to buy: docs/cpu_kernels.md.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.kernels.native import build

def single_groups(
    q, pos_ext, q_idx, row, page_table, k_flat, v_flat, page_base, num_pages: int, scale: float, group: int | None = None
) -> jax.Array:
    """f32[T, kv_heads, group, head_dim]: each single group's attention output at its token's
    row, zeros for tokens in no group, as `cbjax.kernels.xla_ragged._group_pass` computes it
    for block 1. q f32[T, kv_heads, group, head_dim] is the layer's [T, heads, head_dim] queries
    as they are (the kernel multiplies them by `scale`), or, with `group` given, any
    [T, kv_heads, group or more, head_dim] whose first `group` entries on axis 2 are the queries
    (the fused q/k/v product, read in place); pos_ext i32[T + 1] (-1 at T, padding's token);
    q_idx i32[capacity], T for a padding group."""
    build.require("executor.attention")
    group = q.shape[2] if group is None else group
    if not 1 <= group <= q.shape[2]:
        raise ValueError(f"single_groups: group {group} must be in [1, {q.shape[2]}] (q's axis 2, shape {q.shape})")
    out = jax.ShapeDtypeStruct((*q.shape[:2], group, q.shape[3]), jnp.float32)
    return jax.ffi.ffi_call("cbjax_single_groups", out)(
        q, pos_ext, q_idx, row, page_table.astype(jnp.int32), k_flat, v_flat, page_base,
        num_pages=np.int64(num_pages), scale=np.float32(scale),
    )  # fmt: skip


def block_groups_into(
    base, q, pos_ext, q_idx, row, page_table, k_flat, v_flat, page_base, num_pages: int, scale: float
) -> jax.Array:
    """`base` f32[T, kv_heads, group, head_dim] with each block group's real tokens' attention
    output written at their rows (in place: the output is `base`'s buffer), every other row as
    in `base`: `single_groups` then this give a mixed step's attention in token order, with no
    concatenation, scatter or transpose after; as `cbjax.kernels.xla_ragged._group_pass`
    computes the block list. q_idx i32[capacity, block]; q may hold more than base's group on
    its axis 2 (the fused q/k/v product); the rest as `single_groups`."""
    build.require("executor.attention")
    if base.ndim != 4 or base.shape[:2] != q.shape[:2] or base.shape[3] != q.shape[3] or base.shape[2] > q.shape[2]:
        raise ValueError(
            f"block_groups_into: base has shape {base.shape}, not q's [tokens, kv_heads, group, head_dim] = {q.shape} "
            f"(or a group of fewer query heads)"
        )
    out = jax.ShapeDtypeStruct(base.shape, jnp.float32)
    return jax.ffi.ffi_call("cbjax_block_groups_into", out, input_output_aliases={8: 0})(
        q, pos_ext, q_idx, row, page_table.astype(jnp.int32), k_flat, v_flat, page_base, base.astype(jnp.float32),
        num_pages=np.int64(num_pages), scale=np.float32(scale),
    )  # fmt: skip


def write_kv(qkv: jax.Array, write_idx: jax.Array, layer, k_pages: jax.Array, v_pages: jax.Array):
    """(k_pages, v_pages) with layer `layer`'s slots write_idx[t] set to token t's k and v rows
    of the fused product qkv f32[T, kv_heads, group + 2, head_dim] (each kv head's query heads,
    then its k, then its v), in place (the caches are aliased to the outputs): as
    `cbjax.model.ops.write_layer` on the sliced k and v, in one call with no copies.
    k_pages, v_pages f32[num_layers, num_kv_heads, num_pages, page_size, head_dim]."""
    build.require("executor.attention")
    if (qkv.ndim != 4 or qkv.shape[2] < 3 or k_pages.ndim != 5 or k_pages.shape != v_pages.shape
            or k_pages.shape[1] != qkv.shape[1] or k_pages.shape[4] != qkv.shape[3] or write_idx.shape != qkv.shape[:1]
            or k_pages.dtype != jnp.float32 or v_pages.dtype != jnp.float32):  # fmt: skip
        raise ValueError(f"write_kv: qkv must be [T, kv_heads, group + 2, head_dim] and write_idx [T], k_pages and "
                         f"v_pages float32 [layers, kv_heads, pages, page_size, head_dim] alike; got qkv "
                         f"{list(qkv.shape)}, write_idx {list(write_idx.shape)}, k_pages {k_pages.dtype}"
                         f"{list(k_pages.shape)}, v_pages {v_pages.dtype}{list(v_pages.shape)}")  # fmt: skip
    outs = (jax.ShapeDtypeStruct(k_pages.shape, jnp.float32), jax.ShapeDtypeStruct(v_pages.shape, jnp.float32))
    return jax.ffi.ffi_call("cbjax_write_kv", outs, input_output_aliases={3: 0, 4: 1})(
        qkv.astype(jnp.float32), write_idx.astype(jnp.int32), jnp.asarray(layer, jnp.int32), k_pages, v_pages
    )


# Columns in one panel of `to_panels`; a matrix whose n it does not divide stays row-major.
PANEL = 64


def panel_width(n: int) -> int:
    """The panel width of a matrix with n output columns: PANEL, or n (one panel: row-major)."""
    return PANEL if n % PANEL == 0 else n


def _panel_dims(shape: tuple[int, ...], num_in: int, lead: int) -> tuple[int, int, int]:
    """(k, n, P) of the [k, n] matrices in an array of `shape`: `lead` leading axes, then
    `num_in` contracted axes, then the output axes; P = `panel_width(n)`."""
    k = int(np.prod(shape[lead : lead + num_in]))
    n = int(np.prod(shape[lead + num_in :]))
    return k, n, panel_width(n)


def to_panels(w, num_in: int = 1, lead: int = 1) -> np.ndarray:
    """w [*lead, *in, *out] (`lead` leading axes, `num_in` contracted axes) with each [k, n]
    matrix rearranged in panel order, as `layer_matmul` reads it: the same shape, the columns
    [p * P, (p + 1) * P) of every k row stored together as panel p (P = `panel_width(n)`). On
    the host (numpy): no program compiles for it."""
    w = np.asarray(w)
    k, n, p = _panel_dims(w.shape, num_in, lead)
    m = w.reshape(*w.shape[:lead], k, n // p, p)
    return np.ascontiguousarray(np.moveaxis(m, -2, -3)).reshape(w.shape)


# A norm applied to x before a matmul: (factor, scale), x's rows becoming scale * (x * factor) (an
# RMS norm's: factor f32[..., 1] the rsqrt of each row's mean square plus eps, scale f32[k]).
Norm = tuple[jax.Array, jax.Array]


def layer_matmul(
    x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, num_in: int = 1, live: jax.Array | int | None = None,
    norm: Optional[Norm] = None, residual: Optional[jax.Array] = None,
) -> jax.Array:  # fmt: skip
    """x [..., *in] @ w[layer] -> f32[..., *out], w [layers, *in, *out] f32 in panel order
    (`to_panels`, `num_in` axes contracted), read in place; layer is clipped to [0, layers).
    As `jnp.tensordot(x, W[layer], num_in)` up to f32 rounding, W the row-major weights; each
    output sums over the contraction in order, so a row's result does not depend on the other
    rows. `live` (a traced count is fine): only the first `live` rows of x (flattened) are
    multiplied, the others give zeros (a step's padding tokens); None: all. `norm` (one-axis x):
    x's rows normed first, as `scale * (x * factor)` in f32; `residual` [..., *out]: added to the
    product as it is stored (`residual + x @ W`, one f32 add): no XLA op before or after."""
    build.require("executor.matmul")
    in_shape, out_shape = w.shape[1 : 1 + num_in], w.shape[1 + num_in :]
    k, n, p = _panel_dims(w.shape, num_in, 1)
    if x.shape[x.ndim - num_in :] != in_shape or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"layer_matmul: x {x.dtype}{list(x.shape)} does not contract with w {w.dtype}{list(w.shape)} "
                         f"over {num_in} axes (both float32)")  # fmt: skip
    lead = x.shape[: x.ndim - num_in]
    rows = int(np.prod(lead))
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    if residual is not None and residual.shape != (*lead, *out_shape):
        raise ValueError(f"layer_matmul: residual {list(residual.shape)} is not the product's {[*lead, *out_shape]}")
    res = jnp.zeros((0,), jnp.float32) if residual is None else residual.astype(jnp.float32).reshape(rows, n)
    y = jax.ffi.ffi_call("cbjax_layer_matmul", out)(
        x.reshape(rows, k), w.reshape(w.shape[0], n // p, k, p), jnp.asarray(layer, jnp.int32), _live(live, rows),
        *_norm_args(norm, rows, k, num_in), res,
    )  # fmt: skip
    return y.reshape(*lead, *out_shape)


def glu_applies(w_shape: tuple[int, ...]) -> bool:
    """Whether `layer_matmul_glu` takes a stacked gate/up kernel of this shape: [layers, k, 2,
    ffn] with ffn a multiple of PANEL, so the gate's and the up's columns lie in panels of their own."""
    return len(w_shape) == 4 and w_shape[2] == 2 and w_shape[3] % PANEL == 0


def layer_matmul_glu(
    x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, live: jax.Array | int | None = None,
    norm: Optional[Norm] = None,
):  # fmt: skip
    """silu(x @ W[layer][:, 0]) * (x @ W[layer][:, 1]) -> f32[..., ffn]: the SwiGLU of a fused
    gate/up kernel w [layers, k, 2, ffn] f32 in panel order (`to_panels`), read in place, the
    activation computed as the product's tiles leave the registers (no [..., 2, ffn] product in
    memory, no XLA op after). As `jax.nn.silu(gate) * up` up to f32 rounding; `live`, `norm` and
    the order of sums as `layer_matmul`'s."""
    build.require("executor.matmul")
    if not glu_applies(w.shape) or x.shape[-1] != w.shape[1] or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"layer_matmul_glu: x {x.dtype}{list(x.shape)} and w {w.dtype}{list(w.shape)} must be "
                         f"[..., k] and [layers, k, 2, ffn] (ffn a multiple of {PANEL}), both float32")  # fmt: skip
    k, ffn = w.shape[1], w.shape[3]
    rows = int(np.prod(x.shape[:-1]))
    out = jax.ShapeDtypeStruct((rows, ffn), jnp.float32)
    y = jax.ffi.ffi_call("cbjax_layer_matmul_glu", out)(
        x.reshape(rows, k), w.reshape(w.shape[0], 2 * ffn // PANEL, k, PANEL), jnp.asarray(layer, jnp.int32),
        _live(live, rows), *_norm_args(norm, rows, k),
    )
    return y.reshape(*x.shape[:-1], ffn)


def rope_applies(w_shape: tuple[int, ...], head_dim: int) -> bool:
    """Whether `layer_matmul_rope` takes a stacked fused q/k/v kernel of this shape, [layers, k,
    kv_heads, group + 2, head_dim]: its columns in whole panels and column tiles, and head_dim
    even and dividing the kernel's column tile (so a head's halves meet in one tile). False
    where the kernels do not build."""
    if build.ensure_registered() is not None or len(w_shape) != 5 or w_shape[-1] != head_dim:
        return False
    tile = build.tile_columns()
    n = int(np.prod(w_shape[2:]))
    return n % PANEL == 0 and n % tile == 0 and head_dim % 2 == 0 and tile % head_dim == 0


def layer_matmul_rope(
    x: jax.Array, w: jax.Array, layer: jax.Array | int, cos: jax.Array, sin: jax.Array,
    live: jax.Array | int | None = None, norm: Optional[Norm] = None,
) -> jax.Array:  # fmt: skip
    """x [..., k] @ w[layer] -> f32[..., kv_heads, group + 2, head_dim], the fused q/k/v product
    with the rotary embedding (`cbjax.model.llama.rope`) applied to each kv head's group of q
    heads and its k head as the tiles leave the registers; its v head as is. w [layers, k,
    kv_heads, group + 2, head_dim] f32 in panel order (`to_panels`); cos and sin f32[...,
    head_dim] (`cbjax.model.llama.rope_tables`). As `rope` after `layer_matmul` up to f32
    rounding; `live`, `norm` and the order of sums as `layer_matmul`'s."""
    build.require("executor.matmul")
    head_dim = w.shape[-1]
    if (not rope_applies(w.shape, head_dim) or x.shape[-1] != w.shape[1] or cos.shape != (*x.shape[:-1], head_dim)
            or sin.shape != cos.shape or x.dtype != jnp.float32 or w.dtype != jnp.float32):
        raise ValueError(f"layer_matmul_rope: x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)} and cos/sin "
                         f"{list(cos.shape)}/{list(sin.shape)} must be [..., k], [layers, k, kv_heads, group + 2, "
                         f"head_dim] (rope_applies) and [..., head_dim], float32")  # fmt: skip
    k, n, p = _panel_dims(w.shape, 1, 1)
    rows = int(np.prod(x.shape[:-1]))
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    y = jax.ffi.ffi_call("cbjax_layer_matmul_rope", out)(
        x.reshape(rows, k), w.reshape(w.shape[0], n // p, k, p), jnp.asarray(layer, jnp.int32), _live(live, rows),
        cos.astype(jnp.float32).reshape(rows, head_dim), sin.astype(jnp.float32).reshape(rows, head_dim),
        *_norm_args(norm, rows, k), period=np.int64(w.shape[-2]),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], *w.shape[2:])


def _norm_args(norm: Optional[Norm], rows: int, k: int, num_in: int = 1) -> tuple[jax.Array, jax.Array]:
    """The kernels' factor [rows] and scale [k] operands (both empty: no norm)."""
    if norm is None:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    factor, scale = norm
    if num_in != 1 or factor.size != rows or scale.shape != (k,):
        raise ValueError(f"native matmul norm: factor {list(factor.shape)} must hold one value a row ({rows}) and "
                         f"scale {list(scale.shape)} be [k] = [{k}], over one contracted axis")  # fmt: skip
    return factor.astype(jnp.float32).reshape(rows), scale.astype(jnp.float32)


def _live(live, rows: int) -> jax.Array:
    return jnp.asarray(rows if live is None else live, jnp.int32)


def matmul_nt(x: jax.Array, w: jax.Array, live: jax.Array | int | None = None) -> jax.Array:
    """x [..., k] @ w.T -> f32[..., n] for w [n, k] (the tied LM head), w read in place. Each
    output sums its lanes' residues of k in order, then the lanes in a tree (16 columns' sums
    folded together by shuffle-add stages; columns past the last whole 16 in lane order), then
    the k % lanes tail: the same alone or in a batch. `live` as `layer_matmul`'s."""
    build.require("executor.matmul")
    if w.ndim != 2 or x.shape[-1] != w.shape[1] or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul_nt: x {x.dtype}{list(x.shape)} does not contract with w {w.dtype}{list(w.shape)} "
                         f"on their last axes (both float32)")  # fmt: skip
    rows = int(np.prod(x.shape[:-1]))
    out = jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32)
    y = jax.ffi.ffi_call("cbjax_matmul_nt", out)(x.reshape(rows, w.shape[1]), w, _live(live, rows))
    return y.reshape(*x.shape[:-1], w.shape[0])


def greedy(logits: jax.Array, live: jax.Array | int | None = None) -> jax.Array:
    """i32[rows]: each of the first `live` rows' first index of its maximum logit, -1 where any
    of its logits is NaN or infinite, 0 for the rows after (`native_tokens.cc`). As
    `cbjax.model.ops.first_argmax` with `mark_non_finite`, in one vectorized pass per
    row where XLA:CPU runs three scalar reductions."""
    build.require("executor.matmul")
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"greedy: logits must be [rows, vocab] with vocab >= 1, got shape {logits.shape}")
    rows = logits.shape[0]
    out = jax.ShapeDtypeStruct((rows,), jnp.int32)
    return jax.ffi.ffi_call("cbjax_greedy", out)(logits.astype(jnp.float32), _live(live, rows))


def embed(table: jax.Array, tokens: jax.Array, feed: jax.Array, prev: jax.Array) -> jax.Array:
    """f32[T, d]: the embedding table's row for each token, where a token with feed >= 0 is the
    previous step's output `prev[feed]` (`native_tokens.cc`). As
    `table[jnp.where(feed >= 0, prev[feed], tokens)]`, without XLA's threads."""
    build.require("executor.matmul")
    if table.ndim != 2 or table.dtype != jnp.float32 or tokens.ndim != 1 or feed.shape != tokens.shape or prev.ndim != 1:
        raise ValueError(f"embed: table must be float32 [vocab, d], tokens and feed [T], prev [R]; got table "
                         f"{table.dtype}{list(table.shape)}, tokens {list(tokens.shape)}, feed {list(feed.shape)}, "
                         f"prev {list(prev.shape)}")  # fmt: skip
    out = jax.ShapeDtypeStruct((tokens.shape[0], table.shape[1]), jnp.float32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return jax.ffi.ffi_call("cbjax_embed", out)(table, i32(tokens), i32(feed), i32(prev))

