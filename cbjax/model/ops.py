"""The model's fused ops behind one seam: `LayerOps`, and its XLA implementation `XlaOps`.

The decoder (`cbjax.model.llama`) and the step (`cbjax.runtime.step`) call only these ops; an
implementation decides how each runs (which kernel, which weight layout, which fusions). Each
op states its result as plain jnp would compute it; an implementation may fuse, reorder memory
or skip padding rows, but must return those values (up to f32 rounding where it says so).

Weights reach an op as the model's modules (`Dense`: `kernel`, `bias`, `num_in`; `RMSNorm`:
callable, `factor`, `scale`), so an implementation can read a kernel in its own layout and
handle a bias itself. Implementations register by name in `cbjax.kernels.registry`
(`executor.matmul`); `XlaOps` is "xla", the one every backend has.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class LayerOps(Protocol):
    """What a step needs from an implementation (shapes: T tokens, R rows, d = d_model).

    Split time (host, once):
      weight_layout(w, num_in, lead) -> w as this implementation reads it (numpy; same shape).
      split_stacked(layer_states) -> (whole, sliced): the parts of the stacked layer weights the
        layer scan passes whole (read by layer index) and the parts it slices per layer.
    Step time:
      bind(batch) -> the ops for one step (they may read its live token and row counts).
      at_layer(layer_idx) -> the ops for one layer of the scan.
      embed(table, tokens, feed, prev) -> [T, d]: table[where(feed >= 0, prev[feed], tokens)].
      norm_matmul(x, norm, dense) -> dense(norm(x)).
      matmul_residual(x, dense, residual) -> residual + dense(x).
      glu(x, norm, gate_up) -> silu(gate) * up of gate_up(norm(x)) [..., 2, ffn].
      qkv_rope(x, norm, qkv, positions, theta, scaling=None) -> qkv(norm(x)) [..., kv_heads,
        group + 2, head_dim] with RoPE (`rope`) applied to each kv head's query heads and its k head.
      write_kv(product, write_idx, layer_idx, k_pages, v_pages) -> (k_pages, v_pages) with the
        product's k and v rows written at write_idx of layer layer_idx.
      logits(x, norm, lm_head, table) -> f32[..., vocab]: norm(x) @ lm_head, or @ table.T (tied).
      head(x, logits_idx, norm, lm_head, table, live=None) -> (greedy i32[R], logits f32[R, vocab]):
        the logits at each flat token logits_idx[r] and its greedy token (-1 where its logits are
        not finite); rows past min(R, T) hold zeros, and so may rows at or past `live` (i32[];
        None: the step's used rows, the head at each row's last token).
    """

    name: str

    def weight_layout(self, w: np.ndarray, num_in: int, lead: int) -> np.ndarray: ...
    def split_stacked(self, layer_states: Any) -> tuple[tuple, Any]: ...
    def bind(self, batch: Any) -> LayerOps: ...
    def at_layer(self, layer_idx: jax.Array) -> LayerOps: ...
    def embed(self, table: jax.Array, tokens: jax.Array, feed: jax.Array, prev: jax.Array) -> jax.Array: ...
    def norm_matmul(self, x: jax.Array, norm: Any, dense: Any) -> jax.Array: ...
    def matmul_residual(self, x: jax.Array, dense: Any, residual: jax.Array) -> jax.Array: ...
    def glu(self, x: jax.Array, norm: Any, gate_up: Any) -> jax.Array: ...
    def qkv_rope(self, x: jax.Array, norm: Any, qkv: Any, positions: jax.Array, theta: float,
                 scaling: Optional[RopeScaling] = None) -> jax.Array: ...  # fmt: skip
    def write_kv(self, product: jax.Array, write_idx: jax.Array, layer_idx, k_pages: jax.Array,
                 v_pages: jax.Array) -> tuple[jax.Array, jax.Array]: ...  # fmt: skip
    def logits(self, x: jax.Array, norm: Any, lm_head: Any, table: Any) -> jax.Array: ...
    def head(self, x: jax.Array, logits_idx: jax.Array, norm: Any, lm_head: Any, table: Any,
             live: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]: ...  # fmt: skip


class RopeScaling(NamedTuple):
    """How a checkpoint stretches RoPE past its training context (Hugging Face's `rope_type`):

    - "linear": every frequency divided by `factor` (position interpolation);
    - "llama3" (Llama 3.1 and later): a frequency whose wavelength exceeds
      original_max_len / low_freq_factor is divided by `factor`, one whose wavelength is under
      original_max_len / high_freq_factor is kept, and one between is blended linearly in
      original_max_len / wavelength from the divided to the kept value.

    Neither rescales cos and sin. Hashable: it reaches jitted code as a static value."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> jax.Array:
    """f32[head_dim / 2]: the rotary frequencies theta^(-2i / head_dim), scaled by `scaling`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    slow = inv_freq / scaling.factor
    if scaling.kind == "linear":
        return slow
    if scaling.kind != "llama3":
        raise ValueError(f"rope scaling: unknown kind {scaling.kind!r} (linear, llama3)")
    turns = scaling.original_max_len / (2 * math.pi / inv_freq)  # the training context over each wavelength
    blend = (turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    mixed = (1 - blend) * slow + blend * inv_freq
    return jnp.where(turns > scaling.high_freq_factor, inv_freq, jnp.where(turns < scaling.low_freq_factor, slow, mixed))


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, scaling: Optional[RopeScaling] = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[..., head_dim] of each position's rotary angles (each frequency twice:
    the rotate_half convention's halves share them), positions i32[...]."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)  # f32[half]
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # f32[..., half]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # f32[..., head_dim]
    return jnp.cos(angles), jnp.sin(angles)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: Optional[RopeScaling] = None) -> jax.Array:
    """Rotary embedding, Hugging Face rotate_half convention: x [..., n, head_dim], positions i32[...]."""
    half = x.shape[-1] // 2
    cos, sin = rope_tables(positions, x.shape[-1], theta, scaling)
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


def rope_product(
    product: jax.Array, positions: jax.Array, theta: float, scaling: Optional[RopeScaling] = None
) -> jax.Array:
    """A fused q/k/v product [..., kv_heads, group + 2, head_dim] with `rope` applied to its q
    and k heads (each kv head's first group + 1 entries), its v heads as they are."""
    qk = product[..., :-1, :]  # [..., kv_heads, group + 1, head_dim]
    lead = qk.shape[:-3]
    roped = rope(qk.reshape(*lead, -1, qk.shape[-1]), positions, theta, scaling).reshape(qk.shape)
    return jnp.concatenate([roped, product[..., -1:, :]], axis=-2)


def write_layer(
    pages: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    layer_idx,
    write_idx: jax.Array,  # i32[T]: page * page_size + offset per token
    new: jax.Array,  # [T, num_kv_heads, head_dim]
) -> jax.Array:
    """`pages` with layer `layer_idx`'s slots at write_idx set to `new` (in place when donated)."""
    num_layers, num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_layers, num_kv_heads, num_pages * page_size, head_dim)
    # Integer and array indices split by a slice: numpy puts the indexed dim [T] first.
    flat = flat.at[layer_idx, :, write_idx].set(new.astype(pages.dtype))
    return flat.reshape(pages.shape)


def first_argmax(logits: jax.Array) -> jax.Array:
    """i32[...]: the first index of each row's maximum, as `jnp.argmax` (for finite rows) but as
    two plain reductions, which XLA:CPU runs faster than argmax's (value, index) reduction."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, iota, logits.shape[-1]), axis=-1).astype(jnp.int32)


def mark_non_finite(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens, -1 where a row of logits holds a NaN or an infinity."""
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, -1)


def dense_apply(dense: Any, x: jax.Array) -> jax.Array:
    """x's last `dense.num_in` axes contracted with the kernel's first, plus the bias."""
    y = jnp.tensordot(x, dense.kernel[...], axes=dense.num_in)
    return y if dense.bias is None else y + dense.bias[...]


class XlaOps:
    """`LayerOps` as plain jnp: XLA fuses what it can. The weights stay row-major and the scan
    slices each layer's weights."""

    name = "xla"

    def weight_layout(self, w: np.ndarray, num_in: int, lead: int) -> np.ndarray:
        return w

    def split_stacked(self, layer_states):
        return (), layer_states

    def bind(self, batch) -> XlaOps:
        return self

    def at_layer(self, layer_idx) -> XlaOps:
        return self

    def embed(self, table, tokens, feed, prev):
        return table[jnp.where(feed >= 0, prev[jnp.maximum(feed, 0)], tokens)]

    def norm_matmul(self, x, norm, dense):
        return dense_apply(dense, norm(x))

    def matmul_residual(self, x, dense, residual):
        return residual + dense_apply(dense, x)

    def glu(self, x, norm, gate_up):
        gate_up_out = dense_apply(gate_up, norm(x))  # [..., 2, ffn_dim]
        return jax.nn.silu(gate_up_out[..., 0, :]) * gate_up_out[..., 1, :]

    def qkv_rope(self, x, norm, qkv, positions, theta, scaling=None):
        return rope_product(self.norm_matmul(x, norm, qkv), positions, theta, scaling)

    def write_kv(self, product, write_idx, layer_idx, k_pages, v_pages):
        k_pages = write_layer(k_pages, layer_idx, write_idx, product[..., -2, :])
        v_pages = write_layer(v_pages, layer_idx, write_idx, product[..., -1, :])
        return k_pages, v_pages

    def logits(self, x, norm, lm_head: Optional[Any], table):
        h = norm(x)
        w = table[...].T if lm_head is None else lm_head[...]
        return jnp.dot(h, w, preferred_element_type=jnp.float32)

    def head(self, x, logits_idx, norm, lm_head, table, live=None):
        # A step of T tokens holds at most T rows, filled first to last: in a bucket smaller
        # than the slot array only the first T rows can have logits, so the LM head runs on
        # those and the outputs are padded with zeros (idle rows, never read).
        # `live` is a bound the native kernels use; here every row up to min(R, T) is computed.
        num_rows = logits_idx.shape[0]
        cap = min(num_rows, x.shape[0])
        logits = self.logits(x[logits_idx[:cap]], norm, lm_head, table)  # f32[cap, vocab_size]
        greedy = mark_non_finite(logits, first_argmax(logits))
        if cap < num_rows:
            logits = jnp.pad(logits, ((0, num_rows - cap), (0, 0)))
            greedy = jnp.pad(greedy, (0, num_rows - cap))
        return greedy, logits
