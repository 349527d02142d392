"""`NativeOps`: the model's fused ops (`cbjax.model.ops.LayerOps`) on the native CPU kernels.

For a float32 model on one CPU device. The layers' weight matrices are in panel order
(`kernels.to_panels`) and stay out of the layer scan's sliced inputs: each matmul reads layer
`layer_idx` of the stacked matrix in place and multiplies only the step's tokens (not its
bucket's padding). The RMS norm before a matmul and the residual add after it run inside the
matmul (bit for bit XLA's), SwiGLU and RoPE in its epilogue where the kernel shape allows
(`glu_applies`, `rope_applies`) and the kernel is unbiased; elsewhere the op runs the plain
matmul and XLA does the rest, as `XlaOps` does. The K/V write copies the fused product's k and v
rows into an f32 cache in place; the embedding lookup and greedy tokens are single kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.kernels.native import kernels
from cbjax.model.ops import XlaOps, rope_product, rope_tables


@dataclasses.dataclass(frozen=True)
class NativeOps:
    """See the module docstring. `num_tokens` (the step's real tokens), `num_rows` (its used
    rows) and `layer_idx` are set by `bind` and `at_layer`."""

    name = "native"
    num_tokens: Optional[jax.Array] = None
    num_rows: Optional[jax.Array] = None
    layer_idx: Optional[jax.Array] = None

    # ---- split time ----
    def weight_layout(self, w: np.ndarray, num_in: int, lead: int) -> np.ndarray:
        return kernels.to_panels(w, num_in, lead)

    def split_stacked(self, layer_states):
        # the kernels [num_layers, ...] are read whole by every layer; the rest is sliced
        whole, sliced = nnx.split_state(layer_states, nnx.PathContains("kernel"), ...)
        return (whole,), sliced

    # ---- step time ----
    def bind(self, batch) -> NativeOps:
        return dataclasses.replace(
            self, num_tokens=batch.md.query_start[-1], num_rows=jnp.sum(batch.md.kv_lens > 0)
        )

    def at_layer(self, layer_idx) -> NativeOps:
        return dataclasses.replace(self, layer_idx=layer_idx)

    def embed(self, table, tokens, feed, prev):
        return kernels.embed(table, tokens, feed, prev)

    def _matmul(self, x, dense, norm=None, residual=None):
        return kernels.layer_matmul(x, dense.kernel[...], self.layer_idx, dense.num_in, live=self.num_tokens,
                                    norm=norm, residual=residual)  # fmt: skip

    def norm_matmul(self, x, norm, dense):
        y = self._matmul(x, dense, norm=norm.parts(x))
        return y if dense.bias is None else y + dense.bias[...]

    def matmul_residual(self, x, dense, residual):
        if dense.bias is None:  # added as the tiles are stored
            return self._matmul(x, dense, residual=residual)
        return residual + (self._matmul(x, dense) + dense.bias[...])

    def glu(self, x, norm, gate_up):
        w = gate_up.kernel[...]  # [num_layers, d_model, 2, ffn_dim]
        if gate_up.bias is None and kernels.glu_applies(w.shape):  # SwiGLU in the epilogue
            return kernels.layer_matmul_glu(x, w, self.layer_idx, live=self.num_tokens, norm=norm.parts(x))
        out = self.norm_matmul(x, norm, gate_up)
        return jax.nn.silu(out[..., 0, :]) * out[..., 1, :]

    def qkv_rope(self, x, norm, qkv, positions, theta, scaling=None):
        w = qkv.kernel[...]  # [num_layers, d_model, num_kv_heads, group + 2, head_dim]
        head_dim = w.shape[-1]
        if qkv.bias is None and kernels.rope_applies(w.shape, head_dim):  # RoPE in the epilogue
            cos, sin = rope_tables(positions, head_dim, theta, scaling)
            return kernels.layer_matmul_rope(x, w, self.layer_idx, cos, sin, live=self.num_tokens,
                                             norm=norm.parts(x))  # fmt: skip
        return rope_product(self.norm_matmul(x, norm, qkv), positions, theta, scaling)

    def write_kv(self, product, write_idx, layer_idx, k_pages, v_pages):
        if k_pages.dtype != jnp.float32:
            return XlaOps().write_kv(product, write_idx, layer_idx, k_pages, v_pages)
        return kernels.write_kv(product, write_idx, layer_idx, k_pages, v_pages)

    def logits(self, x, norm, lm_head: Optional[Any], table):
        if lm_head is not None:  # the final norm in the matmul's prologue
            return kernels.layer_matmul(x, lm_head[...][None], 0, 1, live=self.num_rows, norm=norm.parts(x))
        return kernels.matmul_nt(norm(x), table[...], live=self.num_rows)  # tied: the table read in place

    def head(self, x, logits_idx, norm, lm_head, table, live=None):
        # all R rows: the kernels write zeros past the used ones (or `live`) themselves
        ops = self if live is None else dataclasses.replace(self, num_rows=live)
        num_rows = logits_idx.shape[0]
        cap = min(num_rows, x.shape[0])
        logits = ops.logits(x[logits_idx], norm, lm_head, table).astype(jnp.float32)  # f32[R, vocab_size]
        greedy = kernels.greedy(logits, jnp.minimum(ops.num_rows, cap))
        return greedy, logits
